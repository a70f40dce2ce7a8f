"""Local search that polishes a verified schedule under real costs (used by `auto` on small cases).

Moves swap two adjacent actions of one rank; a move is kept when the schedule
still verifies (order, channels, deadlock, memory limit) and the simulated
(makespan, sum of per-rank finish times) decreases. Swaps that let an action
on the critical path start earlier are tried first. Deterministic; capped by a
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


def refine(schedule: Schedule, costs: Costs, memory_limit: Optional[float], budget_s: float) -> Schedule:
    if schedule.num_actions > MAX_ACTIONS or budget_s <= 0:
        return schedule
    deadline = time.perf_counter() + budget_s
    table = costs.stage_table(schedule.stage_to_rank)
    best, best_key = schedule, _score(schedule, table)
    improved = True
    while improved and time.perf_counter() < deadline:
        improved = False
        for r, i in _candidate_swaps(best, costs):
            if time.perf_counter() >= deadline:
                break
            trial = _swap(best, r, i)
            key = _try(trial, table, memory_limit)
            if key is not None and key < best_key:
                best, best_key, improved = trial, key, True
                break
    return best


def _swap(s: Schedule, r: int, i: int) -> Schedule:
    row = list(s.order[r])
    row[i], row[i + 1] = row[i + 1], row[i]
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


def _candidate_swaps(s: Schedule, costs: Costs) -> list[tuple[int, int]]:
    """Every adjacent pair; first those whose second action lies on the critical path."""
    critical = {(r, a) for r, a in simulate(s, costs).critical_path}
    index = {(r, a): i for r, row in enumerate(s.order) for i, a in enumerate(row)}
    first = [(r, index[(r, a)] - 1) for r, a in critical if index[(r, a)] > 0]
    rest = [(r, i) for r, row in enumerate(s.order) for i in range(len(row) - 1)]
    seen, out = set(), []
    for pair in sorted(first) + rest:
        if pair not in seen:
            seen.add(pair)
            out.append(pair)
    return out
