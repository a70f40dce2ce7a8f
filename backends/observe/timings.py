"""What a run measured: each rank's action timings per step, the measured bubble and
its prediction (the schedule replayed with measured costs), and one step's sample for
a cost file (profiling.py).

Bubbles are whole-iteration (1 - sum busy / (ranks * makespan)), measured per
step on the pipeline at dp=0, tp=0, and reported as the median over the
steady-state steps (after the first, the warm-up, when there are more). The
prediction simulates the schedule with the plan's profile (`pipeline.profile`,
the planned timeline the compiler made) when it names one, else with this run's
measured mean per-op costs of each stage and mean point-to-point latency.

Both sides count the same thing as busy: an action's slot (executor.ActionTiming),
its compute plus the runtime's own work around it (posting its sends and the next
receive, its checks), which the profile measures as the op's time and the
simulator charges. Idle is what is left: a rank blocked on a receive, or before
its first and after its last action of the step. The makespan runs from the
first slot's start to the last slot's end, so gradient sync and the optimizer
after the last action are in neither side's denominator.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from statistics import mean, median
from typing import Optional, Sequence

from ...compiler.estimate.profile import OPS, StepSample
from ..runtime.executor import ActionTiming, Span


@dataclass(frozen=True)
class RankTimings:
    """Everything one rank measured: its coordinates and per-step action timings."""

    rank: int
    pp: int
    dp: int
    tp: int
    steps: tuple[tuple[ActionTiming, ...], ...]
    first_step: int = 0  # steps done before these (a resumed run starts after its checkpoint)
    spans: tuple[tuple[Span, ...], ...] = ()  # per step: sends, gradient sync, optimizer
    cpu: tuple[tuple[float, float], ...] = ()  # per step: its process's CPU s, its step's s
    machine: tuple[str, int] = ("", 0)  # (host name, cores) it ran on


def measured_bubble(step: Sequence[Sequence[ActionTiming]]) -> float:
    """Whole-iteration bubble of one step, given each pipeline rank's timings (busy: the
    actions' slots, compute plus the runtime's work around it)."""
    rows = [row for row in step if row]
    if not rows:
        return 0.0
    start = min(row[0].ready for row in rows)
    makespan = max(row[-1].done for row in rows) - start
    busy = sum(a.slot for row in rows for a in row)
    return 0.0 if makespan <= 0 else 1.0 - busy / (len(rows) * makespan)


def measured_costs(ranks: Sequence[RankTimings], stages: int, skip: int = 1):
    """Mean measured (F, B, W) slot seconds per stage; a BW counts as B (W = 0)."""
    samples: dict[tuple[str, int], list[float]] = {}
    for r in ranks:
        steps = r.steps[steady_steps(len(r.steps), skip).start:]
        for actions in steps:
            for a in actions:
                op = "B" if a.op == "BW" else a.op
                samples.setdefault((op, a.stage), []).append(a.slot)
    return tuple(tuple(mean(samples.get((op, s), [0.0])) for op in ("F", "B", "W"))
                 for s in range(stages))


def measured_latency(pipeline: Sequence[RankTimings], schedule) -> float:
    """Mean point-to-point latency: from the end of the slot of the action producing a
    value on one rank to the start of the slot of the action consuming it on another
    (when it stopped being blocked), counted only where the consumer was already
    blocked waiting (so its own lateness is not included); 0 when the value was there
    before the producer had finished its own bookkeeping. The mean, like the op times:
    the simulator charges it on every transfer, so only the mean adds up to the delay
    the transfers cause together (most arrive at once, a few stall for milliseconds;
    a median would say 0)."""
    samples = []
    for step in range(len(pipeline[0].steps)):
        end = {(a.op, a.stage, a.microbatch): a.done for r in pipeline for a in r.steps[step]}
        for r in pipeline:
            for a in r.steps[step]:
                done = producer_done(a, end, schedule)
                if done is not None and a.recv_wait > 0 and a.ready - a.recv_wait <= done:
                    samples.append(max(0.0, a.ready - done))
    return mean(samples) if samples else 0.0


def producer_done(a: ActionTiming, end: dict, schedule) -> Optional[float]:
    """When the action on another rank that produced `a`'s input finished (`end`: (op, stage,
    microbatch) -> done); None when `a` takes none from another rank (a first F, a last
    stage's backward, a hand-over in memory between two stages of one rank)."""
    if a.op == "F" and a.stage > 0:
        producers = [("F", a.stage - 1, a.microbatch)]
    elif a.op in ("B", "BW") and a.stage + 1 < schedule.stages:
        producers = [(op, a.stage + 1, a.microbatch) for op in ("B", "BW")]
    else:
        return None
    if schedule.stage_to_rank[producers[0][1]] == schedule.stage_to_rank[a.stage]:
        return None
    done = [end[p] for p in producers if p in end]
    return done[0] if done else None


def steady_steps(n: int, warmup: int = 1) -> range:
    """The steady-state steps of `n` measured ones: after `warmup` (at least one is kept)."""
    return range(min(warmup, n - 1) if n > 0 else 0, n)


@dataclass(frozen=True)
class BubbleCheck:
    """Measured vs predicted whole-iteration bubble of a run's pipeline (dp 0, tp 0)."""

    measured: float  # median over the steady-state steps
    per_step: tuple[float, ...]  # every measured step's bubble
    steps: tuple[int, ...]  # the steady-state steps the median is over (1-based)
    predicted: float
    source: str  # what the prediction simulated
    planned: object  # the simulation (schedules.SimResult, seconds): the trace's planned track
    # the schedule replayed with each steady step's own measured slots and transfer delays
    # (median step): what the plan's order alone makes of this run's times (None: not run)
    replayed: Optional[float] = None


def check_bubble(schedule, ranks: Sequence[RankTimings], planned=None,
                 planned_source: str = "", warmup: int = 1) -> BubbleCheck:
    """`planned`: the compiler's simulation under the plan's profile; without it the schedule
    is simulated with this run's measured mean per-op costs and mean p2p latency."""
    from ...schedules.costs import Costs
    from ...schedules.simulate import simulate

    pipeline = sorted((r for r in ranks if r.dp == 0 and r.tp == 0), key=lambda r: r.pp)
    n = len(pipeline[0].steps)
    per_step = tuple(measured_bubble([r.steps[k] for r in pipeline]) for k in range(n))
    steady = steady_steps(n, warmup)
    replay = None
    if planned is None:
        from ...compiler.estimate.profile import replay_steps
        latency = measured_latency(pipeline, schedule)
        costs = Costs(per_stage=measured_costs(pipeline, schedule.stages,
                                               warmup), latency=latency)
        planned = simulate(schedule, costs)
        planned_source = (f"this run's measured mean per-op costs and p2p latency "
                          f"({latency * 1e3:.2f} ms)")
        replay = replay_steps([step_sample(k + 1, schedule, pipeline, k) for k in steady],
                              schedule, costs)[0].bubble
    first = pipeline[0].first_step
    return BubbleCheck(median([per_step[k] for k in steady]), per_step,
                       tuple(first + k + 1 for k in steady), planned.bubble, planned_source,
                       planned, replay)


def bubble_report(schedule, ranks: Sequence[RankTimings], planned=None,
                  planned_source: str = "") -> str:
    return format_bubble(check_bubble(schedule, ranks, planned, planned_source))


def format_bubble(c: BubbleCheck) -> str:
    """'measured bubble X (median of steps a-b), predicted Y by simulating ...'."""
    where = (f"step {c.steps[0]}" if len(c.steps) == 1 else
             f"median of steps {c.steps[0]}-{c.steps[-1]}")
    replay = ("" if c.replayed is None else
              f"; {c.replayed:.3f} replaying each step's own measured op times and transfer "
              f"delays")
    return (f"bubble (whole iteration, 1 - busy/(ranks x makespan), busy = action slots): "
            f"measured {c.measured:.3f} "
            f"({where}), predicted {c.predicted:.3f} by simulating the schedule with "
            f"{c.source}{replay}")


def step_sample(step: int, schedule, pipeline: Sequence[RankTimings], k: int) -> StepSample:
    """One step's slots per stage, op and microbatch, and its own mean p2p latency."""
    m = schedule.microbatches
    table = [{op: [None] * m for op in OPS} for _ in range(schedule.stages)]
    delays = [{op: [None] * m for op in OPS} for _ in range(schedule.stages)]
    done = {(a.op, a.stage, a.microbatch): a.done for r in pipeline for a in r.steps[k]}
    for r in pipeline:
        for a in r.steps[k]:
            table[a.stage][a.op][a.microbatch] = a.slot
            # its input's delay from another rank: producer's end to the moment the
            # consumer, blocked on it, got it; 0 when not blocked or taken from none
            produced = producer_done(a, done, schedule)
            delays[a.stage][a.op][a.microbatch] = (max(0.0, a.ready - produced) if produced
                                                   is not None and a.recv_wait > 0 else 0.0)
    one = [RankTimings(r.rank, r.pp, r.dp, r.tp, (r.steps[k],)) for r in pipeline]
    return StepSample(step, measured_latency(one, schedule), _lists(table), _lists(delays))


def _lists(table) -> tuple[dict, ...]:
    return tuple({op: None if all(t is None for t in times) else tuple(t or 0.0 for t in times)
                  for op, times in per.items()} for per in table)


def machine() -> tuple[str, int]:
    """(host name, cores) of this process's machine, for `cpu_lines`."""
    return socket.gethostname(), os.cpu_count() or 1


def cpu_lines(ranks: Sequence[RankTimings], warmup: int = 1) -> list[str]:
    """Per machine, how much of its cores the ranks on it took per step (median over the
    steady steps): their processes' CPU seconds (all threads: their own and gloo's), of
    which the action slots' own threads, over the cores x the step's wall time. Ranks
    sharing a machine's cores finish no step sooner than their CPU seconds over the cores
    (the time model's floor: compiler/estimate/predict.shared_floor), so a share near 1
    says the step was bound by the cores."""
    lines, hosts = [], {}
    for r in ranks:
        if r.cpu and r.machine[1] > 0:
            hosts.setdefault(r.machine, []).append(r)
    for (host, cores), group in sorted(hosts.items()):
        n = min(len(r.cpu) for r in group)
        steady = steady_steps(n, warmup)
        if not steady:
            continue
        total = median(sum(r.cpu[k][0] for r in group) for k in steady)
        slots = median(sum(a.cpu for r in group for a in r.steps[k] if a.cpu >= 0)
                       for k in steady)
        wall = median(max(r.cpu[k][1] for r in group) for k in steady)
        share = total / (cores * wall) if wall > 0 else 0.0
        first = group[0].first_step
        lines.append(f"CPU on {host} ({len(group)} ranks, {cores} cores), median of steps "
                     f"{first + steady[0] + 1}-{first + steady[-1] + 1}: the ranks' processes "
                     f"{total * 1e3:.1f} ms per step ({slots * 1e3:.1f} ms in their action "
                     f"slots' own threads), the step {wall * 1e3:.1f} ms: the cores busy "
                     f"{share:.2f} of it")
    return lines
