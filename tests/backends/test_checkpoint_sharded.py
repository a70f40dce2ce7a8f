"""Sharded checkpoints (backends/state/checkpoint/): resume bitwise, and resume under another plan.

One spawned world of 4 ranks, float64, AdamW (a cosine schedule), 4 steps:

* each source plan trains 4 steps straight, saving after step 2 (saving changes
  nothing), then resumes from that checkpoint under the same plan: every loss
  and every parameter bitwise equal (ZeRO-3 with TP shards; EP shards with
  ZeRO-1);
* the same checkpoint resumed under other plans (pp1->pp4 with 1f1b->zbv and
  virtual stages, tp2->tp1, dp2->dp1, zero3->0; ep2->ep1, zbv->1f1b, zero1->zero3):
  losses within 1e-6 of the uninterrupted run and parameters within the fp64 rule;
  where the change keeps the math (zero3->zero1 and 1f1b->gpipe on one rank of
  pipeline) bitwise;
* the checkpoint read back by torch's own converter (DCP -> torch.save, no
  pipeplan code): each key a parameter's name at its global shape, experts
  stacked by global index, equal to the full parameters gathered at step 2.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from pipeplan.dsl.ast import CheckpointSpec, ExpertsSpec, MeshSpec, OptimizerSpec, LRScheduleSpec

from .test_equivalence import make_plan
from .test_equivalence_parallel import TENSOR

STEPS, SAVE = 4, 2
ADAMW = OptimizerSpec(name="adamw", lr=3e-3, weight_decay=0.1)
EXPERTS = ExpertsSpec(modules=("layers.*.moe",), num_experts=4, top_k=2)


def plans(folder: str) -> dict:
    def p(model, kind, pp, dp, **changes):
        plan = make_plan(model, kind, pp, dp, ADAMW)
        train = dataclasses.replace(plan.train, steps=STEPS, lr_schedule=LRScheduleSpec(
            "cosine", warmup=1), checkpoint=CheckpointSpec(every=SAVE, dir=f"{folder}/{model}"))
        return dataclasses.replace(plan, train=train, **changes)

    return {
        # sources: resumed under themselves (bitwise) and under the plans below
        "zero3-tp2": p("gpt", "1f1b", 1, 2, mesh=MeshSpec(dp=2, tp=2), tensor=TENSOR, zero=3),
        "ep2-zbv-zero1": p("moe", "zbv", 2, 2, mesh=MeshSpec(pp=2, dp=2, ep=2),
                           experts=EXPERTS, zero=1),
        # other plans, same checkpoints
        "pp4-zbv": p("gpt", "zbv", 4, 1),
        "zero1-tp2-gpipe": p("gpt", "gpipe", 1, 2, mesh=MeshSpec(dp=2, tp=2), tensor=TENSOR,
                             zero=1),
        "ep1-1f1b-zero3": p("moe", "1f1b", 2, 2, experts=EXPERTS, zero=3),
    }


SOURCES = {"zero3-tp2": ["pp4-zbv", "zero1-tp2-gpipe"], "ep2-zbv-zero1": ["ep1-1f1b-zero3"]}
# changes that keep the math (the same sums in the same order): resumed bitwise
BITWISE = {"zero1-tp2-gpipe"}


def _run(plan, tag: str, resume: bool):
    from pipeplan.backends.state.checkpoint import Checkpointer
    from pipeplan.backends.runtime.trainer import PipelineTrainer

    trainer = PipelineTrainer.for_plan(plan)
    ckpt = Checkpointer(plan, trainer, plan_hash=tag)
    first = ckpt.load(SAVE) if resume else 0
    trainer.resume(first)
    losses, saved = [], None
    for t in range(first, STEPS):
        losses.append(trainer.step(t).loss)
        if not resume and t + 1 == SAVE:
            ckpt.save(SAVE)
            saved = trainer.named_parameters()
    return losses, trainer.named_parameters(), saved


def _worker(rank, world, folder):
    every = plans(folder)
    out = {}
    for source, others in SOURCES.items():
        out[source] = _run(every[source], source, resume=False)
        out[source + "/resumed"] = _run(every[source], source, resume=True)
        for other in others:
            out[other] = _run(every[other], other, resume=True)
    return out


def _merged(results, key: str, part: int) -> dict[str, torch.Tensor]:
    merged: dict[str, torch.Tensor] = {}
    for r in results:
        merged.update(r[key][part] or {})
    return merged


def _saved_keys(folder) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = folder.parent / (folder.name + ".pt")
    dcp_to_torch_save(str(folder), str(out))
    return torch.load(out, weights_only=False)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_sharded_checkpoints_resume_bitwise_and_reshard(spawn, tmp_path):
    results = spawn(_worker, 4, str(tmp_path), timeout=380)
    failures = []
    for source, others in SOURCES.items():
        losses, params, saved_params = results[0][source][0], \
            _merged(results, source, 1), _merged(results, source, 2)
        # the same plan resumed: bitwise
        again = _merged(results, source + "/resumed", 1)
        assert results[0][source + "/resumed"][0] == losses[SAVE:], source
        assert sorted(again) == sorted(params)
        assert all(torch.equal(again[n], params[n]) for n in params), source
        # other plans: the math of another split and sharding
        for other in others:
            got = results[0][other][0]
            assert got == pytest.approx(losses[SAVE:], abs=1e-6, rel=0), (other, got, losses)
            moved = _merged(results, other, 1)
            assert set(moved) <= set(params) and len(moved) >= len(params) - 1, other
            if other in BITWISE:
                assert got == losses[SAVE:], (other, got, losses)
                assert all(torch.equal(moved[n], params[n]) for n in params), other
            bad = [n for n in moved
                   if not torch.allclose(moved[n], params[n], rtol=1e-9, atol=1e-12)]
            if bad:
                failures.append(f"{source} -> {other}: {bad[:5]}")
        # what DCP holds, read by torch's converter: names, global shapes, the values at step 2
        model = "moe" if "ep" in source else "gpt"
        stored = _saved_keys(tmp_path / model / f"step_{SAVE:06d}")
        names = {k.split("/", 1)[1] for k in stored if k.startswith("params/")}
        assert names == set(saved_params), sorted(names ^ set(saved_params))
        for n, value in saved_params.items():
            assert torch.equal(stored[f"params/{n}"], value), n
            assert stored[f"optim/{n}/exp_avg"].shape == value.shape, n
        assert int(stored["step"]) == SAVE
        if model == "moe":  # experts by global index: one stacked tensor per expert weight
            stacked = [n for n in names if stored[f"params/{n}"].shape[:1] == (4,)
                       and ".moe." in n]
            assert stacked, sorted(names)
    assert not failures, "\n".join(failures)
