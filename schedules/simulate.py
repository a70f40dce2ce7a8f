"""simulate(): time a schedule under the runtime's semantics with per-op costs and p2p latency.

Bubble definitions (both reported, always named):
  bubble      = 1 - sum(busy) / (ranks * makespan)       whole iteration, idle/total
  span_bubble = 1 - sum(busy) / sum(last end - first start per rank)   each rank's own span
"""
from __future__ import annotations

from dataclasses import dataclass
from operator import sub
from typing import Callable, Optional

from .bound import makespan_bound
from .costs import Costs, StageCosts
from .execution import NONE, Execution, analyze
from .ir import B, BW, F, W, Action, Schedule, bulk
from .memory import peak_per_rank


@dataclass(frozen=True)
class Idle:
    """A gap on a rank and what it waited for."""

    rank: int
    start: float
    duration: float
    waiting_for: Optional[Action]  # None: the rank had finished and waits for the iteration end
    on_rank: Optional[int]

    def __str__(self) -> str:
        if self.waiting_for is None:
            return f"rank {self.rank} idle {self.duration:g} at t={self.start:g} after its last op"
        return (f"rank {self.rank} idle {self.duration:g} at t={self.start:g} waiting for "
                f"{self.waiting_for.describe()} on rank {self.on_rank}")


@dataclass(frozen=True)
class SimResult:
    schedule: Schedule
    costs: Costs
    makespan: float
    bubble: float  # whole iteration: 1 - sum busy / (ranks * makespan)
    span_bubble: float  # each rank from its first to its last op
    busy: tuple[float, ...]
    idle: tuple[float, ...]  # makespan - busy, per rank
    peak_activations: tuple[float, ...]
    lower_bound: float  # no schedule of this placement, costs and memory limit can be shorter
    start: tuple[tuple[float, ...], ...]  # per rank, aligned with schedule.order[rank]
    end: tuple[tuple[float, ...], ...]
    in_order: bool = True  # False: timed under tag-matched receives (another runtime's semantics)

    @property
    def critical_path(self) -> tuple[tuple[int, Action], ...]:
        """(rank, action) from time 0 to the makespan, each step the constraint that set the start."""
        return self._derived("_critical_path", lambda ex, table: _critical_path(ex, table, self.start, self.end))

    @property
    def idle_attribution(self) -> tuple[Idle, ...]:
        """Every idle gap on every rank and the action it waited for (computed on first use)."""
        return self._derived("_idle_attribution",
                             lambda ex, table: _idle_attribution(ex, self.start, self.end, self.makespan))

    def _derived(self, name: str, compute):
        value = self.__dict__.get(name)
        if value is None:
            value = compute(analyze(self.schedule, self.in_order), self.costs.stage_table(self.schedule.stage_to_rank))
            object.__setattr__(self, name, value)
        return value

    @property
    def concurrency(self) -> float:
        """How many ranks compute at once, as a computing rank sees it: the time average of
        k(t) over the moments some rank computes, weighted by k(t) itself (each computing
        rank counts the moment once): sum k^2 dt / sum k dt. 1 for one rank. An action
        counts over its span by the share of it its rank computes: all of it, less what
        `costs.waiting` says it waits on other ranks inside it (a collective's wait leaves
        the core to the others, as a bubble does)."""
        edges = sorted((t, d * share) for r in range(len(self.start))
                       for a, s, e in zip(self._actions(r), self.start[r], self.end[r])
                       if e > s and (share := self._computing(a, e - s)) > 0
                       for t, d in ((s, 1), (e, -1)))
        k, last, weighted, total = 0.0, 0.0, 0.0, 0.0
        for t, d in edges:
            weighted += k * k * (t - last)
            total += k * (t - last)
            k, last = k + d, t
        return weighted / total if total > 0 else 1.0

    def _actions(self, rank: int):
        return self.schedule.order[rank] if self.schedule is not None else \
            (None,) * len(self.start[rank])

    def _computing(self, action: Optional[Action], span: float) -> float:
        """The share of `span` (the action's simulated time) its rank computes."""
        if self.costs.waiting is None or action is None:
            return 1.0
        waits = StageCosts(self.costs.waiting, 0.0)  # the op's waiting, as its time is read
        return max(0.0, 1.0 - waits.time(action.op, action.stage) / span)

    @property
    def lower_bound_bubble(self) -> float:
        return _bubble(self.busy, self.lower_bound)

    def metrics(self) -> dict:
        """The JSON schema's "metrics" object."""
        return {"makespan": self.makespan, "bubble": self.bubble, "span_bubble": self.span_bubble,
                "peak_activations": list(self.peak_activations), "lower_bound": self.lower_bound}


def _bubble(busy, makespan: float) -> float:
    return 0.0 if makespan <= 0 else 1.0 - sum(busy) / (len(busy) * makespan)


def simulate(schedule: Schedule, costs: Optional[Costs] = None,
             memory_limit: Optional[float] = None, in_order: bool = True,
             durations: Optional[Callable[[Action], float]] = None,
             delays: Optional[Callable[[Action], float]] = None) -> SimResult:
    """Time the schedule. The lower bound holds for every schedule of the same placement and
    costs within `memory_limit` activations per rank (default: this schedule's own peak).
    in_order=False times it under tag-matched receives (torch's runtime; see execution.analyze).
    `durations`: each action's own time (one measured step replayed, compiler/estimate/profile.py)
    instead of its stage's per-op cost; `delays`: how long each action's input took to arrive
    from another rank, instead of `costs.latency`; `costs` still give the lower bound."""
    with bulk():
        return _simulate(schedule, costs or Costs(), memory_limit, in_order, durations, delays)


def _simulate(schedule: Schedule, costs: Costs, memory_limit: Optional[float], in_order: bool,
              durations: Optional[Callable[[Action], float]] = None,
              delays: Optional[Callable[[Action], float]] = None) -> SimResult:
    table = costs.stage_table(schedule.stage_to_rank)
    ex = analyze(schedule, in_order)
    start, end = _time(ex, table, durations, delays)
    p = schedule.ranks
    busy = tuple(sum(map(sub, end[r], start[r])) for r in range(p))  # sum of (end - start), in C
    makespan = max((row[-1] for row in end if row), default=0.0)
    spans = [row_e[-1] - row_s[0] if row_s else 0.0 for row_s, row_e in zip(start, end)]
    span_bubble = 1.0 - sum(busy) / sum(spans) if sum(spans) > 0 else 0.0
    idle = tuple(makespan - b for b in busy)
    peaks = peak_per_rank(schedule)[0]
    return SimResult(
        schedule=schedule, costs=costs, makespan=makespan, bubble=_bubble(busy, makespan),
        span_bubble=span_bubble, busy=busy, idle=idle,
        peak_activations=peaks,
        lower_bound=lower_bound(schedule, table, max(peaks) if memory_limit is None else memory_limit),
        start=tuple(map(tuple, start)), end=tuple(map(tuple, end)), in_order=in_order)


def _time(ex: Execution, table: StageCosts,
          durations: Optional[Callable[[Action], float]] = None,
          delays: Optional[Callable[[Action], float]] = None):
    """Start/end of every action: after its rank's previous action and its input's arrival.

    Times live in flat lists indexed by the encoded position (rank * stride + index), so the
    loop over the dependency order does one division per action."""
    order, stride, lat = ex.schedule.order, ex.stride, table.latency
    per_op = {op: [table.time(op, s) for s in range(ex.schedule.stages)] for op in (F, B, W, BW)}
    size = stride * len(order)
    dur = [0.0] * size
    for r, row in enumerate(order):
        dur[r * stride:r * stride + len(row)] = ([per_op[a.op][a.stage] for a in row]
                                                 if durations is None else list(map(durations, row)))
    producer = [NONE] * size
    for r, row in enumerate(ex.producer):
        producer[r * stride:r * stride + len(row)] = row
    delay = None
    if delays is not None:
        delay = [lat] * size
        for r, row in enumerate(order):
            delay[r * stride:r * stride + len(row)] = list(map(delays, row))
    start = [0.0] * size
    end = [0.0] * size
    free = [0.0] * len(order)
    if delay is None:  # the local search's inner loop: one constant latency
        for code in ex.topo:
            r = code // stride
            t = free[r]
            dep = producer[code]
            if dep != NONE:
                arrive = end[dep] + (lat if dep // stride != r else 0.0)
                if arrive > t:
                    t = arrive
            start[code] = t
            free[r] = end[code] = t + dur[code]
    else:
        for code in ex.topo:
            r = code // stride
            t = free[r]
            dep = producer[code]
            if dep != NONE:
                arrive = end[dep] + (delay[code] if dep // stride != r else 0.0)
                if arrive > t:
                    t = arrive
            start[code] = t
            free[r] = end[code] = t + dur[code]
    return ([start[r * stride:r * stride + len(row)] for r, row in enumerate(order)],
            [end[r * stride:r * stride + len(row)] for r, row in enumerate(order)])


def _idle_attribution(ex: Execution, start, end, makespan: float) -> tuple[Idle, ...]:
    out = []
    order = ex.schedule.order
    for r, row in enumerate(order):
        prev_end = 0.0
        for i in range(len(row)):
            gap = start[r][i] - prev_end
            if gap > 1e-12:
                dep = ex.producer[r][i]
                q = dep // ex.stride
                out.append(Idle(r, prev_end, gap, ex.action(dep), q))
            prev_end = end[r][i]
        if makespan - prev_end > 1e-12:
            out.append(Idle(r, prev_end, makespan - prev_end, None, None))
    return tuple(out)


def critical_path(ex: Execution, table: StageCosts, start, end) -> tuple[tuple[int, Action], ...]:
    """The critical path of timed actions (the local search's inner loop uses it directly)."""
    return _critical_path(ex, table, start, end)


def _critical_path(ex: Execution, table: StageCosts, start, end) -> tuple[tuple[int, Action], ...]:
    """Walk back from the last action to finish, following whichever constraint set each start."""
    order = ex.schedule.order
    candidates = [(row[-1], r) for r, row in enumerate(end) if row]
    if not candidates:
        return ()
    _, r = max(candidates)
    pos: Optional[tuple[int, int]] = (r, len(order[r]) - 1)
    path = []
    while pos is not None:
        r, i = pos
        path.append((r, order[r][i]))
        dep = ex.producer[r][i]
        if dep != NONE:
            q, j = ex.pos(dep)
            arrive = end[q][j] + (table.latency if q != r else 0.0)
            if arrive >= start[r][i] - 1e-12 and (i == 0 or arrive >= end[r][i - 1]):
                pos = (q, j)
                continue
        pos = (r, i - 1) if i > 0 else None
    return tuple(reversed(path))


def lower_bound(schedule: Schedule, table: StageCosts, memory_limit: Optional[float] = None) -> float:
    """No schedule of this placement and these costs, holding at most `memory_limit` activations
    per rank (default: this schedule's own peak), can be shorter; the proof is in bound.py."""
    if memory_limit is None:
        memory_limit = max(peak_per_rank(schedule)[0], default=None)
    return makespan_bound(schedule.stage_to_rank, schedule.microbatches, table, memory_limit)
