"""Context parallel in `compile.mode = graphs`: ring and Ulysses attention traced into the
stages' joint graphs, their collectives functional collectives, equal to single-process
float64 training.

`RopeLM` (tests/parallel/cp_models.py) on pp2 x cp2 under ZBV (B and W split: the
attention backward, with its ring hops or inverse all-to-alls, lands in B), 3 AdamW steps
with clipping, against tp_reference.reference_run (the unmodified model on whole
sequences, torch's AdamW; no pipeplan code), as tests/parallel/test_context_parallel.py
judges eager mode. Each rank's graphs are read: F and B carry the cp collectives
(`_c10d_functional.all_to_all_single`), W none (attention has no weights; on the first
stage, which has no input gradients, the whole backward is W).
"""
from __future__ import annotations

import dataclasses

import pytest

from pipeplan.dsl.ast import CompileSpec

from .pipelined_vs_reference import assert_trains_like_reference
from .test_context_parallel import STEPS, make_plan


def graphs_plan(name: str):
    return dataclasses.replace(make_plan(name), compile=CompileSpec(mode="graphs"))


def _collectives(part) -> list[str]:
    return [str(n.target) for n in part.gm.graph.nodes
            if n.op == "call_function" and "c10d_functional" in str(n.target)]


def _graphs_carry_the_collectives(trainer) -> None:
    """Each stage's graphs (traced in training) hold the cp collectives in F and B only."""
    from pipeplan.backends.runtime.graph_stage import GraphStageRunner

    for runner in trainer.runners.values():
        assert isinstance(runner, GraphStageRunner)
        for compiled in runner._by_shape.values():
            g = compiled.graphs
            assert any("all_to_all_single" in c for c in _collectives(g.F)), g.F.gm.code
            if not g.joint.grad_inputs:  # the first stage: its whole backward is W
                assert any("all_to_all_single" in c for c in _collectives(g.W))
                continue
            assert any("all_to_all_single" in c for c in _collectives(g.B)), g.B.gm.code
            assert not _collectives(g.W), _collectives(g.W)


def _worker(rank, world, name):
    plan = graphs_plan(name)
    checked = []

    def inspect(trainer):
        checked.append(trainer)

    assert_trains_like_reference(plan, name, STEPS, inspect)
    _graphs_carry_the_collectives(checked[0])


@pytest.mark.timeout(200)
@pytest.mark.parametrize("name", ["ring-zbv", "zbv"])
def test_cp_in_graphs_mode_equals_reference(run_workers, name):
    run_workers(_worker, 4, name, timeout=180)
