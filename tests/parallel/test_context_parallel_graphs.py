"""Context parallel in `compile.mode = graphs`: ring and Ulysses attention traced into the
stages' joint graphs, their collectives functional collectives, equal to single-process
float64 training.

`RopeLM` (tests/parallel/cp_models.py) on pp1 x cp2 (1F1B; ring in the default suite,
Ulysses heavy) and, heavy, pp2 x cp2 under
ZBV (B and W split: the attention backward, with its ring hops or inverse all-to-alls,
lands in B), and, heavy, pp2 x cp2 1F1B under inductor and pp1 x cp2 x tp2 (Llama, ring
and Ulysses with sequence parallel; RopeLM with attention whole under tp); 3 AdamW steps
with clipping, against tp_reference.reference_run (the unmodified model on whole
sequences, torch's AdamW; no pipeplan code), as tests/parallel/test_context_parallel.py
judges eager mode. Each rank's graphs are read: F and B carry the cp collectives
(`_c10d_functional.all_to_all_single`), W none (attention has no weights; on the first
stage, which has no input gradients, the whole backward is W).
"""
from __future__ import annotations

import dataclasses

import pytest

from pipeplan.dsl.ast import CompileSpec, MeshSpec, PipelineSpec

from .pipelined_vs_reference import assert_trains_like_reference
from .test_context_parallel import STEPS, make_plan


def graphs_plan(name: str, mode: str = "graphs"):
    """make_plan's names; a "pp1-" prefix: pp=1 x cp=2 (two ranks, one stage each)."""
    pp1 = name.startswith("pp1-")
    plan = make_plan(name.removeprefix("pp1-"))
    if pp1:
        plan = dataclasses.replace(plan, mesh=MeshSpec(pp=1, cp=2),
                                   pipeline=PipelineSpec(schedule="1f1b", microbatches=2))
    return dataclasses.replace(plan, compile=CompileSpec(mode=mode))


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


def _worker(rank, world, name, mode="graphs"):
    plan = graphs_plan(name, mode)
    checked = []

    def inspect(trainer):
        checked.append(trainer)

    assert_trains_like_reference(plan, name, STEPS, inspect)
    _graphs_carry_the_collectives(checked[0])
    if mode == "inductor":
        from pipeplan.backends.runtime import inductor

        assert inductor.COMPILES  # the graphs ran compiled


@pytest.mark.timeout(120)  # ~12 s CPU per rank; Ulysses' twin (and ZBV) under -m heavy
@pytest.mark.parametrize("name", ["pp1-ring-1f1b",
                                  pytest.param("pp1-1f1b", marks=pytest.mark.heavy)])
def test_cp2_in_graphs_mode_equals_reference(run_workers, name):
    run_workers(_worker, 2, name, timeout=100)


@pytest.mark.heavy  # 4 processes, two stages per rank: 25-30 s each on 2 loaded cores
@pytest.mark.timeout(200)
@pytest.mark.parametrize("name", ["ring-zbv", "zbv"])
def test_pp2_cp2_zbv_in_graphs_mode_equals_reference(run_workers, name):
    run_workers(_worker, 4, name, timeout=180)


def _inductor_worker(rank, world, name, cache):
    import os

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    _worker(rank, world, name, "inductor")


@pytest.mark.heavy  # inductor compiles every rank's graphs: ~2 min each on 2 loaded cores
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", ["ring-1f1b", "1f1b"])
def test_pp2_cp2_under_inductor_equals_reference(run_workers, tmp_path, name):
    """float64 through inductor's kernels: the same tolerance as eager cp (1e-9 relative)."""
    run_workers(_inductor_worker, 4, name, str(tmp_path), timeout=850)


def _tp_worker(rank, world, name):
    from .test_context_tensor_parallel import make_plan as cp_tp_plan

    plan = dataclasses.replace(cp_tp_plan(name), compile=CompileSpec(mode="graphs"))
    assert_trains_like_reference(plan, name, STEPS)


@pytest.mark.heavy  # 4 processes, an exported Llama traced per rank: ~70 s each, loaded
@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", ["pp1-cp2-tp2-sp-ring", "pp1-cp2-tp2-sp", "mlp-only"])
def test_cp2_tp2_in_graphs_mode_equals_reference(run_workers, name):
    """cp inside tensor-parallel stages (tests/parallel/test_context_tensor_parallel.py's
    plans: transformers' Llama exported, heads split by tp then by cp; RopeLM with
    attention whole under tp) in graphs mode: DTensor's and cp's collectives in one graph."""
    run_workers(_tp_worker, 4, name, timeout=380)
