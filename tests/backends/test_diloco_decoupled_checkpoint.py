"""Decoupled DiLoCo checkpoints (backends/state/checkpoint/store.py): one series per island.

Two spawned 2-rank worlds (pp1 x dp2 islands, the example GPT in float64, H=2, AdamW
inside, decoupled with a 30 s timeout, so every island is present at every sync), each
running the runtime's own step loop (worker._train: resume, steps, a checkpoint every
2 steps):

1. straight, 6 steps: each island writes its own series `dir/island<d>/step_N`, through
   its own process group; the run equals the island-by-island reference of test_diloco.py
   (every island present: the decoupled mean is DiLoCo's);
2. after the step-6 checkpoints are removed, the same plan resumes each island from its
   own newest step (4) and runs steps 5 and 6: losses, parameters and DiLoCo state
   bitwise equal to the straight run;
3. islands resumed at different steps (island 0 at 4, island 1 at 2; timeout 1 s): island
   0 syncs without the late island, which adopts the newest round when it gets there, and
   after island 0 has finished, its last round at its remaining sync.

Before launch (`cli.check_resume`): the island series load under the plan; a synchronous
plan pointed at them, or a decoupled plan at a synchronous run's folder, is refused
naming the folder.
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import re
import shutil

import pytest
import torch

from pipeplan.dsl.ast import CheckpointSpec, SyncSpec

from .test_diloco import ADAMW, NESTEROV, make_plan, reference_mismatches

STEPS = 6


def plan_of(folder: str, timeout: float = 30.0):
    plan = make_plan(SyncSpec("diloco", inner_steps=2, outer_optimizer=NESTEROV,
                              decoupled=True, timeout=timeout), ADAMW)
    from pipeplan.dsl.ast import MeshSpec, SplitSpec
    return dataclasses.replace(
        plan, mesh=MeshSpec(pp=1, dp=2),
        pipeline=dataclasses.replace(plan.pipeline, split=SplitSpec()),
        train=dataclasses.replace(plan.train, steps=STEPS,
                                  checkpoint=CheckpointSpec(every=2, dir=folder, keep=3)))


def _worker(rank, world, folder, timeout=30.0):
    from pipeplan.backends.parallel.diloco.decoupled import finish
    from pipeplan.backends.runtime.trainer import PipelineTrainer
    from pipeplan.backends.runtime.worker import RankEnv, RunOptions, _train

    plan = plan_of(folder, timeout)
    trainer = PipelineTrainer.for_plan(plan)
    log = io.StringIO()  # island 1's first rank prints its syncs; rank 0 writes metrics
    metrics = os.path.join(os.path.dirname(folder), f"metrics{rank}.jsonl")
    with contextlib.redirect_stdout(log):
        losses, _, first = _train(plan, trainer, RankEnv(rank, world, rank),
                                  RunOptions(STEPS, metrics=metrics), [""], run_hash="decoupled")
    if rank == 0:
        rows = [json.loads(line) for line in open(metrics)]
        log.write("".join(f"sync {e}\n" for row in rows[-(STEPS - first):]
                          for e in row.get("sync", [])))
    finish(rank, world, {0: 0, 1: 1}, 60.0)  # as a decoupled run ends: no collective
    return dict(dp=trainer.topo.coords.dp, first=first, losses=losses, log=log.getvalue(),
                params=trainer.named_parameters(),
                state={k: v.clone() for k, v in trainer.diloco.state_dict().items()})


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_decoupled_islands_checkpoint_alone_and_resume_their_own_step(spawn, tmp_path):
    from pipeplan.cli.run import check_resume
    from pipeplan.compiler.driver import compile_plan
    from pipeplan.errors import PipeplanError

    folder = str(tmp_path / "ckpt")
    straight = spawn(_worker, 2, folder, timeout=140)
    plan = plan_of(folder)
    assert [r["first"] for r in straight] == [0, 0]
    # only island 0 (the coordinators) applies the outer step and holds its momentum
    bad = reference_mismatches("decoupled", plan, [
        {**r, "state": {k: v for k, v in r["state"].items()
                        if r["dp"] == 0 or "outer_momentum" not in k}} for r in straight], STEPS)
    assert not bad, "\n".join(bad[:20])
    assert straight[0]["losses"] != straight[1]["losses"]  # the islands differ between syncs
    assert sorted(os.listdir(folder)) == ["island0", "island1"]
    for d in (0, 1):
        island = os.path.join(folder, f"island{d}")
        assert sorted(os.listdir(island)) == [f"step_{s:06d}" for s in (2, 4, 6)]
        manifest = json.load(open(os.path.join(island, "step_000004", "manifest.json")))
        assert manifest["step"] == 4 and manifest["sync"]["decoupled"] is True
        shutil.rmtree(os.path.join(island, "step_000006"))

    compiled = compile_plan(plan)
    check_resume(plan, compiled)  # the islands' series load under the plan
    synchronous = dataclasses.replace(plan, sync=dataclasses.replace(plan.sync, decoupled=False,
                                                                     timeout=30.0))
    with pytest.raises(PipeplanError, match="one series per island"):
        check_resume(synchronous, compiled)
    os.makedirs(tmp_path / "sync" / "step_000002")
    with pytest.raises(PipeplanError, match="one series for the whole run"):
        check_resume(dataclasses.replace(plan, train=dataclasses.replace(
            plan.train, checkpoint=CheckpointSpec(every=2, dir=str(tmp_path / "sync")))),
            compiled)

    resumed = spawn(_worker, 2, folder, timeout=140)
    for r, s in zip(resumed, straight):
        assert r["first"] == 4 and r["dp"] == s["dp"]
        assert r["losses"] == s["losses"][4:]
        assert r["params"].keys() == s["params"].keys()
        assert all(torch.equal(r["params"][n], v) for n, v in s["params"].items())
        assert r["state"].keys() == s["state"].keys()
        assert all(torch.equal(r["state"][k], v) for k, v in s["state"].items())
    # `pipeplan export dir` reads island 0's newest: the coordinators' global parameters
    from pipeplan.backends.state.export import read_checkpoint_params

    exported = read_checkpoint_params(folder)
    glob = {k.split("/", 2)[2]: v for k, v in resumed[0]["state"].items()
            if k.startswith("diloco/global/")}
    assert glob and set(glob) <= set(exported)
    assert all(torch.equal(exported[n], v) for n, v in glob.items())

    # islands at different steps: island 0 resumes its step 4, island 1 its step 2 (its
    # newer ones removed), with a 1 s timeout. Island 0's round-2 sync (after its step 6)
    # goes on without island 1, which is still in round 1; island 1 then adopts round 2
    # (late, after its step 4), and at its last sync, island 0 having finished, round 2
    # again: it ends on island 0's final global parameters.
    shutil.rmtree(os.path.join(folder, "island0", "step_000006"))
    for step in (4, 6):
        shutil.rmtree(os.path.join(folder, "island1", f"step_{step:06d}"))
    late = spawn(_worker, 2, folder, 1.0, timeout=140)
    assert [r["first"] for r in late] == [4, 2]
    assert "'step': 6, 'fragment': 0, 'round': 2, 'islands': [0], 'absent': [1]" \
        in late[0]["log"], late[0]["log"]
    assert re.search(r"island 1: sync after step 4, fragment 0 round 1: .*this island was late "
                     r"and adopted round 2's parameters", late[1]["log"]), late[1]["log"]
    assert re.search(r"island 1: sync after step 6, .* adopted round 2's parameters",
                     late[1]["log"]), late[1]["log"]
    assert all(torch.equal(late[1]["params"][n], v) for n, v in late[0]["params"].items())
