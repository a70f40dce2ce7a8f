"""The measured Chrome/Perfetto trace: the plan's layout plus everything real, and the plan.

Per rank (pid = global rank) four lanes: "compute" (one "X" slice per action,
named like the IR prints it, "F0.3" = F of stage 0, microbatch 3, as the schedule
engine's trace names them), "p2p" (the wait blocked on each action's receive,
and each send being posted, and the step's sends completing), "sync &
optimizer" (a stage's gradient sync when its last W/BW is done, the end-of-step
sync, the gradient norm, the loss all-reduce, the optimizer step) and "runtime"
(the rest of each action's slot outside its compute: posting the next receive
before it, posting its sends and leaving its checks after it; the simulator
charges the whole slot, see observe.py). Times are µs from the first action of
the run (Chrome's unit).

With `planned` (the simulator's timeline, costs in seconds) each pipeline
rank gets a second process, "planned pp rank R" (pid PLANNED_PID + R), holding
the planned timeline of every step, aligned with the step's first slot, so
Perfetto shows the measured and the planned rows one above the other. With
`predicted` (the time model's timeline, what `pipeplan check` predicted) a third,
"predicted pp rank R" (pid PREDICTED_PID + R): where the two differ, the plan's
costs (planned: this run's measured means) and the model's part.
"""
from __future__ import annotations

import json
from typing import Sequence

PLANNED_PID = 1000  # pid of pipeline rank 0's planned timeline
PREDICTED_PID = 2000  # ... and of its predicted one
_LANES = {0: "compute", 1: "p2p (receive waits, sends)", 2: "sync & optimizer",
          3: "runtime (an action's slot outside its compute)"}
_LANE_OF = {"send": 1, "send wait": 1, "grad sync": 2, "optimizer": 2}
US = 1e6  # µs per second


def chrome_trace(ranks: Sequence, planned=None, predicted=None) -> dict:
    """Every rank's measured timeline (observe.RankTimings), plus `planned` and `predicted`
    (SimResults in seconds) as a second and third track per pipeline rank."""
    t0 = min((a.ready - a.recv_wait for r in ranks for s in r.steps for a in s), default=0.0)
    events = []
    for r in ranks:
        events.append({"name": "process_name", "ph": "M", "pid": r.rank,
                       "args": {"name": f"rank {r.rank} (pp {r.pp}, dp {r.dp}, tp {r.tp})"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": r.rank,
                       "args": {"sort_index": 2 * r.pp * 1000 + r.rank}})
        events += [{"name": "thread_name", "ph": "M", "pid": r.rank, "tid": tid,
                    "args": {"name": name}} for tid, name in _LANES.items()]
        for step, actions in enumerate(r.steps):
            n = r.first_step + step + 1
            for a in actions:
                name = f"{a.op}{a.stage}.{a.microbatch}"
                args = {"op": a.op, "stage": a.stage, "microbatch": a.microbatch, "step": n}
                events.append(_slice(name, a.op, r.rank, 0, a.start - t0, a.end - a.start, args))
                if a.recv_wait > 0:
                    events.append(_slice(f"wait {name}", "recv wait", r.rank, 1,
                                         a.ready - a.recv_wait - t0, a.recv_wait, args))
                for lo, hi in ((a.ready, a.start), (a.end, a.done)):  # the slot around compute
                    if hi > lo:
                        events.append(_slice(f"runtime {name}", "runtime", r.rank, 3,
                                             lo - t0, hi - lo, args))
            for sp in (r.spans[step] if step < len(r.spans) else ()):
                events.append(_slice(sp.name, sp.kind, r.rank, _LANE_OF.get(sp.kind, 2),
                                     sp.start - t0, sp.end - sp.start, {"step": n}))
    if planned is not None:
        events += _planned(ranks, planned, t0, PLANNED_PID, "planned")
    if predicted is not None:
        events += _planned(ranks, predicted, t0, PREDICTED_PID, "predicted")
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _slice(name: str, cat: str, pid: int, tid: int, ts_s: float, dur_s: float, args: dict):
    return {"name": name, "cat": cat, "ph": "X", "pid": pid, "tid": tid,
            **on_ns_grid(ts_s * US, (ts_s + dur_s) * US), "args": args}


def on_ns_grid(start_us: float, end_us: float) -> dict:
    """ts and dur in µs rounded to whole ns, so a slice ending where the next one starts
    does not overlap it by a rounding error (Perfetto nests slices by their ns times)."""
    a, b = round(start_us * 1000), round(end_us * 1000)
    return {"ts": a / 1000, "dur": (b - a) / 1000}


def _planned(ranks: Sequence, planned, t0: float, pid_offset: int, label: str) -> list:
    """A simulated timeline once per measured step of pipeline 0 (dp 0, tp 0), each slice
    tagged with its step, on pids `pid_offset` + pp rank named "`label` pp rank R". A
    step's plan that outlasts the measured step would overlap the next step's plan on one
    track (which Perfetto cannot nest): such a step goes on the first lane of its rank
    that is free by then (lane 0 `label`, then "`label` 2: a step whose plan overlaps the
    one before")."""
    from ...schedules.render import SECONDS, chrome_trace as planned_trace

    pipeline = sorted((r for r in ranks if r.dp == 0 and r.tp == 0), key=lambda r: r.pp)
    events, free = [], {}  # free: pid -> each lane's end (µs)
    for step in range(min((len(r.steps) for r in pipeline), default=0)):
        starts = [r.steps[step][0].ready for r in pipeline if r.steps[step]]
        if not starts:
            continue
        n = pipeline[0].first_step + step + 1
        trace = planned_trace(planned, SECONDS, pid_offset=pid_offset,
                              t0_us=(min(starts) - t0) * US, label=f"{label} pp rank")
        lane = {}
        for pid in {e["pid"] for e in trace["traceEvents"] if e["ph"] == "X"}:
            mine = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == pid]
            begin, end = min(e["ts"] for e in mine), max(e["ts"] + e["dur"] for e in mine)
            ends = free.setdefault(pid, [])
            lane[pid] = next((k for k, e in enumerate(ends) if e <= begin), len(ends))
            ends[lane[pid]:lane[pid] + 1] = [end]
        for e in trace["traceEvents"]:
            if e["ph"] == "M":
                continue
            if "tid" in e:
                e["tid"] = lane.get(e["pid"], 0)
            if e["ph"] == "X":
                e["args"]["step"] = n
                e.update(on_ns_grid(e["ts"], e["ts"] + e["dur"]))
            events.append(e)
    for pid, ends in sorted(free.items()):
        events.append({"name": "process_name", "ph": "M", "pid": pid,
                       "args": {"name": f"{label} pp rank {pid - pid_offset}"}})
        events += [{"name": "thread_name", "ph": "M", "pid": pid, "tid": k,
                    "args": {"name": label if k == 0 else
                             f"{label} {k + 1}: a step whose plan overlaps the one before"}}
                   for k in range(len(ends))]
    for r in pipeline:  # below the pipeline rank's measured rows, planned then predicted
        events.append({"name": "process_sort_index", "ph": "M", "pid": pid_offset + r.pp,
                       "args": {"sort_index": 2 * r.pp * 1000 + 999 + pid_offset // 1000}})
    return events


def write_trace(path: str, ranks: Sequence, planned=None, predicted=None) -> None:
    with open(path, "w") as f:
        json.dump(chrome_trace(ranks, planned, predicted), f)
