"""One compiled plan for every rank, receives posted early without changing a bit, and a
non-finite gradient stopping the step before the optimizer, named."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from pipeplan.backends.runtime.agreement import check_agreement, compile_shared
from pipeplan.backends.runtime.nonfinite import NonFiniteError
from pipeplan.backends.runtime.trainer import PipelineTrainer
from pipeplan.compiler.driver import compile_plan
from pipeplan.dsl.ast import (DataSpec, MeshSpec, ModelSpec, PipelineSpec, Plan, SplitSpec, TensorSpec, TrainSpec)

GPT = "pipeplan.examples.models.gpt:GPT"


def gpt_plan(pp=2, dp=1, kind="1f1b", virtual=1):
    return Plan(model=ModelSpec(GPT, args={"vocab": 64, "dim": 32, "layers": 4, "heads": 4,
                                           "seq_len": 16}),
                data=DataSpec(seq_len=16, vocab=64, seed=7), mesh=MeshSpec(pp=pp, dp=dp),
                pipeline=PipelineSpec(schedule=kind, microbatches=2 * pp, virtual=virtual),
                train=TrainSpec(steps=2, global_batch=4 * pp * dp, grad_clip=0.5, seed=3))


def _agree(rank, world):
    from pipeplan.compiler import driver

    searched = []
    generate = driver.make_schedule
    driver.make_schedule = lambda *a, **k: searched.append(1) or generate(*a, **k)
    plan = gpt_plan()
    try:
        compiled = compile_shared(plan, lambda p, m, schedule=None: compile_plan(
            p, m, schedule=schedule))
    finally:
        driver.make_schedule = generate
    if rank == 1:  # this rank ends up with another (valid) schedule
        compiled.schedule = compile_plan(dataclasses.replace(
            plan, pipeline=dataclasses.replace(plan.pipeline, schedule="gpipe"))).schedule
    try:
        check_agreement(plan, compiled)
    except Exception as e:
        return str(e), len(searched)
    return None, len(searched)


@pytest.mark.slow
def test_different_schedules_stop_every_rank_before_step_1(spawn):
    """Only rank 0 generates a schedule; an injected mismatch stops every rank, named."""
    results = spawn(_agree, 2, timeout=120)
    assert [n for _, n in results] == [1, 0]  # rank 1 compiled with rank 0's schedule
    messages = [m for m, _ in results]
    assert all(m is not None for m in messages)  # both ranks stop, not only the odd one
    assert messages[0] == messages[1]
    assert "the schedule differ" in messages[0] and "rank 0" in messages[0] \
        and "rank 1" in messages[0]
    assert "stages differ" not in messages[0]  # names what differs, nothing else


def _trained(rank, world, plans, prefetch):
    out = []
    for plan in plans:
        trainer = PipelineTrainer.for_plan(plan)
        trainer.executor.prefetch = prefetch
        losses = [trainer.step(t).loss for t in range(2)]
        out.append((losses, trainer.named_parameters()))
    return out


@pytest.mark.slow
def test_receives_posted_early_change_no_bit(spawn):
    """The example kinds on pp2 (incl. a V placement with same-rank hand-offs): posting each
    receive one action early (or fused with the send) gives bitwise the same as posting it
    right before its action."""
    plans = [gpt_plan(kind="1f1b"), gpt_plan(kind="zbv", virtual=2)]
    early = spawn(_trained, 2, plans, True, timeout=240)
    late = spawn(_trained, 2, plans, False, timeout=240)
    for r in range(2):
        for (la, pa), (lb, pb) in zip(early[r], late[r]):
            assert la == lb
            assert pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)


NAN_MODEL = '''
import torch
from torch import nn

class Bad(nn.Module):
    """Finite forward, NaN weight gradient: d sqrt(w - w) / dw = inf - inf."""
    def __init__(self, d):
        super().__init__()
        self.w = nn.Parameter(torch.ones(d))
    def reset_parameters(self):
        nn.init.ones_(self.w)
    def forward(self, x, ids):
        return x + (self.w - self.w).sqrt().sum()

class Parity(Bad):
    """NaN weight gradient only for a microbatch whose first token is even:
    d (w * k) ** 0.5 / dw = k / (2 sqrt(w k)) = 0 * inf at k = 0."""
    def forward(self, x, ids):
        k = (ids[0, 0] % 2).to(x.dtype)
        return x + (self.w * k).pow(0.5).sum()

class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 8)
        self.l0 = nn.Linear(8, 8)
        self.l1 = nn.Linear(8, 8)
        self.bad = Bad(8)
        self.head = nn.Linear(8, 64)
    def forward(self, input_ids):
        return self.head(self.bad(self.l1(torch.tanh(self.l0(self.emb(input_ids)))), input_ids))

class P(M):
    def __init__(self):
        super().__init__()
        self.bad = Parity(8)

class T(M):
    """The NaN inside a tensor-parallel pair: l0 column-, l1 row-parallel around it."""
    def forward(self, input_ids):
        return self.head(self.l1(self.bad(torch.tanh(self.l0(self.emb(input_ids))), input_ids)))
'''


def _nan_step(rank, world, source, seed=1, microbatches=2, dp=1, zero=0, tp=1):
    plan = Plan(model=ModelSpec(source, capture="fx"), data=DataSpec(seq_len=8, vocab=64, seed=seed),
                mesh=MeshSpec(pp=2, dp=dp, tp=tp), zero=zero, pipeline=PipelineSpec(
                    schedule="1f1b", microbatches=microbatches,
                    split=SplitSpec(kind="points", points=("head" if tp > 1 else "l1",))),
                tensor=TensorSpec(column=("l0",), row=("l1",)) if tp > 1 else TensorSpec(),
                train=TrainSpec(steps=1, global_batch=2 * microbatches * dp, seed=0))
    trainer = PipelineTrainer.for_plan(plan)
    before = {k: v.clone() for k, v in trainer.named_parameters().items()}
    try:
        trainer.step(0)
    except NonFiniteError as e:
        after = trainer.named_parameters()
        return str(e), all(torch.equal(before[k], after[k]) for k in before)
    return None, False


@pytest.mark.slow
def test_nan_gradient_stops_the_step_before_the_optimizer_naming_it(spawn, tmp_path):
    (tmp_path / "nanmodel.py").write_text(NAN_MODEL)
    results = spawn(_nan_step, 2, str(tmp_path / "nanmodel.py") + ":M", timeout=120)
    for message, unchanged in results:
        assert message is not None and unchanged  # raised on every rank, nothing applied
        assert message.startswith("step 1: non-finite values")
        assert "the optimizer step was not applied" in message
        assert "parameter `bad.w`" in message and "stage 1 microbatch 0" in message
    assert results[0][0] == results[1][0]


@pytest.mark.slow
def test_nan_in_a_later_microbatch_is_named_by_the_checked_rerun(spawn, tmp_path):
    """The hot path checks a stage's weight gradients once, after its last W/BW; the failed
    step is rerun with every action checked and names the first bad microbatch -- here
    microbatch 1 of 4 (0 is finite, 2 or 3 not the first), which the once-per-step check
    alone would place at the stage's last W."""
    from pipeplan.backends.runtime import data
    (tmp_path / "nanmodel.py").write_text(NAN_MODEL)
    source = str(tmp_path / "nanmodel.py") + ":P"

    def parity(seed):  # the first token of each microbatch, as the stages will see them
        plan = Plan(model=ModelSpec(source), data=DataSpec(seq_len=8, vocab=64, seed=seed),
                    pipeline=PipelineSpec(microbatches=4), train=TrainSpec(global_batch=8))
        return [int(b.field("input_ids")[0, 0]) % 2 for b in data.dp_microbatches(plan, 0, 0, 0)]

    seed = next(s for s in range(1, 500) if parity(s)[:2] == [1, 0] and parity(s)[3] == 1)
    results = spawn(_nan_step, 2, source, seed, 4, timeout=120)
    for message, unchanged in results:
        assert message is not None and unchanged
        assert "parameter `bad.w`" in message and "stage 1 microbatch 1" in message, message
    assert results[0][0] == results[1][0]


@pytest.mark.slow
@pytest.mark.parametrize("zero", [0, 2, 3])
def test_the_checked_rerun_under_data_parallel_and_zero(spawn, tmp_path, zero):
    """pp2 x dp2, NaN in every microbatch of both replicas: the rerun starts from zeroed
    gradients (DP buckets, ZeRO's flat shards) and every rank names the same first action."""
    (tmp_path / "nanmodel.py").write_text(NAN_MODEL)
    results = spawn(_nan_step, 4, str(tmp_path / "nanmodel.py") + ":M", 1, 2, 2, zero,
                    timeout=120)
    for message, unchanged in results:
        assert message is not None and unchanged, message
        assert "parameter `bad.w`" in message and "stage 1 microbatch 0" in message, message
    assert len({m for m, _ in results}) == 1


@pytest.mark.slow
def test_the_checked_rerun_under_tensor_parallel(spawn, tmp_path):
    """pp2 x tp2, the NaN between a column- and a row-parallel layer (their weights held as
    tp shards): the rerun replays the step with the TP collectives in it, and all four ranks
    name the same action and parameter."""
    (tmp_path / "nanmodel.py").write_text(NAN_MODEL)
    results = spawn(_nan_step, 4, str(tmp_path / "nanmodel.py") + ":T", 1, 2, 1, 0, 2,
                    timeout=120)
    for message, unchanged in results:
        assert message is not None and unchanged, message
        assert "parameter `bad.w`" in message and "stage 0 microbatch 0" in message, message
        assert message.endswith("(ranks 0, 1)"), message  # both tp ranks of stage 0
    assert len({m for m, _ in results}) == 1

