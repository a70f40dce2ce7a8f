"""One rank of an in-process world trained as `pipeplan run` does, handed to the judge
(tests only: `pipeplan verify` launches real ranks)."""
from __future__ import annotations

from pipeplan.backends.runtime.trainer import PipelineTrainer
from pipeplan.backends.verify.run import FirstStepGrads, rank_result
from pipeplan.dsl.ast import Plan


def train_for_judge(plan: Plan, steps: int) -> dict:
    """One rank of an in-process world (tests): train as `pipeplan run` does, then hand over
    `rank_result` (collective: every rank of the default group calls it)."""
    trainer = PipelineTrainer.for_plan(plan)
    grads = FirstStepGrads(trainer)
    losses = [trainer.step(t).loss for t in range(steps)]
    return rank_result(losses, trainer, grads)
