"""bf16: autocast compute over fp32 master weights, activations crossing stages as produced.

* The MoE example plan as written (pp2 x dp2 with ep2, zbv, AdamW, 20 steps):
  every step's bf16 loss within 5% of the fp32 run's (the documented
  tolerance; the measured gap is in docs/runtime.md), and the bf16 pipelined
  run tracks the bf16 single-process reference (same autocast): within 1e-3
  for two steps (expert parallelism runs each expert's matmul on its routed
  rows only, the dense reference on all rows: other shapes, other bf16
  roundings; measured 2.7e-5 and 2.5e-4), then within 1% (AdamW amplifies
  those differences once they reach the weights: measured at most 3.8e-3,
  about bf16's unit roundoff 2^-8; the fp32 run stays within 1e-7).
  Parameters, gradients and optimizer state stay fp32.
* A dense GPT cut inside an MLP (a bf16 value crosses the boundary): bf16
  pipelined runs under 1f1b and under zbh1 with full recompute equal the
  bf16 reference at rtol 1e-4, atol 1e-5.
* fp64 (what `pipeplan verify` and the equivalence tests run): parameters,
  optimizer states, ZeRO flat buffers and every float value crossing stages
  are float64, on a pp2 and a dp2 x ZeRO-2 run, and in the reference.
"""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from pipeplan.backends.verify.compare import compare
from pipeplan.backends.state.model import build_model
from pipeplan.backends.runtime.precision import boundary_specs
from pipeplan.backends.verify.reference import train_reference
from pipeplan.backends.runtime.trainer import PipelineTrainer
from pipeplan.compiler.driver import compile_plan
from pipeplan.dsl import load_plan
from pipeplan.dsl.ast import RecomputeRule, SplitSpec

from .test_equivalence import ADAMW, STEPS as SHORT, make_plan

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "moe_pp2_ep2_zbv.plan")
STEPS = 20


def example(precision: str):
    return load_plan(EXAMPLE, [f"train.precision={precision}", f"train.steps={STEPS}"])


def trained(plan, steps):
    trainer = PipelineTrainer.for_plan(plan)
    losses = [trainer.step(t).loss for t in range(steps)]
    return trainer, losses


def _moe_worker(rank, world):
    out = {}
    for precision in ("fp32", "bf16"):
        trainer, losses = trained(example(precision), STEPS)
        dtypes = {p.dtype for p in trainer.parameters_by_name().values()}
        dtypes |= {p.grad.dtype for p in trainer.sync.params if p.grad is not None}
        dtypes |= {v.dtype for st in trainer.optimizer.state.values() for v in st.values()
                   if isinstance(v, torch.Tensor) and v.dim() > 0}
        out[precision] = (losses, dtypes)
    return out


@pytest.mark.heavy  # ~1-3 min of 4 ranks on 2 cores; the default suite keeps bf16 pipelining
@pytest.mark.timeout(400)  # (test_bf16_pipeline_equals_bf16_reference)
def test_bf16_moe_example_tracks_fp32_and_equals_its_reference(spawn):
    results = spawn(_moe_worker, 4, timeout=360)
    fp32, bf16 = results[0]["fp32"][0], results[0]["bf16"][0]
    gap = max(abs(a - b) / b for a, b in zip(bf16, fp32))
    print(f"\nmax |loss_bf16 - loss_fp32| / loss_fp32 over {STEPS} steps: {gap:.4f} "
          f"(final {bf16[-1]:.4f} vs {fp32[-1]:.4f})")
    assert gap <= 0.05
    assert fp32[-1] < 0.9 * fp32[0] and bf16[-1] < 0.9 * bf16[0]  # both trained
    assert all(r["bf16"][1] == {torch.float32} for r in results)  # fp32 master state
    ref = train_reference(example("bf16"), STEPS).losses
    gaps = [abs(a - b) / b for a, b in zip(bf16, ref)]
    print("bf16 pipelined vs bf16 reference, relative loss gap per step: "
          + " ".join(f"{g:.1e}" for g in gaps))
    # the same computation up to bf16 rounding of differently shaped expert matmuls and
    # DP-summed gradients (see the module docstring)
    assert max(gaps[:2]) <= 1e-3 and max(gaps) <= 1e-2


CUT = SplitSpec(kind="points", points=("layers.1.mlp.down",))  # gelu's bf16 output crosses
CONFIGS = (("1f1b", None), ("zbh1", RecomputeRule("layers.*", "full")))


def cut_plan(kind, rule):
    plan = make_plan("gpt", kind, 2, 1)
    return dataclasses.replace(
        plan, pipeline=dataclasses.replace(plan.pipeline, split=CUT),
        recompute=(rule,) if rule else (),
        train=dataclasses.replace(plan.train, precision="bf16"))


def _cut_worker(rank, world):
    out = []
    for kind, rule in CONFIGS:
        trainer, losses = trained(cut_plan(kind, rule), SHORT)
        out.append((losses, trainer.named_parameters(),
                    [v.dtype for v in trainer.specs[0].outputs]))
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bf16_pipeline_equals_bf16_reference(spawn):
    results = spawn(_cut_worker, 2, timeout=240)
    ref = train_reference(cut_plan("1f1b", None), SHORT)
    failures = []
    for k, (kind, rule) in enumerate(CONFIGS):
        assert results[0][k][2] == ["float32", "bfloat16"]  # residual fp32, gelu output bf16
        got = compare(ref.losses, ref.params, [r[k][0] for r in results],
                      [r[k][1] for r in results], rtol=1e-4, atol=1e-5)
        if not got.within:
            failures.append(f"{kind} {rule}: " + got.render())
    assert not failures, "\n".join(failures)


def test_boundary_dtypes_are_derived_once_from_the_precision():
    plan = cut_plan("1f1b", None)
    compiled = compile_plan(plan, build_model(plan))
    traced = [v.dtype for v in compiled.stages[0].outputs]
    assert traced == ["float32", "float32"]  # the fp32 trace
    assert [v.dtype for v in boundary_specs(plan, compiled.stages)[0].outputs] == \
        ["float32", "bfloat16"]
    fp32 = dataclasses.replace(plan, train=dataclasses.replace(plan.train, precision="fp32"))
    assert boundary_specs(fp32, compiled.stages) == list(compiled.stages)



def fp64_plan(name: str):
    """pp2 (activations and their gradients cross ranks) or dp2 with ZeRO-2 (flat buffers,
    reduce-scatter), both under AdamW, in float64."""
    if name == "pp2":
        plan = make_plan("gpt", "1f1b", 2, 1, ADAMW)
    else:
        plan = dataclasses.replace(make_plan("gpt", "1f1b", 1, 2, ADAMW), zero=2)
    return dataclasses.replace(plan, train=dataclasses.replace(plan.train, precision="fp64"))


def _fp64_worker(rank, world):
    out = {}
    for name in ("pp2", "dp2-zero2"):
        trainer, _ = trained(fp64_plan(name), 1)
        dtypes = {p.dtype for p in trainer.parameters_by_name().values()}
        dtypes |= {v.dtype for st in trainer.optimizer.state.values() for v in st.values()
                   if isinstance(v, torch.Tensor) and v.dim() > 0}
        if trainer.zero is not None:
            dtypes |= {fs.full.dtype for fs in trainer.zero.optimizer.shards}
            dtypes |= {fs.shard.dtype for fs in trainer.zero.optimizer.shards}
        out[name] = (dtypes, [v.dtype for s in trainer.specs for v in s.outputs])
    return out


@pytest.mark.timeout(300)
def test_fp64_runs_float64_end_to_end(spawn):
    """`train.precision = fp64`: parameters, optimizer states, ZeRO buffers and every float
    value crossing stages (the executor checks each received tensor against its spec)."""
    for rank in spawn(_fp64_worker, 2, timeout=240):
        for name, (dtypes, boundary) in rank.items():
            assert dtypes == {torch.float64}, name
            assert "float32" not in boundary and "float64" in boundary, (name, boundary)
    ref = train_reference(fp64_plan("pp2"), 1)
    assert ref.params["lm_head.weight"].dtype == torch.float64
    assert all(g.dtype == torch.float64 for g in ref.grads.values())
