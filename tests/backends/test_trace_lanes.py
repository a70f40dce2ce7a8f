"""The measured Chrome trace nests in Perfetto: within one track (pid, tid) no two slices
overlap, in whole nanoseconds (how Perfetto reads the µs times), also when the plan of a
step outlasts the measured step; every planned step is there, each action tagged with it."""
from __future__ import annotations

from collections import defaultdict

import pytest

from pipeplan.backends.observe.timings import RankTimings
from pipeplan.backends.observe.trace import PLANNED_PID, chrome_trace
from pipeplan.backends.runtime.executor import ActionTiming
from pipeplan.schedules.costs import Costs
from pipeplan.schedules.generate import generate
from pipeplan.schedules.simulate import simulate


def overlaps(events) -> list:
    """Pairs of X slices on one track that overlap (times in integer ns, as Perfetto)."""
    tracks = defaultdict(list)
    for e in events:
        if e["ph"] == "X":
            tracks[e["pid"], e["tid"]].append((round(e["ts"] * 1000),
                                               round((e["ts"] + e["dur"]) * 1000), e["name"]))
    bad = []
    for track, slices in tracks.items():
        slices.sort()
        bad += [(track, a, b) for a, b in zip(slices, slices[1:]) if b[0] < a[1]]
    return bad


def measured(steps: int, step_s: float, t0: float = 1e9 + 0.1) -> list[RankTimings]:
    """gpipe on 2 ranks, 1 microbatch: each step F0 [0, .1], F1 [.1, .2], BW1 [.2, .3],
    BW0 [.3, .4] after its start (times near the epoch's, where float rounding bites)."""
    ranks = []
    for rank, (f, b) in enumerate(((0.0, 0.3), (0.1, 0.2))):
        rows = []
        for k in range(steps):
            s = t0 + k * step_s
            rows.append((ActionTiming("F", rank, 0, s + f, s + f + 0.1, 0.0),
                         ActionTiming("BW", rank, 0, s + b, s + b + 0.1, 0.0)))
        ranks.append(RankTimings(rank, rank, 0, 0, tuple(rows)))
    return ranks


def test_a_plan_longer_than_its_step_takes_another_lane():
    schedule = generate("gpipe", ranks=2, microbatches=1)
    slow = simulate(schedule, Costs(per_stage=((0.25, 0.25, 0.0), (0.25, 0.25, 0.0))))
    assert slow.makespan > 0.4 * 2  # each step's plan outlasts the next step's start
    trace = chrome_trace(measured(3, 0.4), slow)
    events = trace["traceEvents"]
    assert overlaps(events) == []
    planned = [e for e in events if e["ph"] == "X" and e["pid"] >= PLANNED_PID]
    # every planned action of every step, tagged with its step
    assert sorted((e["pid"], e["args"]["step"], e["name"]) for e in planned) == sorted(
        (PLANNED_PID + r, k, name) for r, names in enumerate((("F0.0", "BW0.0"),
                                                               ("F1.0", "BW1.0")))
        for k in (1, 2, 3) for name in names)
    # rank 0's plan of a step spans [0, 1.0] s from the step's start: step 2 overlaps step
    # 1 (lane 1), step 3 overlaps both (lane 2); rank 1's spans [0.25, 0.75]: step 3 starts
    # after step 1's ends, so lane 0 again (the first free one)
    lanes = {(e["pid"] - PLANNED_PID, e["args"]["step"], e["tid"]) for e in planned}
    assert lanes == {(0, 1, 0), (0, 2, 1), (0, 3, 2), (1, 1, 0), (1, 2, 1), (1, 3, 0)}
    named = {(e["pid"], e["tid"]) for e in events
             if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {(e["pid"], e["tid"]) for e in planned} <= named  # every lane has a name
    flows = [e for e in events if e["ph"] in ("s", "f") and e["pid"] >= PLANNED_PID]
    assert flows and all((e["pid"], e["tid"]) in named for e in flows)


def test_a_plan_that_fits_its_step_stays_on_one_lane():
    schedule = generate("gpipe", ranks=2, microbatches=1)
    fits = simulate(schedule, Costs(per_stage=((0.1, 0.1, 0.0), (0.1, 0.1, 0.0))))
    events = chrome_trace(measured(4, 0.5), fits)["traceEvents"]
    assert overlaps(events) == []
    planned = [e for e in events if e["ph"] == "X" and e["pid"] >= PLANNED_PID]
    assert len(planned) == 4 * 4 and {e["tid"] for e in planned} == {0}
    # back to back actions (the simulator's end of one is the start of the next) touch
    ends = sorted(round((e["ts"] + e["dur"]) * 1000) for e in planned)
    starts = sorted(round(e["ts"] * 1000) for e in planned)
    assert set(ends) & set(starts)


def test_the_predicted_timeline_gets_rows_of_its_own():
    """`predicted` (the time model's timeline, what check printed) beside `planned` (this
    run's measured means): each on its own pids, named, sorted under its pipeline rank's
    measured rows, planned first; every step's actions on each."""
    from pipeplan.backends.observe.trace import PREDICTED_PID
    schedule = generate("gpipe", ranks=2, microbatches=1)
    planned = simulate(schedule, Costs(per_stage=((0.1, 0.1, 0.0), (0.1, 0.1, 0.0))))
    predicted = simulate(schedule, Costs(per_stage=((0.05, 0.1, 0.0), (0.05, 0.1, 0.0))))
    events = chrome_trace(measured(2, 0.5), planned, predicted)["traceEvents"]
    assert overlaps(events) == []
    rows = {}
    for e in events:
        if e["ph"] == "X" and e["pid"] >= PLANNED_PID:
            rows.setdefault(e["pid"], []).append((e["args"]["step"], e["name"], e["dur"]))
    assert sorted(rows) == [PLANNED_PID, PLANNED_PID + 1, PREDICTED_PID, PREDICTED_PID + 1]
    assert sorted(rows[PREDICTED_PID]) == [(k, n, pytest.approx(d * 1e6)) for k in (1, 2)
                                           for n, d in (("BW0.0", 0.1), ("F0.0", 0.05))]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names[PREDICTED_PID + 1] == "predicted pp rank 1"
    assert names[PLANNED_PID + 1] == "planned pp rank 1"
    order = {e["pid"]: e["args"]["sort_index"] for e in events
             if e["name"] == "process_sort_index"}
    assert order[0] < order[PLANNED_PID] < order[PREDICTED_PID] < order[1] \
        < order[PLANNED_PID + 1] < order[PREDICTED_PID + 1]
