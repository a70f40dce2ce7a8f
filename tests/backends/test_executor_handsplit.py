"""The executor on stages split by hand (no compiler): split and full backward,
same-rank hand-offs (V placement), tied weights across ranks, DP, clipping."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pipeplan.backends.verify.reference import train_reference
from pipeplan.backends.runtime.topology import build_topology
from pipeplan.backends.runtime.trainer import PipelineTrainer
from pipeplan.compiler.compiled import (BATCH, CompiledPlan, StageSpec, TiedParam, ValueRef, ValueSpec)
from pipeplan.dsl.ast import (DataSpec, MeshSpec, ModelSpec, OptimizerSpec, PipelineSpec, Plan, TrainSpec)
from pipeplan.schedules.ir import Action, Schedule

V, D, SEQ = 16, 8, 4


class Tiny(nn.Module):
    """emb -> l0 -> l1 -> l2 -> head (tied to emb)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.l0, self.l1, self.l2 = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, input_ids):
        h = self.emb(input_ids)
        for l in (self.l0, self.l1, self.l2):
            h = torch.tanh(l(h))
        return self.head(h)


class Part(nn.Module):
    """A hand-made stage: the named blocks of the model, the loss on the last one."""

    def __init__(self, model, names, first, last):
        super().__init__()
        for n in names:
            setattr(self, n, getattr(model, n))
        self.names, self.first, self.last = names, first, last

    def forward(self, x, targets=None):
        for n in self.names:
            x = getattr(self, n)(x) if n in ("emb", "head") else torch.tanh(getattr(self, n)(x))
        if self.last:
            return (F.cross_entropy(x.reshape(-1, V), targets.reshape(-1)),)
        return (x,)


def tiny_plan(pp, dp, m, clip=0.5):
    return Plan(model=ModelSpec("tiny:Tiny"), data=DataSpec(seq_len=SEQ, seed=3, vocab=V),
                mesh=MeshSpec(pp=pp, dp=dp), pipeline=PipelineSpec(microbatches=m),
                train=TrainSpec(steps=3, global_batch=4 * dp * m, grad_clip=clip, seed=0,
                                optimizer=OptimizerSpec(lr=0.05)))


def compiled_by_hand(plan, model, groups, stage_to_rank, order):
    mb_rows = plan.microbatch_size
    act = (ValueSpec("h", (mb_rows, SEQ, D), "float32"),)
    stages = []
    for k, names in enumerate(groups):
        first, last = k == 0, k == len(groups) - 1
        inputs = (ValueRef("input_ids", BATCH),) if first else (ValueRef("h", k - 1),)
        if last:
            inputs += (ValueRef("targets", BATCH),)
        part = Part(model, names, first, last)
        stages.append(StageSpec(k, stage_to_rank[k], inputs,
                                (ValueSpec("loss", (), "float32"),) if last else act,
                                tuple(n for n, _ in part.named_parameters()), module=part))
    schedule = Schedule("hand", max(stage_to_rank) + 1, len(groups), plan.microbatches,
                        tuple(stage_to_rank), tuple(tuple(o) for o in order))
    tied = TiedParam(("emb.weight", "head.weight"), (0, len(groups) - 1))
    return CompiledPlan(plan, stages, schedule, tied=(tied,))


def fill_drain(stage_to_rank, m, split):
    """Per rank: all forwards (stage order), then backwards in reverse stage order."""
    ranks = max(stage_to_rank) + 1
    order = [[] for _ in range(ranks)]
    for s, r in enumerate(stage_to_rank):
        order[r] += [Action("F", s, i) for i in range(m)]
    for s in reversed(range(len(stage_to_rank))):
        r = stage_to_rank[s]
        for i in range(m):
            order[r] += [Action("B", s, i), Action("W", s, i)] if split else [Action("BW", s, i)]
    return order


CASES = [  # (groups, stage_to_rank, split, dp)
    ((["emb", "l0"], ["l1", "l2", "head"]), (0, 1), False, 1),
    ((["emb", "l0"], ["l1", "l2", "head"]), (0, 1), True, 1),
    ((["emb"], ["l0"], ["l1"], ["l2", "head"]), (0, 1, 1, 0), True, 1),  # V: same-rank hand-offs
    ((["emb", "l0"], ["l1", "l2", "head"]), (0, 1), True, 2),
]


def _worker(rank, world):
    out = []
    for groups, placement, split, dp in CASES:
        pp = max(placement) + 1
        if world != pp * dp:
            continue
        plan = tiny_plan(pp, dp, m=2)
        torch.manual_seed(0)
        model = Tiny()
        compiled = compiled_by_hand(plan, model, groups, placement,
                                    fill_drain(placement, plan.microbatches, split))
        trainer = PipelineTrainer(plan, compiled, build_topology(plan.mesh))
        losses = [trainer.step(t).loss for t in range(plan.train.steps)]
        out.append((losses, trainer.named_parameters()))
    return out


def _check(results, world):
    cases = [c for c in CASES if (max(c[1]) + 1) * c[3] == world]
    for k, (groups, placement, split, dp) in enumerate(cases):
        plan = tiny_plan(max(placement) + 1, dp, m=2)
        torch.manual_seed(0)
        ref = train_reference(plan, plan.train.steps, model=Tiny())
        for rank_results in results:
            losses, params = rank_results[k]
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref.losses),
                                       rtol=1e-5, atol=1e-6)
            for name, p in params.items():
                torch.testing.assert_close(p, ref.params[name], rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"{groups} {placement} {name}: {m}")
    assert cases


def test_hand_split_pp2(spawn):
    _check(spawn(_worker, 2, timeout=120), 2)


def test_hand_split_pp2_dp2(spawn):
    _check(spawn(_worker, 4, timeout=120), 4)


def _nan_worker(rank, world):
    from pipeplan.backends.runtime.nonfinite import NonFiniteError

    plan = tiny_plan(1, 1, m=2)
    torch.manual_seed(0)
    model = Tiny()
    with torch.no_grad():
        model.l2.weight.fill_(float("nan"))
    placement = (0, 0)  # two stages on one rank: hand-offs in memory only
    compiled = compiled_by_hand(plan, model, (["emb", "l0"], ["l1", "l2", "head"]), placement,
                                fill_drain(placement, 2, split=True))
    trainer = PipelineTrainer(plan, compiled, build_topology(plan.mesh))
    try:
        trainer.step(0)
    except NonFiniteError as e:
        return str(e)
    return "no error"


def test_non_finite_loss_names_the_action(spawn):
    """Checked once per step, before the optimizer; the first non-finite value is named."""
    (message,) = spawn(_nan_worker, 1, timeout=60)
    assert message.startswith("step 1: non-finite values (loss nan")
    assert "the first: the loss of stage 1 microbatch 0 (F s1 mb0)" in message
