"""What a run shows: rank 0's progress line, JSONL metrics, the measured Chrome trace, the bubble.

The trace has the schedule engine's layout (schedules/render.py: a process
per rank with a "compute" thread, one "X" event per action named like the
IR prints it, "F0.3" = F of stage 0, microbatch 3, with op/stage/microbatch
args, times in µs), so a planned and a measured timeline of the same
schedule overlay in Perfetto.

Bubbles are whole-iteration (1 - sum busy / (ranks * makespan)), measured on
one step of the pipeline at dp=0, tp=0, and predicted by simulating the schedule
with the measured mean per-op costs of each stage and the measured median
point-to-point latency.
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from statistics import mean, median
from typing import Optional, Sequence, TextIO

from .executor import ActionTiming
from .trainer import StepReport


@dataclass(frozen=True)
class RankTimings:
    """Everything one rank measured: its coordinates and per-step action timings."""

    rank: int
    pp: int
    dp: int
    tp: int
    steps: tuple[tuple[ActionTiming, ...], ...]
    first_step: int = 0  # steps done before these (a resumed run starts after its checkpoint)


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
    """Rank 0's per-step line on stdout and, optionally, one JSON object per step."""

    def __init__(self, total_steps: int, metrics_path: Optional[str] = None,
                 stream: TextIO = sys.stdout, append: bool = False, resumed_after: int = 0):
        """`append`: continue the metrics file of a resumed run; the rows it holds for
        steps after `resumed_after` (written after the checkpoint the run resumes from,
        and about to be trained again) are dropped so no step appears twice."""
        self.total = total_steps
        self.stream = stream
        if metrics_path and append:
            _keep_rows_through(metrics_path, resumed_after)
        self.metrics = open(metrics_path, "a" if append else "w") if metrics_path else None

    def step(self, r: StepReport) -> None:
        tps = r.tokens / r.step_time if r.step_time > 0 else 0.0
        width = len(str(self.total))
        print(f"step {r.step + 1:>{width}}/{self.total}  loss {r.loss:.4f}  lr {r.lr:.2e}  "
              f"grad_norm {r.grad_norm:.3f}  {tps:,.0f} tok/s  {r.step_time * 1e3:.0f} ms",
              file=self.stream, flush=True)
        if self.metrics:
            self.metrics.write(json.dumps({
                "step": r.step + 1, "loss": r.loss, "lr": r.lr, "grad_norm": r.grad_norm,
                "tokens_per_s": tps, "step_time_s": r.step_time, "tokens": r.tokens}) + "\n")
            self.metrics.flush()

    def close(self) -> None:
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


def chrome_trace(ranks: Sequence[RankTimings]) -> dict:
    """Measured per-action timeline of every rank, all steps, µs from the first action."""
    t0 = min((a.start for r in ranks for s in r.steps for a in s), default=0.0)
    events = []
    for r in ranks:
        events.append({"name": "process_name", "ph": "M", "pid": r.rank,
                       "args": {"name": f"rank {r.rank} (pp {r.pp}, dp {r.dp}, tp {r.tp})"}})
        events.append({"name": "thread_name", "ph": "M", "pid": r.rank, "tid": 0,
                       "args": {"name": "compute"}})
        for step, actions in enumerate(r.steps):
            for a in actions:
                events.append({
                    "name": f"{a.op}{a.stage}.{a.microbatch}", "cat": a.op, "ph": "X",
                    "pid": r.rank, "tid": 0, "ts": (a.start - t0) * 1e6,
                    "dur": (a.end - a.start) * 1e6,
                    "args": {"op": a.op, "stage": a.stage, "microbatch": a.microbatch,
                             "step": step + 1, "recv_wait_us": a.recv_wait * 1e6}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def measured_bubble(step: Sequence[Sequence[ActionTiming]]) -> float:
    """Whole-iteration bubble of one step, given each pipeline rank's timings."""
    rows = [row for row in step if row]
    if not rows:
        return 0.0
    start = min(row[0].start for row in rows)
    makespan = max(row[-1].end for row in rows) - start
    busy = sum(a.end - a.start for row in rows for a in row)
    return 0.0 if makespan <= 0 else 1.0 - busy / (len(rows) * makespan)


def measured_costs(ranks: Sequence[RankTimings], stages: int, skip_first: bool = True):
    """Mean measured (F, B, W) seconds per stage; a BW counts as B (W = 0)."""
    samples: dict[tuple[str, int], list[float]] = {}
    for r in ranks:
        steps = r.steps[1:] if skip_first and len(r.steps) > 1 else r.steps
        for actions in steps:
            for a in actions:
                op = "B" if a.op == "BW" else a.op
                samples.setdefault((op, a.stage), []).append(a.end - a.start)
    return tuple(tuple(mean(samples.get((op, s), [0.0])) for op in ("F", "B", "W"))
                 for s in range(stages))


def measured_latency(pipeline: Sequence[RankTimings], schedule) -> float:
    """Median point-to-point latency: from the end of the action producing a value on one
    rank to the start of the action consuming it on another, counted only where the
    consumer was already blocked waiting (so its own lateness is not included)."""
    samples = []
    for step in range(len(pipeline[0].steps)):
        end = {(a.op, a.stage, a.microbatch): a.end for r in pipeline for a in r.steps[step]}
        for r in pipeline:
            for a in r.steps[step]:
                if a.op == "F" and a.stage > 0:
                    producers = [("F", a.stage - 1, a.microbatch)]
                elif a.op in ("B", "BW") and a.stage + 1 < schedule.stages:
                    producers = [(op, a.stage + 1, a.microbatch) for op in ("B", "BW")]
                else:
                    continue
                if schedule.stage_to_rank[producers[0][1]] == schedule.stage_to_rank[a.stage]:
                    continue  # a hand-over in memory
                done = [end[p] for p in producers if p in end]
                if done and a.recv_wait > 0 and a.start - a.recv_wait <= done[0]:
                    samples.append(max(0.0, a.start - done[0]))
    return median(samples) if samples else 0.0


def bubble_report(schedule, ranks: Sequence[RankTimings]) -> str:
    """'measured bubble X (step N) vs Y predicted from measured per-op costs and latency'."""
    from ..schedules.costs import Costs
    from ..schedules.simulate import simulate

    pipeline = sorted((r for r in ranks if r.dp == 0 and r.tp == 0), key=lambda r: r.pp)
    last = len(pipeline[0].steps) - 1
    measured = measured_bubble([r.steps[last] for r in pipeline])
    latency = measured_latency(pipeline, schedule)
    costs = Costs(per_stage=measured_costs(pipeline, schedule.stages), latency=latency)
    predicted = simulate(schedule, costs).bubble
    return (f"bubble (whole iteration, 1 - busy/(ranks x makespan)): measured {measured:.3f} "
            f"on step {pipeline[0].first_step + last + 1}, predicted {predicted:.3f} by simulating the schedule with "
            f"the measured mean per-op costs and p2p latency ({latency * 1e3:.2f} ms)")


def write_trace(path: str, ranks: Sequence[RankTimings]) -> None:
    with open(path, "w") as f:
        json.dump(chrome_trace(ranks), f)

