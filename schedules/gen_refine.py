"""Local search that polishes a verified schedule under real costs (used by `auto` on small cases).

A move takes one action of a rank and runs it up to MAX_SHIFT positions earlier
or later. A move is kept when the schedule still verifies (order, channels,
deadlock, memory limit) and the simulated (makespan, sum of per-rank finish
times) does not grow: equal moves are kept too, so the search walks across the
plateaus a makespan objective is full of instead of stopping at the first one.
Moves are drawn from a seeded generator, so the result is a pure function of
the inputs while the evaluation cap binds; a wall-clock cap keeps `auto` fast
on a slow machine (then the result may differ from run to run). The walk stops
early at `target` (a lower bound: nothing shorter exists).
"""
from __future__ import annotations

import dataclasses
import random
import time
from typing import Optional

from .costs import Costs, StageCosts
from .errors import ScheduleError
from .execution import analyze
from .ir import Schedule
from .memory import peak_per_rank
from .simulate import time_actions

MAX_ACTIONS = 1500
MAX_SHIFT = 6


def refine(schedule: Schedule, costs: Costs, memory_limit: Optional[float], budget_s: float,
           evaluations: int = 2000, target: float = 0.0, seed: int = 0) -> Schedule:
    if schedule.num_actions > MAX_ACTIONS or budget_s <= 0 or evaluations <= 0:
        return schedule
    deadline = time.perf_counter() + budget_s
    table = costs.stage_table(schedule.stage_to_rank)
    rng = random.Random(seed)
    current = schedule
    key = _score(schedule, table)
    best, best_key = current, key
    rows = [r for r, row in enumerate(schedule.order) if len(row) > 1]
    for n in range(evaluations):
        if best_key[0] <= target + 1e-9 or not rows or (n % 16 == 0 and time.perf_counter() > deadline):
            break
        r = rng.choice(rows)
        length = len(current.order[r])
        i = rng.randrange(length)
        j = min(length - 1, max(0, i + rng.choice((-1, 1)) * rng.randint(1, MAX_SHIFT)))
        if i == j:
            continue
        trial = _move(current, r, i, j)
        trial_key = _try(trial, table, memory_limit)
        if trial_key is not None and trial_key <= key:
            current, key = trial, trial_key
            if key < best_key:
                best, best_key = current, key
    return best


def _move(s: Schedule, r: int, i: int, j: int) -> Schedule:
    """Rank r runs its action i at position j."""
    row = list(s.order[r])
    row.insert(j, row.pop(i))
    return dataclasses.replace(s, order=s.order[:r] + (tuple(row),) + s.order[r + 1:])


def _try(s: Schedule, table: StageCosts, memory_limit: Optional[float]):
    try:
        key = _score(s, table)
    except ScheduleError:
        return None
    if memory_limit is not None and max(peak_per_rank(s)[0]) > memory_limit + 1e-9:
        return None
    return key


def _score(s: Schedule, table: StageCosts) -> tuple[float, float]:
    _, end = time_actions(analyze(s), table)
    finish = [row[-1] if row else 0.0 for row in end]
    return (round(max(finish), 9), round(sum(finish), 9))
