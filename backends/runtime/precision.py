"""Precision: fp32 (default), bf16 autocast over fp32 master weights, or fp64 throughout.

`train.precision = fp64` (what `pipeplan verify` runs by default) converts the
model to float64 before it is captured (compiler/estimate/precision.py's `to_precision`,
called by the compiler's driver and by the reference), so every dtype the runtime derives
from the trace follows: stage boundary specs and receive buffers, gradients,
DP/tied all-reduces, ZeRO flat buffers, optimizer states and expert
all-to-alls all carry float64. No autocast runs.

`train.precision = bf16` runs every stage forward (and every recompute) under
`torch.autocast(device, bfloat16)`. Parameters, their gradients and the
optimizer state stay fp32 (autocast casts weights per op, and a gradient
flowing back into an fp32 parameter is fp32), so gradient reductions and the
optimizer step are fp32 as before. fp32 is the default.

Tensors crossing stages go in the dtype autocast actually produces: a
projection's output is bf16, a residual sum of fp32 and bf16 is fp32. The
compiled `StageSpec.outputs` carry the dtypes of the fp32 trace, so
`boundary_specs` derives the autocast dtypes once, at start-up, by running
every stage (each rank still holds the whole model then) on step 0's first
microbatch under autocast, without autograd, with the RNG state and buffers
put back. Every rank derives the same table, so no rank asks another for a
dtype, ever (no per-step handshake). The derivation runs on CPU with CPU
autocast; CUDA's autocast op lists may differ, which the executor's send
check would report, naming the value.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, ContextManager, Sequence

import torch

from ...compiler.compiled import BATCH, StageSpec
from ...dsl.ast import Plan
from . import data


def autocast_for(precision: str, device: torch.device) -> Callable[[], ContextManager]:
    """A factory of the forward's autocast context (a no-op for fp32 and fp64)."""
    if precision in ("fp32", "fp64"):
        return contextlib.nullcontext
    if precision == "bf16":
        return lambda: torch.autocast(device.type, dtype=torch.bfloat16)
    raise ValueError(f"unknown precision {precision!r}")


def boundary_specs(plan: Plan, stages: Sequence[StageSpec]) -> list[StageSpec]:
    """The stage specs with each output's dtype as produced under the plan's autocast."""
    if plan.train.precision != "bf16":
        return list(stages)
    autocast = autocast_for(plan.train.precision, torch.device("cpu"))
    out = []
    with torch.random.fork_rng(devices=[]), torch.no_grad(), autocast():
        for spec, produced in chained(plan, stages, _with_buffers_back):
            outputs = tuple(dataclasses.replace(v, dtype=str(x.dtype).removeprefix("torch."))
                            if isinstance(x, torch.Tensor) else v
                            for v, x in zip(spec.outputs, produced))
            out.append(dataclasses.replace(spec, outputs=outputs))
    return out


def chained(plan: Plan, stages: Sequence[StageSpec], call):
    """Every stage run in order on step 0's first microbatch, each fed what the stages before
    it produced: yields (spec, its outputs as a tuple). `call(spec, inputs)` runs one (under
    the caller's contexts: autocast, fake tensors, a counting mode)."""
    batch = data.dp_microbatches(plan, 0, 0)[0]
    values: dict[str, torch.Tensor] = {}
    for spec in stages:
        inputs = [batch.field(r.name) if r.source == BATCH else values[r.name]
                  for r in spec.inputs]
        produced = call(spec, inputs)
        produced = tuple(produced) if isinstance(produced, (tuple, list)) else (produced,)
        values.update({v.name: x for v, x in zip(spec.outputs, produced)})
        yield spec, produced


def _with_buffers_back(spec: StageSpec, inputs: list):
    """The stage's forward, its buffers put back after it."""
    buffers = {k: b.clone() for k, b in spec.module.named_buffers()}
    produced = spec.module(*inputs)
    for k, b in spec.module.named_buffers():
        b.copy_(buffers[k])
    return produced
