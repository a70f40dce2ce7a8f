"""Compiled stages under tp and ep: the activation estimate equals what the runtime keeps.

In `compile.mode = graphs` a rank's runtime rewrites each stage (TP's DTensor nodes, EP's
static dispatch) and traces the rewritten stage jointly; per microbatch it keeps what F
hands to B and W. `pipeplan check` compiles with the same rewrite made before launch in a
world of fake process groups (backends/parallel/pretrace.py). Here gloo ranks rewrite the
stages with their real groups, run each stage's F through the runtime's GraphStageRunner
and measure the distinct storages it keeps (`measure_saved`, the real tensors); the
compiler's number, from its own trace of its own rewrite, must equal it per stage on
every rank (under cp the most any rank keeps: ring attention's causal blocks differ by
cp rank). Without the rewrite the compiler falls back to the eager estimate, which here
differs (the test would fail on it).
"""
from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import torch

from pipeplan.backends.parallel import rewrite_stages
from pipeplan.backends.runtime import data
from pipeplan.backends.runtime.graph_stage import GraphStageRunner
from pipeplan.backends.runtime.source import compile_checked
from pipeplan.compiler.capture.loading import load_model
from pipeplan.compiler.compiled import BATCH
from pipeplan.compiler.driver import compile_plan
from pipeplan.dsl.load import load_plan

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
GPT = ["model.args.seq_len=8", "data.seq_len=8", "model.args.vocab=32", "data.vocab=32",
       "train.global_batch=4", "pipeline.microbatches=2", "model.args.heads=2",
       "model.args.dim=16", "model.args.layers=2", "mesh.dp=1", "zero=0",
       "pipeline.schedule=1f1b", "pipeline.virtual=1", "tensor.vocab=[tok_emb, lm_head]",
       "compile.mode=graphs", "train.precision=fp64"]
MOE = ["model.args.seq_len=8", "data.seq_len=8", "model.args.vocab=32", "data.vocab=32",
       "model.args.dim=16", "train.global_batch=8", "compile.mode=graphs",
       "train.precision=fp64"]


CP = ["mesh.pp=2", "mesh.cp=2", "pipeline.split=[layers[0:4], layers[4:8]]",
      "compile.mode=graphs", "train.precision=fp64", "model.args.dim=16",
      "model.args.seq_len=16", "data.seq_len=16", "model.args.vocab=32", "data.vocab=32"]


def _measure(plan, compiled, topo) -> list[int]:
    """Per stage, the bytes the graphs runner keeps from F for one microbatch here, each
    stage rewritten by the runtime's own rewrite (cp, ep, tp) with this rank's groups."""
    batch = data.dp_microbatches(plan, 0, topo.coords.dp, topo.coords.cp)[0]
    values, got = {}, []
    for spec in compiled.stages:
        module = copy.deepcopy(spec.module)
        rewrite_stages(plan, topo, {spec.index: module}, compiled.experts, compiled.tp_rewrites)
        runner = GraphStageRunner(spec, module, spec.index == len(compiled.stages) - 1, 1.0,
                                  recompute=plan.recompute)  # as the trainer makes it
        runner.measure_saved()
        inputs = [batch.field(r.name).clone() if r.source == BATCH else values[r.name]
                  for r in spec.inputs]
        out = runner.forward(0, inputs)
        got.append(runner.saved_bytes[0])
        values.update({o.name: v.detach() for o, v in zip(spec.outputs, out)})
    return got


def _worker(rank, world, cases):
    import torch.distributed as dist

    from pipeplan.backends.runtime.topology import build_topology
    for name, plan, compiled, want in cases:
        one = dataclasses.replace(plan, mesh=dataclasses.replace(plan.mesh, pp=1))
        got = _measure(one, compiled, build_topology(one.mesh))
        every = [None] * world
        dist.all_gather_object(every, got)
        most = [max(per) for per in zip(*every)]  # ring: cp ranks compute different blocks
        assert most == want, f"{name}: measured {every} (rank by rank), estimated {want}"
        if "cp" not in name:  # tp and ep ranks hold the same shapes
            assert got == want, f"{name} rank {rank}: measured {got}, estimated {want}"


def _case(name: str, example: str, overrides: list[str]):
    plan = load_plan(str(EXAMPLES / example), overrides=overrides)
    torch.manual_seed(0)
    compiled = compile_plan(plan, load_model(plan, "cpu"))  # the stages the workers run
    checked = compile_checked(plan)  # what `pipeplan check` prints: on meta, rewritten
    eager = compile_plan(plan)  # the fallback without the rewrite
    want = [s.activation_bytes for s in checked.stages]
    assert want != [s.activation_bytes for s in eager.stages], name
    return name, plan, compiled, want


CASES = {"gpt tp2": ("hybrid_pp2_dp2_tp2.plan", GPT),
         "gpt tp2 sp": ("hybrid_pp2_dp2_tp2.plan", GPT + ["tensor.sequence_parallel=true"]),
         # full recompute reruns the collectives: B all-gathers the shards again
         "gpt tp2 sp full": ("hybrid_pp2_dp2_tp2.plan",
                             GPT + ["tensor.sequence_parallel=true", "recompute.layers.*=full"]),
         "moe dp2 ep2": ("moe_pp2_ep2_zbv.plan", MOE),
         "gpt cp2 ring": ("gpt_pp4_1f1b.plan", CP + ["context.method=ring"]),
         "gpt cp2 ulysses": ("gpt_pp4_1f1b.plan", CP + ["context.method=ulysses"])}


@pytest.mark.parametrize("names", [
    ("gpt tp2 sp full", "moe dp2 ep2", "gpt cp2 ring"),
    pytest.param(("gpt tp2", "gpt tp2 sp", "gpt cp2 ulysses"), marks=pytest.mark.heavy)],
    ids=["sp-full-ep-ring", "tp-sp-ulysses"])
def test_cp_tp_and_ep_compiled_stages_keep_what_check_estimates(run_workers, names):
    """(Three layouts in the default suite, one of each axis; the other three heavy.)"""
    run_workers(_worker, 2, [_case(n, *CASES[n]) for n in names], timeout=300)


def test_check_prints_the_rewritten_stages_estimate(capsys):
    """`pipeplan check` compiles as a launch does: its per-rank activation column is the
    rewritten stages' (here about twice the eager estimate's: the static dispatch)."""
    from pipeplan.cli import main
    from pipeplan.dsl.layout import mesh_layout

    path = str(EXAMPLES / "moe_pp2_ep2_zbv.plan")
    plan = load_plan(path, overrides=["compile.mode=graphs"])
    assert main(["check", path, "--set", "compile.mode=graphs"]) == 0
    out = capsys.readouterr().out
    rows = out[out.index("pp rank   params"):].splitlines()[1:3]
    printed = [float(r.split()[4]) for r in rows]
    checked, eager = compile_checked(plan).estimates, compile_plan(plan).estimates
    pp_of = [c.pp for c in mesh_layout(plan.mesh)]
    by_pp = [max(r.activation_bytes for r in e.ranks if pp_of[r.rank] == k) / 2**20
             for e in (checked, eager) for k in (0, 1)]
    assert printed == [round(x, 2) for x in by_pp[:2]] != [round(x, 2) for x in by_pp[2:]]
