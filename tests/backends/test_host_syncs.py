"""Host reads of device values in the training step, counted per step, by the line asking.

On a GPU every read of a device value on the host (`.item()`, `float()`, `bool()`,
`.tolist()`, and ops whose output shape depends on the values: `nonzero`, boolean masks,
`bincount`, `repeat_interleave` without `output_size`) blocks the host until the device
has caught up, which stalls a pipeline. `HostReads` counts them on CPU, where the same
code runs: a TorchDispatchMode sees the aten ops that read values on the host on a GPU
(`_local_scalar_dense` is what item/float/bool/int call), and `Tensor.tolist` /
`Tensor.numpy`, which bypass the dispatcher, are wrapped. Each read is charged to the
innermost frame of pipeplan's runtime (or to "model" when the model's own code asked).
What CPU cannot show: a device-to-host copy (`.cpu()`, `.to("cpu")`) is no copy on CPU.

The test trains two plans in one 2-process gloo world and asserts every step's reads,
exactly: the loss once per step (and the gradient norm once when the plan clips), and
expert dispatch once per MoE layer call (its all-to-all split sizes: docs/runtime.md) --
so a new host read anywhere in the step fails here, naming its line.
"""
from __future__ import annotations

import collections
import dataclasses
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pipeplan.dsl.ast import ExpertsSpec, MeshSpec, RecomputeRule

from .test_equivalence import make_plan

ROOT = Path(__file__).resolve().parents[2]  # the package root
aten = torch.ops.aten
READS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default,
         aten.bincount.default, aten._unique2.default, aten.unique_consecutive.default,
         aten.unique_dim.default}


def _reads_host(func, args, kwargs) -> bool:
    if func in READS:
        return True
    if func is aten.repeat_interleave.Tensor:  # sizes its output from the repeats' sum
        return kwargs.get("output_size") is None
    if func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default):
        indices = args[1]  # a boolean index is a nonzero
        return any(i is not None and i.dtype == torch.bool for i in indices)
    return False


def _site() -> str:
    """The innermost frame of pipeplan asking (tests and torch skipped); "model" for the
    model's own code (its source file, or a captured graph's generated code)."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith("<eval_with_key"):
            return "model"
        try:
            rel = Path(path).resolve().relative_to(ROOT)
        except ValueError:
            frame = frame.f_back
            continue
        if rel.parts[0] == "tests":
            frame = frame.f_back
            continue
        if rel.parts[:2] == ("examples", "models"):
            return "model"
        return f"{rel}:{frame.f_code.co_name}"
    return "?"


class HostReads(TorchDispatchMode):
    """Counts host reads of tensor values by site while active (see the module docstring)."""

    def __init__(self):
        super().__init__()
        self.sites: collections.Counter = collections.Counter()
        self._wrapped = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _reads_host(func, args, kwargs):
            self.sites[_site()] += 1
        return func(*args, **kwargs)

    def __enter__(self):
        for name in ("tolist", "numpy"):
            original = getattr(torch.Tensor, name)
            self._wrapped[name] = original

            def counted(t, *a, _original=original, **k):
                self.sites[_site()] += 1
                return _original(t, *a, **k)
            setattr(torch.Tensor, name, counted)
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in self._wrapped.items():
            setattr(torch.Tensor, name, original)
        return super().__exit__(*exc)


STEPS = 3


def _moe_plan():
    """pp2 zbv (two stages per rank, B and W split), the MoE GPT with a capacity factor (the
    runtime dispatches the tokens), clipping, fp64."""
    plan = make_plan("moe", "zbv", 2, 1)
    return dataclasses.replace(plan, experts=ExpertsSpec(
        modules=("layers.*.moe",), num_experts=4, top_k=2, dropless=False,
        capacity_factor=1.0))


def _zero3_plan():
    """dp2 ZeRO-3 (gather / prefetch / release around each action), 1f1b, activation recompute,
    clipping over the shards."""
    plan = make_plan("gpt", "1f1b", 1, 2)
    return dataclasses.replace(plan, mesh=MeshSpec(pp=1, dp=2), zero=3,
                               recompute=(RecomputeRule("layers.*", "full"),))


PLANS = {"moe": _moe_plan, "zero3": _zero3_plan}


def _count(rank, world, names):
    from pipeplan.backends.runtime.trainer import PipelineTrainer

    out = {}
    for name in names:
        trainer = PipelineTrainer.for_plan(PLANS[name]())
        per_step = []
        for t in range(STEPS):
            with HostReads() as reads:
                trainer.step(t)
            per_step.append(dict(reads.sites))
        out[name] = per_step
    return out


STEP = "backends/runtime/trainer.py:step"  # the loss, once
NORM = "backends/runtime/grads.py:global_norm"  # the gradient norm, once when clipping
DISPATCH = "compiler/parallel/ep_dispatch.py:routed_call"  # split sizes, once per MoE call


@pytest.mark.slow
def test_the_step_reads_the_device_once_per_step_and_once_per_moe_call(spawn):
    results = spawn(_count, 2, list(PLANS), timeout=240)
    moe_layers_per_rank = 2  # 4 layers over 4 stages, 2 stages per rank
    microbatches = _moe_plan().microbatches
    for rank, got in enumerate(results):
        for t in range(STEPS):
            assert got["moe"][t] == {STEP: 1, NORM: 1,
                                     DISPATCH: moe_layers_per_rank * microbatches}, (rank, t)
            assert got["zero3"][t] == {STEP: 1, NORM: 1}, (rank, t)


def test_the_counter_sees_every_kind_of_host_read():
    """What the counter counts, so the test above cannot pass by seeing nothing."""
    x = torch.arange(6.0)
    with HostReads() as reads:
        x.sum().item()
        float(x.max())
        bool(x.any())
        x.tolist()
        x[x > 2]
        torch.nonzero(x)
        torch.arange(2).repeat_interleave(torch.tensor([1, 2]))
        torch.bincount(torch.tensor([1, 2]), minlength=4)
        torch.arange(2).repeat_interleave(torch.tensor([1, 2]), output_size=3)  # not a read
        x.scatter_add(0, torch.tensor([0, 0]), torch.ones(2))  # not a read
    assert sum(reads.sites.values()) == 8, reads.sites
