"""Checkpoints of a context-parallel run (backends/state/checkpoint/): resumed bitwise under the same
plan, and resumed under another cp.

Context parallel leaves every parameter whole on each cp rank (like a dp replica) and the
data position is the step, so a checkpoint's keys do not depend on cp: a run saved under
pp2 x cp2 loads under pp2 x dp2 (cp 1: the sequences whole, the batch split instead) and
under pp1 x dp2 x cp2 with ZeRO-2 (optimizer state in flat ranges over dp x cp), and
under ring attention instead of Ulysses (another column layout per cp rank), and under
pp1 x cp2 x tp2 ring attention (attention and MLP split by tp, the ring on each tp rank's
local heads: the parameters resharded over tp on load). One world
of 4 ranks, RopeLM with 2 layers in float64, AdamW with a cosine schedule, 4 steps,
saved after step 2:

* the same plan resumed: every loss and parameter bitwise equal to the uninterrupted run;
* the other plans: the fp64 rule against the uninterrupted run (their sums run in another
  order), and the manifest records cp so plan-diff names the move.
"""
from __future__ import annotations

import dataclasses

import torch

from pipeplan.dsl.ast import CheckpointSpec, LRScheduleSpec, MeshSpec, TensorSpec
from pipeplan.tests.parallel.test_context_parallel import make_plan

STEPS, SAVE = 4, 2
MEGATRON = TensorSpec(column=("layers.*.attn.q", "layers.*.attn.k", "layers.*.attn.v",
                              "layers.*.mlp.gate", "layers.*.mlp.up"),
                      row=("layers.*.attn.o", "layers.*.mlp.down"))
TOL = dict(rtol=1e-9, atol=1e-12)


def plans(folder: str) -> dict:
    def p(name, **changes):
        plan = make_plan(name)
        train = dataclasses.replace(plan.train, steps=STEPS, global_batch=4, precision="fp64",
                                    lr_schedule=LRScheduleSpec("cosine", warmup=1),
                                    checkpoint=CheckpointSpec(every=SAVE, dir=folder))
        model = dataclasses.replace(plan.model, args={"layers": 2})
        return dataclasses.replace(plan, model=model, train=train, **changes)

    # the same 4 sequences per step under each plan
    return {"pp2-cp2": p("1f1b"),
            "pp2-dp2": p("1f1b", mesh=MeshSpec(pp=2, dp=2), context=None),
            "pp1-dp2-cp2-zero2": p("zero2"),
            "pp2-cp2-ring": p("ring-1f1b"),
            "pp1-cp2-tp2-ring": p("ring-1f1b", mesh=MeshSpec(pp=1, cp=2, tp=2), tensor=MEGATRON)}


def _run(plan, tag: str, resume: bool):
    from pipeplan.backends.state.checkpoint import Checkpointer
    from pipeplan.backends.runtime.trainer import PipelineTrainer

    trainer = PipelineTrainer.for_plan(plan)
    ckpt = Checkpointer(plan, trainer, plan_hash=tag)
    first = ckpt.load(SAVE) if resume else 0
    trainer.resume(first)
    losses = []
    for t in range(first, STEPS):
        losses.append(trainer.step(t).loss)
        if not resume and t + 1 == SAVE:
            ckpt.save(SAVE)
    return losses, trainer.named_parameters()


def _worker(rank, world, folder):
    every = plans(folder)
    return {"straight": _run(every["pp2-cp2"], "pp2-cp2", resume=False),
            "resumed": _run(every["pp2-cp2"], "pp2-cp2", resume=True),
            **{name: _run(every[name], name, resume=True) for name in every if name != "pp2-cp2"}}


def _merged(results, key: str) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for r in results:
        out.update(r[key][1])
    return out


def test_cp_checkpoint_resumes_bitwise_and_under_another_cp(spawn, tmp_path):
    results = spawn(_worker, 4, str(tmp_path), timeout=280)
    losses, params = results[0]["straight"][0], _merged(results, "straight")
    assert len(params) == 2 * 9 + 3, sorted(params)  # RopeLM, 2 layers: every parameter
    assert results[0]["resumed"][0] == losses[SAVE:]
    again = _merged(results, "resumed")
    assert sorted(again) == sorted(params)
    assert all(torch.equal(again[n], params[n]) for n in params)
    for other in ("pp2-dp2", "pp1-dp2-cp2-zero2", "pp2-cp2-ring", "pp1-cp2-tp2-ring"):
        got = results[0][other][0]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(losses[SAVE:]), **TOL)
        moved = _merged(results, other)
        assert sorted(moved) == sorted(params), other
        for n in params:
            torch.testing.assert_close(moved[n], params[n], **TOL, msg=lambda m, n=n: f"{n}: {m}")
    # the manifest names cp, so `pipeplan plan-diff` can say what moved
    from pipeplan.backends.state.checkpoint import read_manifest, step_dir

    from pipeplan.cli.plan_diff import checkpoint_lines
    from pipeplan.compiler import compile_plan

    folder = step_dir(str(tmp_path), SAVE)
    assert read_manifest(folder)["plan"]["mesh"] == {"pp": 2, "dp": 1, "cp": 2, "tp": 1, "ep": 1}
    lines = checkpoint_lines(folder, compile_plan(plans(str(tmp_path))["pp2-dp2"]))
    assert "loads under B" in lines[0] and "dp 1 -> 2; cp 2 -> 1" in lines[1], lines
