"""Device selection per rank (no GPU here: CUDA's availability is mocked). Under torchrun with
CUDA each rank takes cuda:LOCAL_RANK and NCCL; without CUDA the CPU and gloo; a LOCAL_RANK
with no GPU of its own is refused before any process group forms (NCCL would refuse two
ranks on one GPU later, less clearly)."""
from __future__ import annotations

import pytest
import torch

from pipeplan.backends.runtime.memory import return_large_blocks_to_os
from pipeplan.backends.runtime.worker import RankEnv, rank_device
from pipeplan.errors import PipeplanError


def _gpus(monkeypatch, n):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)


def test_each_rank_takes_its_local_gpu_and_nccl(monkeypatch):
    _gpus(monkeypatch, 2)
    assert rank_device(RankEnv(rank=3, world_size=4, local_rank=1)) == \
        (torch.device("cuda", 1), "nccl")
    assert rank_device(RankEnv(rank=2, world_size=4, local_rank=0)) == \
        (torch.device("cuda", 0), "nccl")


def test_without_cuda_the_cpu_and_gloo(monkeypatch):
    _gpus(monkeypatch, 0)
    assert rank_device(RankEnv(rank=1, world_size=2, local_rank=1)) == \
        (torch.device("cpu"), "gloo")


def test_two_ranks_on_one_gpu_are_refused(monkeypatch):
    _gpus(monkeypatch, 1)
    with pytest.raises(PipeplanError, match=r"LOCAL_RANK 1, but this node shows 1 CUDA"):
        rank_device(RankEnv(rank=1, world_size=2, local_rank=1))


def test_large_blocks_setting_applies_on_linux():
    import sys
    assert return_large_blocks_to_os() == sys.platform.startswith("linux")


def test_a_batch_field_reaches_a_gpu_through_pinned_memory_without_a_host_sync():
    """torch's copy from pageable memory to CUDA waits for the stream (a host sync per
    microbatch); the executor stages batch fields in pinned memory and copies them
    asynchronously. (Stubs: no GPU here.) On CPU the tensor itself."""
    from pipeplan.backends.runtime.executor import to_device

    calls = []

    class Staged:
        def to(self, device, non_blocking=False):
            calls.append((device, non_blocking))
            return "on the device"

    class Field:
        def pin_memory(self):
            calls.append("pinned")
            return Staged()

    assert to_device(Field(), torch.device("cuda", 1)) == "on the device"
    assert calls == ["pinned", (torch.device("cuda", 1), True)]
    t = torch.arange(3)
    assert to_device(t, torch.device("cpu")) is t
