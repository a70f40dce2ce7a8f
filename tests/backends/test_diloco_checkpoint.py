"""DiLoCo checkpoints (backends/state/checkpoint/islands.py): resume between syncs, bitwise.

One spawned 4-rank world (pp=2 x dp=2 islands), float64, DiLoCo H=3 with a Nesterov outer
step and AdamW inside, 7 steps (syncs after steps 3 and 6). The run saves after step 4,
when the islands have diverged since the last sync, and goes on; the checkpoint is then
resumed under the same plan and under the gpipe schedule (the same sums in the same
order on 2 microbatches, another plan hash), and under pp1 x tp2 inside each island
(within the fp64 rule: another sum order). Same plan and gpipe: every loss, every island's parameters and
the DiLoCo global copies, outer momentum and sync counts bitwise equal to the
uninterrupted run. The checkpoint, read back by torch's converter, keeps the islands'
parameters apart and the shared state once (`pipeplan export` reads the global
parameters); a plan with another H or island count is
refused by the manifest check.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from pipeplan.dsl.ast import CheckpointSpec, MeshSpec, SplitSpec, SyncSpec

from .test_diloco import ADAMW, ATOL, NESTEROV, RTOL, make_plan
from .test_equivalence_parallel import TENSOR

STEPS, SAVE = 7, 4


def plans(folder: str) -> dict:
    base = make_plan(SyncSpec("diloco", inner_steps=3, outer_optimizer=NESTEROV), ADAMW)
    base = dataclasses.replace(base, train=dataclasses.replace(
        base.train, steps=STEPS, checkpoint=CheckpointSpec(every=SAVE, dir=folder)))
    gpipe = dataclasses.replace(base, pipeline=dataclasses.replace(base.pipeline,
                                                                  schedule="gpipe"))
    tp2 = dataclasses.replace(base, mesh=MeshSpec(pp=1, dp=2, tp=2), tensor=TENSOR,
                              pipeline=dataclasses.replace(base.pipeline, split=SplitSpec()))
    return {"diloco": base, "gpipe": gpipe, "tp2": tp2}


def _run(plan, tag: str, resume: bool):
    from pipeplan.backends.state.checkpoint import Checkpointer
    from pipeplan.backends.runtime.trainer import PipelineTrainer

    trainer = PipelineTrainer.for_plan(plan)
    ckpt = Checkpointer(plan, trainer, plan_hash=tag)
    first = ckpt.load(SAVE) if resume else 0
    trainer.resume(first)
    losses, syncs = [], []
    for t in range(first, STEPS):
        report = trainer.step(t)
        losses.append(report.loss)
        syncs += [e.step for e in report.sync_events]
        if not resume and t + 1 == SAVE:
            ckpt.save(SAVE)
    state = {k: v.clone() for k, v in trainer.diloco.state_dict().items()}
    return dict(dp=trainer.topo.coords.dp, losses=losses, params=trainer.named_parameters(),
                state=state, syncs=syncs)


def _worker(rank, world, folder):
    every = plans(folder)
    return {"straight": _run(every["diloco"], "diloco", resume=False),
            "resumed": _run(every["diloco"], "diloco", resume=True),
            "gpipe": _run(every["gpipe"], "gpipe", resume=True),
            "tp2": _run(every["tp2"], "tp2", resume=True)}


def _equal(a: dict, b: dict) -> list[str]:
    if sorted(a) != sorted(b):
        return [f"keys differ: {sorted(set(a) ^ set(b))}"]
    return [k for k in a if not torch.equal(a[k], b[k])]


@pytest.mark.heavy  # suite time: run with -m heavy
@pytest.mark.slow
@pytest.mark.timeout(200)
def test_diloco_resumes_between_syncs_bitwise(spawn, tmp_path):
    results = spawn(_worker, 4, str(tmp_path), timeout=180)
    for rank, r in enumerate(results):
        straight = r["straight"]
        assert straight["syncs"] == [3, 6], straight["syncs"]
        for key in ("resumed", "gpipe"):
            got = r[key]
            assert got["dp"] == straight["dp"]
            assert got["losses"] == straight["losses"][SAVE:], (rank, key)
            assert got["syncs"] == [6], (rank, key, got["syncs"])
            assert not _equal(got["params"], straight["params"]), (rank, key)
            assert not _equal(got["state"], straight["state"]), (rank, key)
        assert any(k.startswith("diloco/outer_momentum/") for k in straight["state"])
    # resharded inside the islands (pp2 -> pp1 x tp2): the same DiLoCo math, other sums
    for d in (0, 1):
        island = [r for r in results if r["straight"]["dp"] == d]
        want = {n: v for r in island for n, v in r["straight"]["params"].items()}
        losses = island[0]["straight"]["losses"][SAVE:]
        for r in (r for r in results if r["tp2"]["dp"] == d):
            assert r["tp2"]["syncs"] == [6]
            assert r["tp2"]["losses"] == pytest.approx(losses, rel=RTOL, abs=ATOL)
            got = r["tp2"]["params"]
            assert set(got) == set(want)
            bad = [n for n in got if not torch.allclose(got[n], want[n], rtol=RTOL, atol=ATOL)]
            assert not bad, (d, bad)
    # the islands differ at the save (step 4 is between syncs): resuming one island's
    # parameters into both would not have passed the checks above
    assert results[0]["straight"]["losses"][SAVE - 1] != results[1]["straight"]["losses"][SAVE - 1]

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(tmp_path / f"step_{SAVE:06d}"), str(tmp_path / "saved.pt"))
    stored = torch.load(tmp_path / "saved.pt", weights_only=False)
    names = {k.split("/", 2)[2] for k in stored if k.startswith("island0/params/")}
    assert names == {k.split("/", 2)[2] for k in stored if k.startswith("island1/params/")}
    assert names == {k.split("/", 2)[2] for k in stored if k.startswith("diloco/global/")}
    assert not any(k.startswith(("params/", "optim/")) for k in stored)
    assert all(f"island{d}/optim/{n}/exp_avg" in stored for d in (0, 1) for n in names)
    assert any(not torch.equal(stored[f"island0/params/{n}"], stored[f"island1/params/{n}"])
               for n in names)
    assert int(stored["diloco/rounds/0"]) == 1
    # `pipeplan export` reads the global parameters of the last sync
    from pipeplan.backends.state.export import read_checkpoint_params

    exported = read_checkpoint_params(str(tmp_path))
    assert sorted(exported) == sorted(names)
    assert all(torch.equal(exported[n], stored[f"diloco/global/{n}"]) for n in names)

    # another H or island count: refused before launch, naming both
    from pipeplan.backends.state.checkpoint.manifest import incompatibilities, read_manifest
    from pipeplan.backends.state.checkpoint.state import parameter_shapes
    from pipeplan.compiler.driver import compile_plan

    plan = plans(str(tmp_path))["diloco"]
    manifest = read_manifest(str(tmp_path / f"step_{SAVE:06d}"))
    shapes = parameter_shapes(compile_plan(plan))[0]
    assert incompatibilities(manifest, plan, shapes) == []
    h4 = dataclasses.replace(plan, sync=dataclasses.replace(plan.sync, inner_steps=4))
    [problem] = incompatibilities(manifest, h4, shapes)
    assert "inner_steps = 3" in problem and "inner_steps = 4" in problem, problem
    every_step = dataclasses.replace(plan, sync=SyncSpec())
    [problem] = incompatibilities(manifest, every_step, shapes)
    assert "every-step data parallel" in problem, problem
