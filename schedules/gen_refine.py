"""Local search that polishes a verified schedule under real costs (used by `auto` on small cases).

A move takes one action of a rank and runs it up to MAX_SHIFT positions
earlier; it is kept when the schedule still verifies (order, channels,
deadlock, memory limit) and the simulated (makespan, sum of per-rank finish
times) decreases. Actions on the critical path are tried first. Deterministic; capped by a
time budget and a size limit so `auto` stays fast.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Optional

from .costs import Costs, StageCosts
from .errors import ScheduleError
from .execution import analyze
from .ir import Schedule
from .memory import peak_per_rank
from .simulate import simulate, time_actions

MAX_ACTIONS = 1500
MAX_SHIFT = 4


def refine(schedule: Schedule, costs: Costs, memory_limit: Optional[float], budget_s: float) -> Schedule:
    if schedule.num_actions > MAX_ACTIONS or budget_s <= 0:
        return schedule
    deadline = time.perf_counter() + budget_s
    table = costs.stage_table(schedule.stage_to_rank)
    best, best_key = schedule, _score(schedule, table)
    improved = True
    while improved and time.perf_counter() < deadline:
        improved = False
        for r, i, j in _candidate_moves(best, costs):
            if time.perf_counter() >= deadline:
                break
            trial = _move(best, r, i, j)
            key = _try(trial, table, memory_limit)
            if key is not None and key < best_key:
                best, best_key, improved = trial, key, True
                break
    return best


def _move(s: Schedule, r: int, i: int, j: int) -> Schedule:
    """Rank r runs its action i at position j (< i)."""
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


def _candidate_moves(s: Schedule, costs: Costs) -> list[tuple[int, int, int]]:
    """(rank, from, to) moves: critical-path actions first, then every action, each 1..MAX_SHIFT earlier."""
    critical = [(r, a) for r, a in simulate(s, costs).critical_path]
    index = {(r, a): i for r, row in enumerate(s.order) for i, a in enumerate(row)}
    ordered = [(r, index[(r, a)]) for r, a in critical]
    ordered += [(r, i) for r, row in enumerate(s.order) for i in range(len(row))]
    seen, out = set(), []
    for r, i in ordered:
        if (r, i) in seen:
            continue
        seen.add((r, i))
        out += [(r, i, j) for j in range(i - 1, max(-1, i - 1 - MAX_SHIFT), -1)]
    return out
