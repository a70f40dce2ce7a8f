"""What a run shows: rank 0's progress (a live bar on a terminal, else one line per step),
JSONL metrics, the bubble; the measured trace is trace.py.

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

import dataclasses
import json
import os
import sys
from dataclasses import dataclass
from statistics import mean, median
from typing import Optional, Sequence, TextIO

from ..runtime.executor import ActionTiming, Span
from ..runtime.trainer import StepReport


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


def describe_run(compiled, world_size: int) -> str:
    """What is about to run, before step 1: the schedule and each rank's stages."""
    sch = compiled.schedule
    m = compiled.plan.mesh
    lines = [f"{sch.name}: {sch.stages} stages on {sch.ranks} pipeline ranks, "
             f"{sch.microbatches} microbatches per step; pp={m.pp} dp={m.dp} cp={m.cp} tp={m.tp} ep={m.ep} "
             f"({world_size} processes); captured with {compiled.capture}"]
    for r in range(sch.ranks):
        parts = [f"stage {st.index} [{', '.join(st.module_names) or '-'}]"
                 for st in compiled.stages if sch.stage_to_rank[st.index] == r]
        lines.append(f"  pipeline rank {r}: " + "; ".join(parts))
    return "\n".join(lines)


class Progress:
    """Rank 0's progress on stdout and, optionally, one JSON object per step.

    On a terminal: a live tqdm bar (step, loss, tokens/s, elapsed and ETA), each line
    above it kept as printed; otherwise (a pipe, a file, the launcher's
    prefixed output) one plain line per step, the format scripts and tests parse."""

    def __init__(self, total_steps: int, metrics_path: Optional[str] = None,
                 stream: TextIO = sys.stdout, append: bool = False, resumed_after: int = 0,
                 live: Optional[bool] = None):
        """`append`: continue the metrics file of a resumed run; the rows it holds for
        steps after `resumed_after` (written after the checkpoint the run resumes from,
        and about to be trained again) are dropped so no step appears twice. `live`: the
        bar (default: when `stream` is a terminal)."""
        self.total = total_steps
        self.stream = stream
        if metrics_path and append:
            _keep_rows_through(metrics_path, resumed_after)
        self.metrics = open(metrics_path, "a" if append else "w") if metrics_path else None
        if live is None:
            live = bool(getattr(stream, "isatty", lambda: False)())
        self.bar = None
        if live:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=resumed_after, file=stream, unit="step",
                            dynamic_ncols=True, desc="train")

    def step(self, r: StepReport) -> None:
        tps = r.tokens / r.step_time if r.step_time > 0 else 0.0
        width = len(str(self.total))
        if self.bar is not None:
            self.bar.set_postfix_str(f"loss {r.loss:.4f}  {tps:,.0f} tok/s  "
                                     f"{r.step_time * 1e3:.0f} ms/step", refresh=False)
            self.bar.update(1)
        else:  # the norm only when computed (the plan clips)
            norm = "" if r.grad_norm is None else f"grad_norm {r.grad_norm:.3f}  "
            print(f"step {r.step + 1:>{width}}/{self.total}  loss {r.loss:.4f}  lr {r.lr:.2e}  "
                  f"{norm}{tps:,.0f} tok/s  {r.step_time * 1e3:.0f} ms",
                  file=self.stream, flush=True)
        for e in r.sync_events:  # DiLoCo: island 0's syncs (rank 0's fragments)
            line = f"  island 0: {e.describe()}"
            if self.bar is not None:
                self.bar.write(line, file=self.stream)
            else:
                print(line, file=self.stream, flush=True)
        if self.metrics:
            self.metrics.write(json.dumps({
                "step": r.step + 1, "loss": r.loss, "lr": r.lr, "grad_norm": r.grad_norm,
                "tokens_per_s": tps, "step_time_s": r.step_time, "tokens": r.tokens,
                **({"sync": [dataclasses.asdict(e) for e in r.sync_events]}
                   if r.sync_events else {})}) + "\n")
            self.metrics.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.metrics:
            self.metrics.close()


def _keep_rows_through(path: str, step: int) -> None:
    """Rewrite a metrics file keeping only its rows for steps <= `step` (atomically)."""
    try:
        with open(path) as f:
            lines = f.readlines()
    except OSError:
        return
    kept = []
    for line in lines:
        try:
            row_step = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
            continue  # a row cut short by a crash
        if row_step <= step:
            kept.append(line if line.endswith("\n") else line + "\n")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(kept)
    os.replace(tmp, path)


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
        from .profiling import step_sample
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
