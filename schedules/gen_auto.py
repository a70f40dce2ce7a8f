"""auto: a cost- and memory-aware search over the zero-bubble heuristic family.

Candidates: every fixed kind that fits the memory limit (so auto is never worse
than the best of them), plus the list scheduler (gen_greedy) run with the real
per-stage costs and latency over both placements (loop and V), with the
backward split or whole, W deferred, eager or only in gaps, backwards or forwards first,
at the memory limit (or at p, 2p-1 and unlimited when none is given). Each
candidate is verified and simulated; the shortest makespan wins, then the lower
peak memory. The work is capped so the compiler can call it on large pipelines:
above BIG actions only the most promising list-scheduler variants run, and above
HUGE actions only the closed-form kinds (gpipe, 1f1b, interleaved, zbh1,
dualpipev) compete, so "never worse than the best fixed kind" then holds
against those.
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Optional

from .costs import Costs
from .errors import ScheduleError
from .gen_refine import refine
from .gen_greedy import Policy, Stall, list_schedule
from .gen_zero_bubble import zbv_paper
from .ir import Schedule, loop_placement, v_placement
from .memory import peak_per_rank
from .simulate import simulate

FIXED_KINDS = ("gpipe", "1f1b", "interleaved", "zbh1", "zbh2", "zbv", "vhalf", "vmin", "dualpipev")
REFINE_SECONDS = 0.3  # local-search budget on small cases (gen_refine.MAX_ACTIONS)
BIG = 20_000  # actions above which only the most promising greedy variants run
HUGE = 100_000  # actions above which no list scheduling runs (seconds per run in Python)
CLOSED_FORM = ("gpipe", "1f1b", "interleaved", "zbh1", "dualpipev")


def auto(ranks: int, microbatches: int, virtual: Optional[int], costs: Costs,
         memory_limit: Optional[float]) -> Schedule:
    p, m = ranks, microbatches
    vs = _virtuals(p, virtual, costs)
    best = None
    tried = 0
    for label, schedule in _candidates(p, m, vs, costs, memory_limit):
        tried += 1
        try:
            result = simulate(schedule, costs)  # proves it runs (order, channels, no deadlock)
        except ScheduleError:
            continue
        key = (round(result.makespan, 9), max(result.peak_activations), tried)
        if best is None or key < best[0]:
            best = (key, label, schedule)
    if best is None:
        raise ScheduleError(f"auto: no schedule for {p} ranks and {m} microbatches fits the memory limit "
                            f"{memory_limit:g} (every microbatch needs 1 unit on each rank)"
                            if memory_limit is not None else
                            f"auto: no schedule found for {p} ranks and {m} microbatches")
    polished = refine(best[2], costs, memory_limit, REFINE_SECONDS)
    label = best[1] + (" + local search" if polished is not best[2] else "")
    return dataclasses.replace(polished, name=f"auto:{label}")


def _virtuals(p: int, virtual: Optional[int], costs: Costs) -> tuple[int, ...]:
    if costs.per_stage is not None:
        v, rem = divmod(len(costs.per_stage), p)
        if rem or v not in (1, 2) or (virtual is not None and virtual != v):
            raise ScheduleError(f"auto: per-stage costs list {len(costs.per_stage)} stages; "
                                f"expected {p} or {2 * p} for {p} ranks"
                                + (f" with virtual={virtual}" if virtual else ""))
        return (v,)
    return (virtual,) if virtual is not None else (1, 2)


def _candidates(p: int, m: int, vs: tuple[int, ...], costs: Costs, limit: Optional[float]):
    from .generate import generate  # the fixed kinds, verified at the same memory limit
    actions = 3 * p * max(vs) * m
    huge = actions > HUGE
    for kind in FIXED_KINDS:
        if huge and kind not in CLOSED_FORM:
            continue
        for v in vs:
            if kind in ("1f1b", "zbh1", "zbh2") and v != 1:
                continue
            if kind in ("zbv", "vhalf", "vmin", "dualpipev", "interleaved") and v != 2:
                continue
            try:
                yield kind, generate(kind, p, m, v, memory_limit=limit)
            except ScheduleError:
                continue
    if huge:
        return
    if 2 in vs:
        try:
            schedule = zbv_paper(p, m)
            if limit is None or max(peak_per_rank(schedule)[0]) <= limit + 1e-9:
                yield "ZB-V paper order (in-order channels)", schedule
        except ScheduleError:
            pass
    placements = []
    if 1 in vs:
        placements.append(("loop", loop_placement(p, 1)))
    if 2 in vs:
        placements += [("V", v_placement(p)), ("loop2", loop_placement(p, 2))]
    limits = (limit,) if limit is not None else (float(p), float(2 * p - 1), float(m))
    big = actions > BIG
    for name, placement in placements:
        table = costs.stage_table(placement)
        for split in (True, False):
            w_policies = ((False, False), (True, False), (False, True)) if split else ((False, False),)
            for (eager, fits), forward_first in itertools.product(w_policies, (False, True)):
                if big and (eager or fits or forward_first or not split or name == "loop2"):
                    continue
                for lim in sorted(set(limits)):
                    policy = Policy(split=split, limits=(lim,) * p, eager_w=eager, w_fits_gap=fits,
                                    forward_first=forward_first)
                    try:
                        schedule = list_schedule("auto", placement, m, table, policy)
                    except Stall:
                        continue
                    if limit is not None and max(peak_per_rank(schedule)[0]) > limit + 1e-9:
                        continue
                    label = (f"greedy {name}, {'B/W split' if split else 'BW'}"
                             f"{', eager W' if eager else ''}{', W only in gaps' if fits else ''}"
                             f"{', forwards first' if forward_first else ''}, limit {lim:g}")
                    yield label, schedule
