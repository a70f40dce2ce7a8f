"""compile.mode = inductor with tensor and expert parallelism: inductor compiles the F / B / W
/ BW graphs with their functional collectives (all-reduce, all-gather, all-to-all), which it
lowers to calls of the same collectives on the process group.

Judged as tests/backends/test_graphs_mode.py judges inductor on a plain pipeline: 20
float32 steps against the unmodified model trained in one process in float32, under the
judge's float32 rule (compare.py). TP: the GPT on tp=2 (1F1B, one stage per rank); EP:
the MoE GPT on dp=2 x ep=2 (static dispatch). Heavy: inductor compiles every graph of
every rank on first use (a disk cache serves later runs).
"""
from __future__ import annotations

import dataclasses

import pytest

from pipeplan.backends.verify.reference import train_reference
from pipeplan.backends.verify.run import judge
from pipeplan.dsl.ast import CompileSpec, ExpertsSpec, MeshSpec, Plan, TensorSpec
from pipeplan.tests.backends.test_equivalence import ADAMW, make_plan

from .judging import train_for_judge
from .test_graphs_parallel import COLUMN, ROW

STEPS = 20


def inductor_plan(what: str, mode: str = "inductor") -> Plan:
    """tp: GPT pp=1 x tp=2; ep: MoE GPT pp=1 x dp=2, ep=2; float32, 20 AdamW steps."""
    if what == "tp":
        plan = dataclasses.replace(make_plan("gpt", "1f1b", 1, 1, ADAMW),
                                   mesh=MeshSpec(tp=2), tensor=TensorSpec(column=COLUMN, row=ROW))
    else:
        plan = dataclasses.replace(make_plan("moe", "1f1b", 1, 2, ADAMW),
                                   mesh=MeshSpec(dp=2, ep=2),
                                   experts=ExpertsSpec(modules=("layers.*.moe",), num_experts=4))
    return dataclasses.replace(plan, compile=CompileSpec(mode=mode),
                               train=dataclasses.replace(plan.train, precision="fp32",
                                                         steps=STEPS))


def _worker(rank, world, what, cache):
    import os

    from pipeplan.backends.runtime import inductor

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    result = train_for_judge(inductor_plan(what), STEPS)
    return result, [(c.part, c.seconds, c.cache_hit) for c in inductor.COMPILES]


@pytest.mark.heavy
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("what", ["tp", "ep"])
def test_inductor_with_tp_and_ep_within_the_fp32_rule(spawn, tmp_path, what):
    out = spawn(_worker, 2, what, str(tmp_path), timeout=1400)
    plan = inductor_plan(what)
    got = judge(train_reference(plan, STEPS), [o[0] for o in out], precision="fp32")
    assert got.grads_compared and got.within, got.render()
    assert all(compiles for _, compiles in out)  # inductor compiled this rank's graphs
    print(what, "inductor compile s per rank:",
          [round(sum(s for _, s, _ in c), 1) for _, c in out])
