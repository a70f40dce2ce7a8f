"""compile.mode = graphs under tensor parallelism: a ZBV step runs exactly as many matmuls
as eager, and B and W split the backward's matmuls between them.

The GPT on tp=2 under ZBV (pp=1: both V stages on each rank; B and W are separate
actions), dim 24 and vocab 40 so that no parameter shard has a dimension of a
microbatch's token count (64). Matmuls are counted at dispatch (a TorchDispatchMode, not
the partitioner's node lists) over the second step (the first traces the graphs), eager
and graphs mode on the same rank. Each rank's B graphs are then read: every matmul in them
produces a tokens-sized result (an input gradient), none a parameter-shard-sized one; W's
the reverse (as tests/backends/test_graphs_parallel.py classifies them, heavy, on pp=2).
"""
from __future__ import annotations

import dataclasses
import math

import pytest

from pipeplan.dsl.ast import CompileSpec, MeshSpec, Plan, TensorSpec
from pipeplan.tests.backends.test_equivalence import ADAMW, make_plan

from .test_graphs_mode import _Count
from .test_graphs_parallel import COLUMN, ROW, _graph_facts

TOKENS = 4 * 16  # a microbatch: global batch 8 / 2 microbatches, seq 16


def tp_zbv(mode: str) -> Plan:
    plan = dataclasses.replace(make_plan("gpt", "zbv", 1, 1, ADAMW),
                               mesh=MeshSpec(pp=1, tp=2), tensor=TensorSpec(column=COLUMN, row=ROW))
    model = dataclasses.replace(plan.model, args={**plan.model.args, "dim": 24, "vocab": 40})
    return dataclasses.replace(plan, model=model, data=dataclasses.replace(plan.data, vocab=40),
                               compile=CompileSpec(mode=mode))


def _step_matmuls(plan: Plan):
    """This rank's matmuls in the second step of `plan`, and the trainer."""
    from pipeplan.backends.runtime.trainer import PipelineTrainer

    trainer = PipelineTrainer.for_plan(plan)
    trainer.step(0)
    with _Count() as count:
        trainer.step(1)
    return count.matmuls, trainer


def _worker(rank, world):
    eager = _step_matmuls(tp_zbv("eager"))[0]
    graphs, trainer = _step_matmuls(tp_zbv("graphs"))
    return eager, graphs, _graph_facts(trainer)


@pytest.mark.timeout(200)
def test_tp2_zbv_step_runs_as_many_matmuls_as_eager_and_b_no_weight_gradient(spawn):
    for eager, graphs, facts in spawn(_worker, 2, timeout=180):
        assert eager > 0 and graphs == eager, (eager, graphs)
        assert any(f["B"] for f in facts)
        for f in facts:
            assert f["W"]
            if not f["input_grads"]:
                continue
            assert all(TOKENS in s for s in f["B"]), f"B ran a weight-gradient matmul: {f['B']}"
            assert all(TOKENS not in s and math.prod(s) in f["sizes"] for s in f["W"]), \
                f"W ran an input-gradient matmul: {f['W']} sizes {sorted(f['sizes'])}"
