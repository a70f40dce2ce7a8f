"""auto: a cost- and memory-aware search over orders and placements (loop v=1, V, loop v=2).

Three phases, each candidate verified and simulated, the shortest makespan winning (then
the lower peak memory):
  1. every fixed kind within the memory limit; the paper's ZB-V order with its senders put
     in their receivers' order (fifo_repair.delay_senders: p units, unlike the zbv kind's
     receiver-side repair); and the list scheduler (gen_greedy) with the real per-stage
     costs and latency over each placement: backward split or whole, W deferred, eager or
     only in gaps, backwards or forwards first, whole or loose memory reservation, at the
     memory limit (or at p, 2p-1 and unlimited when none is given);
  2. the list scheduler again with seeded random deviations, per placement (JITTER_RUNS);
  3. a critical-path local search (gen_search) from the best distinct candidates, sharing
     SEARCH_WORK // actions evaluations, stopping at the placement's lower bound (bound.py).
Phases 2 and 3 skip a placement once its best reaches its bound or its bound cannot beat
the best found. Everything is bounded by counts, never by time, so `auto` is a pure
function of its inputs (every rank of a run computes the same schedule). Above BIG
actions only the most promising phase-1 variants run, and above HUGE actions only the
closed-form kinds compete.
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Iterator, Optional

from .bound import makespan_bound
from .costs import Costs
from .errors import ScheduleError
from .fifo_repair import delay_senders
from .kinds import FIXED_KINDS, KINDS_TABLE, build_fixed
from .gen_greedy import Policy, Stall, list_schedule
from .gen_search import search
from .gen_zero_bubble import zbv_paper, zbv_tagged
from .ir import Schedule, loop_placement, v_placement
from .memory import peak_per_rank
from .simulate import simulate

JITTER_RUNS = 160  # phase 2: randomised list-scheduler runs per placement, at most
JITTER_WORK = 12_000  # ... and at most this many actions scheduled per placement
JITTER_ACTIONS = 1000  # phase 2 runs up to this many actions (above, the local search does better)
SEARCH_WORK = 30_000_000  # phase 3: evaluations x actions, shared by the starts
MAX_EVALUATIONS = 20_000  # phase 3 on small cases
STARTS = (0.8, 0.1, 0.1)  # shares of the evaluations: the senders-repaired ZB-V first (the best
# start measured: from it the search reaches the bound at p=8, m=32), then the best two others
SENDERS = "ZB-V paper order, senders in channel order"
SEARCH_ACTIONS = 8000  # phases 2 and 3 run up to this many actions (p=16, m=64 with 2 stages per rank)
BIG = 20_000  # actions above which only the most promising greedy variants run
HUGE = 100_000  # actions above which no list scheduling runs (seconds per run in Python)
CLOSED_FORM = ("gpipe", "1f1b", "interleaved", "zbh1", "dualpipev")


@dataclasses.dataclass
class _Best:
    """The best candidate so far, overall and per placement."""

    key: tuple = ()
    label: str = ""
    schedule: Optional[Schedule] = None
    per_placement: dict = dataclasses.field(default_factory=dict)  # placement -> (makespan, label, schedule)
    tried: int = 0
    ranked: list = dataclasses.field(default_factory=list)  # (makespan, tried, label, schedule), valid ones

    def offer(self, label: str, schedule: Schedule, costs: Costs, limit: Optional[float]) -> None:
        self.tried += 1
        try:
            result = simulate(schedule, costs)  # proves it runs (order, channels, no deadlock)
        except ScheduleError:
            return
        peak = max(result.peak_activations)
        if limit is not None and peak > limit + 1e-9:
            return
        key = (round(result.makespan, 9), peak, self.tried)
        self.ranked.append((key[0], self.tried, label, schedule))
        if self.schedule is None or key < self.key:
            self.key, self.label, self.schedule = key, label, schedule
        mine = self.per_placement.get(schedule.stage_to_rank)
        if mine is None or key[0] < mine[0]:
            self.per_placement[schedule.stage_to_rank] = (key[0], label, schedule)

    @property
    def makespan(self) -> float:
        return self.key[0] if self.key else float("inf")


def auto(ranks: int, microbatches: int, virtual: Optional[int], costs: Costs,
         memory_limit: Optional[float]) -> Schedule:
    p, m = ranks, microbatches
    vs = _virtuals(p, virtual, costs)
    best = _Best()
    for label, schedule in _candidates(p, m, vs, costs, memory_limit):
        best.offer(label, schedule, costs, memory_limit)
    if best.schedule is None:
        raise ScheduleError(f"auto: no schedule for {p} ranks and {m} microbatches fits the memory limit "
                            f"{memory_limit:g} (every microbatch needs 1 unit on each rank)"
                            if memory_limit is not None else
                            f"auto: no schedule found for {p} ranks and {m} microbatches")
    if 3 * p * max(vs) * m <= SEARCH_ACTIONS:
        placements = [(name, pl, makespan_bound(pl, m, costs.stage_table(pl), memory_limit))
                      for name, pl in _placements(p, vs)]
        if 3 * p * max(vs) * m <= JITTER_ACTIONS:
            _jittered(best, placements, p, m, costs, memory_limit)
        _searched(best, placements, costs, memory_limit)
    return dataclasses.replace(best.schedule, name=f"auto:{best.label}")


def auto_bound(ranks: int, microbatches: int, virtual: Optional[int], costs: Costs,
               memory_limit: Optional[float]) -> float:
    """A lower bound on every schedule auto could return: the least over the placements it searches."""
    vs = _virtuals(ranks, virtual, costs)
    return min(makespan_bound(placement, microbatches, costs.stage_table(placement), memory_limit)
               for _, placement in _placements(ranks, vs))


def _virtuals(p: int, virtual: Optional[int], costs: Costs) -> tuple[int, ...]:
    if costs.per_stage is not None:
        v, rem = divmod(len(costs.per_stage), p)
        if rem or v not in (1, 2) or (virtual is not None and virtual != v):
            raise ScheduleError(f"auto: per-stage costs list {len(costs.per_stage)} stages; "
                                f"expected {p} or {2 * p} for {p} ranks"
                                + (f" with virtual={virtual}" if virtual else ""))
        return (v,)
    return (virtual,) if virtual is not None else (1, 2)


def _placements(p: int, vs: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
    out = []
    if 1 in vs:
        out.append(("loop", loop_placement(p, 1)))
    if 2 in vs:
        out += [("V", v_placement(p)), ("loop2", loop_placement(p, 2))]
    return out


def _candidates(p: int, m: int, vs: tuple[int, ...], costs: Costs, limit: Optional[float]):
    """Phase 1: the fixed kinds and the deterministic list-scheduler variants."""
    actions = 3 * p * max(vs) * m
    huge = actions > HUGE
    for kind in FIXED_KINDS:
        if huge and kind not in CLOSED_FORM:
            continue
        for v in vs:
            if not KINDS_TABLE[kind].allows(v):
                continue
            try:
                yield kind, build_fixed(kind, p, m, v, limit)
            except ScheduleError:
                continue
    if huge:
        return
    if 2 in vs:
        paper = zbv_paper(p, m)  # receivers repaired (p + r/2); the senders' repair keeps p
        if limit is None or max(peak_per_rank(paper)[0]) <= limit + 1e-9:
            yield "ZB-V paper order, receivers in channel order", paper
        if 3 * p * 2 * m <= SEARCH_ACTIONS:
            try:
                yield SENDERS, delay_senders(zbv_tagged(p, m))
            except ScheduleError:
                pass
    limits = (limit,) if limit is not None else (float(p), float(2 * p - 1), float(m))
    big = actions > BIG
    for name, placement in _placements(p, vs):
        table = costs.stage_table(placement)
        for split in (True, False):
            w_policies = ((False, False), (True, False), (False, True)) if split else ((False, False),)
            for (eager, fits), forward_first, whole in itertools.product(w_policies, (False, True), (True, False)):
                if big and (eager or fits or forward_first or not split or name == "loop2" or not whole):
                    continue
                for lim in sorted(set(limits)):
                    policy = Policy(split=split, limits=(lim,) * p, eager_w=eager, w_fits_gap=fits,
                                    forward_first=forward_first, reserve_whole=whole)
                    try:
                        schedule = list_schedule("auto", placement, m, table, policy)
                    except Stall:
                        continue
                    yield f"greedy {name}, {_describe(policy)}", schedule


def _describe(policy: Policy) -> str:
    parts = ["B/W split" if policy.split else "BW"]
    parts += [text for flag, text in ((policy.eager_w, "eager W"), (policy.w_fits_gap, "W only in gaps"),
                                      (policy.forward_first, "forwards first"),
                                      (not policy.reserve_whole, "loose reservation")) if flag]
    if policy.jitter:
        parts.append(f"jitter {policy.jitter:g} seed {policy.seed}")
    return ", ".join(parts) + f", limit {policy.limits[0]:g}"


def _open(best: _Best, placements) -> list[tuple[float, str, tuple[int, ...], float]]:
    """(its best makespan, name, placement, bound) for each placement that may still hold a shorter
    schedule: its bound is below the best makespan and its own best above its bound. Best first."""
    out = []
    for name, placement, bound in placements:
        mine = best.per_placement.get(placement, (float("inf"),))[0]
        if bound < best.makespan - 1e-9 and mine > bound + 1e-9:
            out.append((mine, name, placement, bound))
    return sorted(out)


def _jittered(best: _Best, placements, p: int, m: int, costs: Costs, limit: Optional[float]) -> None:
    """Phase 2: seeded random deviations from the list scheduler's rule, per open placement."""
    lim = limit if limit is not None else float(2 * p - 1)
    for _, name, placement, _ in _open(best, placements):
        table = costs.stage_table(placement)
        for seed, jitter, whole in _jitter_plan(min(JITTER_RUNS, JITTER_WORK // (3 * m * len(placement)))):
            if all(pl != placement for _, _, pl, _ in _open(best, placements)):
                break
            policy = Policy(split=True, limits=(lim,) * p, reserve_whole=whole, jitter=jitter, seed=seed)
            try:
                schedule = list_schedule("auto", placement, m, table, policy)
            except Stall:
                continue
            best.offer(f"greedy {name}, {_describe(policy)}", schedule, costs, limit)


def _jitter_plan(runs: int) -> Iterator[tuple[int, float, bool]]:
    for seed in range((runs + 3) // 4):
        for jitter, whole in itertools.product((0.05, 0.15), (True, False)):
            yield seed, jitter, whole


def _searched(best: _Best, placements, costs: Costs, limit: Optional[float]) -> None:
    """Phase 3: local search from the best distinct candidates whose placement is still open."""
    bounds = {pl: bound for _, pl, bound in placements}
    starts, seen = [], set()
    for makespan, _, label, schedule in sorted(best.ranked, key=lambda e: (e[2] != SENDERS, e[:2])):
        if schedule.order in seen or bounds[schedule.stage_to_rank] >= best.makespan - 1e-9:
            continue
        if makespan <= bounds[schedule.stage_to_rank] + 1e-9:
            continue  # nothing of this placement is shorter
        seen.add(schedule.order)
        starts.append((label, schedule))
        if len(starts) == len(STARTS):
            break
    for seed, ((label, schedule), share) in enumerate(zip(starts, STARTS)):
        evaluations = int(share * min(MAX_EVALUATIONS, SEARCH_WORK // schedule.num_actions))
        found = search(schedule, costs, limit, evaluations, bounds[schedule.stage_to_rank], seed)
        if found is not schedule:
            best.offer(label + " + local search", found, costs, limit)
