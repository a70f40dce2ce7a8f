"""DiLoCo with tensor and expert parallelism inside the islands, against the island-by-island
reference of test_diloco.py (each island one process holding the whole model, every expert),
in float64 (rtol 1e-9, atol 1e-12).

One spawned 4-rank world (pp1 x dp2 islands x tp2), DiLoCo H=3 with a Nesterov outer step,
AdamW inside, clipping on, 6 steps (syncs after steps 3 and 6):

* "tp2": the example GPT with attention, MLP and vocabulary tensor-parallel in each island;
* "moe_ep2": the example MoE GPT with ep2 (= tp2) and attention tensor-parallel: each
  island's two tp ranks hold two experts each and exchange tokens between themselves only
  (dsl/layout.py: under diloco EP re-divides an island's tp ranks); an expert shard's
  pseudo-gradient is averaged with the same shard of the other island.

Compared with the reference: every island's losses, its full parameters (gathered over tp
and ep), the global copies and outer momentum. The MoE run also saves a checkpoint after
step 4 (between syncs: the islands apart) and a fresh trainer resumes it to step 6:
losses, parameters and DiLoCo state bitwise equal to the uninterrupted run. The heavy tier runs the MoE at
pp2 x dp2 x tp2 x ep2 and at dp2 x tp4 x ep2 (8 ranks each; ep below tp: each island
holds every expert twice and sums their gradients inside the island every step).
"""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.distributed as dist

from pipeplan.dsl.ast import CheckpointSpec, MeshSpec, PipelineSpec, SplitSpec, SyncSpec, TensorSpec

from .test_diloco import ADAMW, NESTEROV, make_plan, reference_mismatches
from .test_equivalence_moe import moe_plan
from .test_equivalence_parallel import TENSOR

STEPS, SAVE = 6, 4
SYNC = SyncSpec("diloco", inner_steps=3, outer_optimizer=NESTEROV)
ATTENTION = TensorSpec(column=("layers.*.attn.q", "layers.*.attn.k", "layers.*.attn.v"),
                       row=("layers.*.attn.proj",))


def _with(plan, mesh: MeshSpec, tensor: TensorSpec, pipeline: PipelineSpec):
    return dataclasses.replace(plan, mesh=mesh, tensor=tensor, pipeline=pipeline, sync=SYNC,
                               train=dataclasses.replace(plan.train, steps=STEPS,
                                                         optimizer=ADAMW, grad_clip=0.5))


def tp_plan():
    base = make_plan(SYNC, ADAMW)
    return _with(base, MeshSpec(pp=1, dp=2, tp=2), TENSOR,
                 dataclasses.replace(base.pipeline, split=SplitSpec()))


def moe_ep_plan(pp: int = 1, tp: int = 2):
    base = moe_plan("moe_gpt", "1f1b")
    return _with(base, MeshSpec(pp=pp, dp=2, tp=tp, ep=2), ATTENTION,
                 dataclasses.replace(base.pipeline, microbatches=2))


def _run(plan, folder: str):
    """Train STEPS steps; with EP, also save after step SAVE (between syncs) and resume that
    checkpoint in a fresh trainer to the end."""
    from pipeplan.backends.state.checkpoint import Checkpointer
    from pipeplan.backends.state.checkpoint.state import placed_parameters
    from pipeplan.backends.runtime.trainer import PipelineTrainer

    ckpt = None
    if plan.mesh.ep > 1:
        plan = dataclasses.replace(plan, train=dataclasses.replace(
            plan.train, checkpoint=CheckpointSpec(every=SAVE, dir=folder)))
    trainer = PipelineTrainer.for_plan(plan)
    rank, groups = dist.get_rank(), trainer.layout.groups
    shards = {}
    if plan.mesh.ep > 1:  # EP inside the island: among its tp ranks, never the other island's
        tp_ranks = dist.get_process_group_ranks(groups.tp)
        assert set(dist.get_process_group_ranks(groups.ep)) <= set(tp_ranks)
        if plan.mesh.tp > plan.mesh.ep:  # the island's replicas of the same experts
            replicas = dist.get_process_group_ranks(groups.expert_dp)
            assert set(replicas) <= set(tp_ranks) and len(replicas) == plan.mesh.tp // 2
        shards = {n: layer.shard.first for st in trainer.layout.parallel.values()
                  for n, layer in st.experts.items()}
        ckpt = Checkpointer(plan, trainer, plan_hash="ep")
    reports = []
    for t in range(STEPS):
        reports.append(trainer.step(t))
        if ckpt is not None and t + 1 == SAVE:
            ckpt.save(SAVE)
    offset = {n: pl.offset for pl in placed_parameters(trainer) for n in pl.names}
    out = dict(rank=rank, dp=trainer.topo.coords.dp, tp=trainer.topo.coords.tp,
               pp=trainer.topo.coords.pp, shards=shards, losses=[r.loss for r in reports],
               params=trainer.named_parameters(),
               syncs=[e.step for r in reports for e in r.sync_events],
               state={k: (offset.get(k.split("/", 2)[2], ()), v.clone())
                      for k, v in trainer.diloco.state_dict().items()})
    if ckpt is not None:
        again = PipelineTrainer.for_plan(plan)
        first = Checkpointer(plan, again, plan_hash="ep").load(SAVE)
        again.resume(first)
        losses = [again.step(t).loss for t in range(first, STEPS)]
        out["resumed"] = dict(losses=losses, params=again.named_parameters(),
                              state={k: v.clone() for k, v in again.diloco.state_dict().items()})
    return out


def _worker(rank, world, which, folder):
    return {key: _run(plan(), os.path.join(folder, key)) for key, plan in which}


def _check(results, configs):
    bad = []
    for key, plan in configs:
        runs = [r[key] for r in results]
        bad += reference_mismatches(key, plan(), runs, STEPS)
        assert all(r["syncs"] == [3, 6] for r in runs), [r["syncs"] for r in runs]
        # the islands diverge between syncs (so the test tells DiLoCo from data parallel)
        assert runs[0]["losses"] != next(r for r in runs if r["dp"] == 1)["losses"]
        if plan().mesh.ep > 1:  # tp rank t holds experts [2(t%2), 2(t%2)+2) in both islands
            for r in runs:
                assert r["shards"] and set(r["shards"].values()) == {2 * (r["tp"] % 2)}, \
                    r["shards"]
                # resumed from step SAVE (islands apart, expert shards per island): bitwise
                again = r["resumed"]
                if not (again["losses"] == r["losses"][SAVE:]
                        and all(torch.equal(again["params"][n], v) for n, v in r["params"].items())
                        and again["state"].keys() == r["state"].keys()
                        and all(torch.equal(again["state"][k], v)
                                for k, (_, v) in r["state"].items())):
                    bad.append(f"{key} rank {r['rank']}: resumed after step {SAVE} differs")
    assert not bad, "\n".join(bad[:20])


CONFIGS = (("tp2", tp_plan), ("moe_ep2", moe_ep_plan))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_diloco_with_tp_and_ep_inside_islands_equals_reference(spawn, tmp_path):
    _check(spawn(_worker, 4, CONFIGS, str(tmp_path), timeout=280), CONFIGS)


HEAVY = (("moe_pp2_ep2", lambda: moe_ep_plan(pp=2)), ("moe_tp4_ep2", lambda: moe_ep_plan(tp=4)))


@pytest.mark.heavy
@pytest.mark.timeout(600)
def test_diloco_moe_pp2_and_ep_below_tp_equal_reference(spawn, tmp_path):
    _check(spawn(_worker, 8, HEAVY, str(tmp_path), timeout=580), HEAVY)
