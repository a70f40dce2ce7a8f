"""Equivalence with per-stage parallelism inside the pipeline: TP, ZeRO 1-3, expert parallel.

The rewrites themselves are issue 6's (backends/parallel/__init__.py); this checks
that the runtime wires them in so a whole pipelined run still equals
single-process training, judged in float64 (3 steps, SGD with momentum, gradient
clipping at 0.5; losses, step-1 gradients and parameters within rtol 1e-9,
atol 1e-12; AdamW on zero2 and ep2-zbv): including ZeRO-3 with the prefetch window,
clipping with ZeRO and TP together (zero1-tp2), and activation recompute
inside rewritten stages (TP/SP selective, ZeRO-3 and EP full). Real MoE models
(transformers') with EP in float64: test_equivalence_moe.py.
"""
from __future__ import annotations

import dataclasses

import pytest

from pipeplan.backends.verify.reference import train_reference
from pipeplan.backends.verify.run import judge
from .judging import train_for_judge
from pipeplan.dsl.ast import ExpertsSpec, MeshSpec, RecomputeRule, TensorSpec

from .test_equivalence import ADAMW, STEPS, make_plan  # noqa: E402

TENSOR = TensorSpec(column=("layers.*.attn.q", "layers.*.attn.k", "layers.*.attn.v",
                            "layers.*.mlp.up"),
                    row=("layers.*.attn.proj", "layers.*.mlp.down"), vocab=("tok_emb", "lm_head"))
EXPERTS = ExpertsSpec(modules=("layers.*.moe",), num_experts=4, top_k=2)


def parallel_plan(name: str):
    if name == "zero1-tp2":  # clipping with ZeRO and TP: the shards' own global norm
        plan = make_plan("gpt", "1f1b", 1, 2)
        return dataclasses.replace(plan, mesh=MeshSpec(pp=1, dp=2, tp=2), tensor=TENSOR, zero=1)
    if name.startswith("tp2"):
        plan = make_plan("gpt", "1f1b", 2, 1)
        tensor = dataclasses.replace(TENSOR, sequence_parallel="-sp" in name)
        return dataclasses.replace(plan, mesh=MeshSpec(pp=2, tp=2), tensor=tensor)
    if name.startswith("zero"):
        stage, _, kind = name.partition("-")
        plan = make_plan("gpt", kind or "1f1b", 2, 2, *ADAM_ON.get(name, ()))
        return dataclasses.replace(plan, zero=int(stage[-1]))
    kind = name.split("-")[1]
    plan = make_plan("moe", kind, 2, 2, *ADAM_ON.get(name, ()))
    return dataclasses.replace(plan, mesh=MeshSpec(pp=2, dp=2, ep=2), experts=EXPERTS)


CONFIGS = ("tp2", "tp2-sp", "zero1", "zero2", "zero3", "zero3-zbv", "zero1-tp2",
           "ep2-1f1b", "ep2-zbv")
ADAM_ON = {"zero2": (ADAMW,), "ep2-zbv": (ADAMW,)}
# activation recompute inside the rewritten stages (TP collectives rerun under full, kept
# under selective; EP's rerun)
RECOMPUTE = {"tp2": "full", "tp2-sp": "selective", "tp2-sp-full": "full", "zero3-zbv": "full",
             "ep2-zbv": "full"}


def recompute_plan(name: str):
    return dataclasses.replace(parallel_plan(name),
                               recompute=(RecomputeRule("layers.*", RECOMPUTE[name]),))


def _worker(rank, world, configs=CONFIGS, make=parallel_plan):
    return [train_for_judge(make(name), STEPS) for name in configs]


@pytest.mark.slow
@pytest.mark.timeout(480)
@pytest.mark.parametrize("recompute", [
    False,
    # (45 s on 2 cores; recompute under tp2 + sp in the default suite:
    # test_random_draws.py's dropout model at pp2 x tp2 with sp and recompute)
    pytest.param(True, marks=pytest.mark.heavy)], ids=["plain", "recompute"])
def test_stage_parallelism_inside_the_pipeline(spawn, recompute):
    configs, make = (tuple(RECOMPUTE), recompute_plan) if recompute else (CONFIGS, parallel_plan)
    results = spawn(_worker, 4, configs, make, timeout=400)
    failures = []
    for k, name in enumerate(configs):
        plan = make(name)
        ref = train_reference(plan, STEPS)
        got = judge(ref, [r[k] for r in results])
        if not got.within:
            failures.append(f"{name}: " + got.render())
    assert not failures, "\n".join(failures)
