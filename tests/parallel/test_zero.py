"""ZeRO 0-3: three AdamW steps over dp ranks equal single-process training; memory adds up.

In float64 (the project's judge: rtol 1e-9, atol 1e-12 per element), so the flat
buffers, reduce-scatters and all-gathers are exercised in float64 too.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pipeplan.backends.parallel.zero.sharding import FlatShard, ZeroOptimizer
from pipeplan.compiler.parallel.zero import FlatLayout, MemoryBytes, expected_memory
from pipeplan.errors import PipeplanError

TOL = dict(rtol=1e-9, atol=1e-12)
DTYPE = torch.float64
SIZE = 8  # bytes per element
MICROBATCHES = 2


def make_model() -> nn.Module:
    # 839 parameters: not a multiple of 2 or 4, so the flat buffer is padded.
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32),
                         nn.Linear(32, 7)).to(DTYPE)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _expected_bytes(stage: int, world: int, numel: int):
    """Written out by hand here, independently of zero_layout.expected_memory."""
    padded = -(-numel // world) * world if stage > 0 else numel
    shard = padded // world if stage > 0 else padded
    params = shard * SIZE if stage == 3 else padded * SIZE
    grads = padded * SIZE if stage <= 1 else shard * SIZE
    optimizer = 2 * shard * SIZE + 4  # exp_avg, exp_avg_sq, and the float32 step counter
    return params, grads, optimizer


def _zero_worker(rank, world, stage, clip):
    group = dist.group.WORLD
    torch.manual_seed(0)
    ref = make_model()
    model = copy.deepcopy(ref)
    ref_opt = adamw(ref.parameters())
    shard = FlatShard(list(model.named_parameters()), group, stage)
    opt = ZeroOptimizer([shard], adamw)
    for step in range(3):
        x = torch.randn(world, MICROBATCHES, 4, 16, dtype=DTYPE)
        y = torch.randn(world, MICROBATCHES, 4, 7, dtype=DTYPE)
        ref_opt.zero_grad()
        F.mse_loss(ref(x), y).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        ref_opt.step()

        opt.zero_grad()
        for m in range(MICROBATCHES):  # what a pipeline runtime does around F and B
            opt.gather()
            out = model(x[rank, m])
            opt.release()
            opt.gather()
            (F.mse_loss(out, y[rank, m]) / (MICROBATCHES * world)).backward()
            opt.release()
        opt.reduce_gradients()
        if clip:
            opt.clip_grad_norm_(clip)
        opt.step()

        mem = opt.memory()
        assert (mem.params, mem.grads, mem.optimizer) == _expected_bytes(stage, world, 839), \
            f"stage {stage} rank {rank}: {mem}"
        assert mem == expected_memory(839, world, stage, "adamw", element_size=SIZE)
        opt.gather()
        for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), **TOL,
                                       msg=lambda m, n=name: f"zero {stage} step {step} {n}: {m}")
        opt.release()


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_three_adamw_steps_equal_single_process(run_workers, stage):
    run_workers(_zero_worker, 2, stage, None)


@pytest.mark.slow
def test_zero3_four_ranks_with_grad_clipping(run_workers):
    run_workers(_zero_worker, 4, 3, 0.05)


def test_layout_pads_to_the_group():
    named = [("a", torch.zeros(3, 2)), ("b", torch.zeros(5))]
    layout = FlatLayout.of(named, 4)
    assert (layout.offsets, layout.numel, layout.padded, layout.shard) == ((0, 6), 11, 12, 3)
    assert layout.shard_range(2) == (6, 9)


def test_unknown_stage_is_an_error():
    with pytest.raises(PipeplanError, match="zero stage 4"):
        FlatShard([("w", nn.Parameter(torch.zeros(2)))], None, 4)


def test_expected_memory_for_sgd():
    assert expected_memory(10, 4, 2, "sgd", momentum=True) == MemoryBytes(48, 12, 12)
    assert expected_memory(10, 4, 3, "sgd") == MemoryBytes(12, 12, 0)
