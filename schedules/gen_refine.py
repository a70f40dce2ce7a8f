"""Local search that polishes a verified schedule under real costs (used by `auto` on small cases).

A move takes one action of a rank and runs it up to MAX_SHIFT positions
earlier or later; half the moves pull an action of the current critical path
earlier (the only actions whose timing can shorten the makespan). A move is
kept when the schedule still verifies (order, channels, deadlock, memory
limit) and the simulated (makespan, sum of per-rank finish times) does not
grow: equal moves are kept too, so the search walks across the plateaus a
makespan objective is full of instead of stopping at the first one. Moves come
from a seeded generator and are capped by count, so the result is a pure
function of the inputs; the wall-clock budget only guards a very slow machine.
The walk stops early at `target` (a lower bound: nothing shorter exists).
"""
from __future__ import annotations

import dataclasses
import random
import time
from typing import Optional

from .costs import Costs, StageCosts
from .errors import ScheduleError
from .execution import analyze
from .ir import B, BW, F, W, Action, Schedule
from .memory import peak_per_rank
from .simulate import critical_path, time_actions

MAX_ACTIONS = 1500
MAX_SHIFT = 6
CRITICAL_SHARE = 0.5  # fraction of moves that pull a critical-path action earlier


def refine(schedule: Schedule, costs: Costs, memory_limit: Optional[float], budget_s: float,
           evaluations: int = 2000, target: float = 0.0, seed: int = 0) -> Schedule:
    if schedule.num_actions > MAX_ACTIONS or budget_s <= 0 or evaluations <= 0:
        return schedule
    deadline = time.perf_counter() + budget_s
    table = costs.stage_table(schedule.stage_to_rank)
    rng = random.Random(seed)
    current = schedule
    key, timed = _evaluate(schedule, table, None)
    critical = _critical(schedule, table, timed)
    best, best_key = current, key
    rows = [r for r, row in enumerate(schedule.order) if len(row) > 1]
    done = 0
    for attempt in range(4 * evaluations):  # moves that fail the cheap pre-check cost no evaluation
        if done >= evaluations or best_key[0] <= target + 1e-9 or not rows or (
                attempt % 16 == 0 and time.perf_counter() > deadline):
            break
        if rng.random() < CRITICAL_SHARE:
            r, i = rng.choice(critical)
            j = max(0, i - rng.randint(1, MAX_SHIFT))
        else:
            r = rng.choice(rows)
            length = len(current.order[r])
            i = rng.randrange(length)
            j = min(length - 1, max(0, i + rng.choice((-1, 1)) * rng.randint(1, MAX_SHIFT)))
        if i == j or _breaks_local_order(current.order[r], i, j):
            continue
        trial = _move(current, r, i, j)
        done += 1
        trial_key, timed = _evaluate(trial, table, memory_limit)
        if trial_key is not None and trial_key <= key:
            current, key, critical = trial, trial_key, _critical(trial, table, timed)
            if key < best_key:
                best, best_key = current, key
    return best


def _needs(a: Action, x: Action) -> bool:
    """True when x (on a's rank) must run before a: its input or its same-microbatch prerequisite."""
    if x.microbatch != a.microbatch:
        return False
    if a.op == F:
        return x.op == F and x.stage == a.stage - 1
    if a.op == W:
        return x.op == B and x.stage == a.stage
    return (x.op == F and x.stage == a.stage) or (x.op in (B, BW) and x.stage == a.stage + 1)


def _breaks_local_order(row, i: int, j: int) -> bool:
    """Would moving row[i] to position j pass one of its prerequisites or dependents? (cheap pre-check)"""
    a = row[i]
    if j < i:
        return any(_needs(a, x) for x in row[j:i])
    return any(_needs(x, a) for x in row[i + 1:j + 1])


def _move(s: Schedule, r: int, i: int, j: int) -> Schedule:
    """Rank r runs its action i at position j."""
    row = list(s.order[r])
    row.insert(j, row.pop(i))
    return dataclasses.replace(s, order=s.order[:r] + (tuple(row),) + s.order[r + 1:])


def _evaluate(s: Schedule, table: StageCosts, memory_limit: Optional[float]):
    """((makespan, sum of per-rank finish times), (execution, start, end)), or (None, None) when the
    schedule fails verification or the memory limit."""
    try:
        ex = analyze(s)
    except ScheduleError:
        return None, None
    if memory_limit is not None and max(peak_per_rank(s)[0]) > memory_limit + 1e-9:
        return None, None
    start, end = time_actions(ex, table)
    finish = [row[-1] if row else 0.0 for row in end]
    return (round(max(finish), 9), round(sum(finish), 9)), (ex, start, end)


def _critical(s: Schedule, table: StageCosts, timed) -> list[tuple[int, int]]:
    """(rank, position) of each action on the critical path of the timed schedule."""
    index = {(r, a): i for r, row in enumerate(s.order) for i, a in enumerate(row)}
    return [(r, index[(r, a)]) for r, a in critical_path(*timed[:1], table, *timed[1:])]
