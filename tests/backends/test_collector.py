"""Python's garbage collector runs between training steps, never inside one
(backends/runtime/collector.py).

Each rank of a 2-process gloo world trains a pp2 plan through the worker's step loop
(`worker._train`, what `pipeplan run` runs) with the collector's thresholds set so low that
automatic collections, full ones included, would start in every step; gc.callbacks record
where each collection starts. Before collector.py a full collection of the ~320k objects a
rank holds (0.2-0.4 s of CPU) landed in one pipeline action per rank per run
(BENCHMARKS.md, stop 61).
"""
from __future__ import annotations

import gc

import pytest

from pipeplan.backends.runtime import worker
from pipeplan.backends.runtime.trainer import PipelineTrainer

from .test_equivalence import make_plan

STEPS = 3


def _collections_by_place(rank, world):
    trainer = PipelineTrainer.for_plan(make_plan("gpt", "1f1b", 2, 1))
    inside = [False]
    starts = []  # (generation, inside a step)
    step = trainer.step

    def stepping(t):
        inside[0] = True
        try:
            return step(t)
        finally:
            inside[0] = False

    def seen(phase, info):
        if phase == "start":
            starts.append((info["generation"], inside[0]))

    trainer.step = stepping
    thresholds = gc.get_threshold()
    gc.set_threshold(10, 1, 1)  # a full collection every few hundred allocations
    gc.callbacks.append(seen)
    try:
        losses, _, _ = worker._train(trainer.plan, trainer, worker.RankEnv(rank, world, rank),
                                     worker.RunOptions(steps=STEPS), [""])
        after = (gc.isenabled(), gc.get_freeze_count())
    finally:
        gc.callbacks.remove(seen)
        gc.set_threshold(*thresholds)
    return {"losses": losses, "starts": starts, "after": after}


@pytest.mark.slow
def test_the_collector_runs_between_steps_never_inside_one(spawn):
    for r in spawn(_collections_by_place, 2):
        assert [place for _, place in r["starts"] if place] == [], \
            "a collection started inside a training step"
        between = [gen for gen, place in r["starts"] if not place]
        assert between.count(2) >= STEPS, between  # one full collection after every step
        assert r["after"] == (True, 0)  # the collector restored: enabled, nothing frozen
    assert len(r["losses"]) == STEPS
