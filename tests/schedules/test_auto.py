"""auto against references that share no code with it: torch's own ZBV order (timed as torch runs
it, receives matched by tag), the issue's closed-form optimum, and exhaustive search on tiny cases.

    python -m pytest -q -s tests/schedules/test_auto.py -k torch   # prints the table
"""
import itertools

import pytest
import torch.distributed.pipelining.schedules as ts

from pipeplan.schedules import (Action, Costs, Schedule, ScheduleError, generate, schedule_from_csv, simulate, verify)
from pipeplan.schedules.bound import makespan_bound
from pipeplan.schedules.gen_auto import auto_bound
from pipeplan.schedules.gen_search import search
from pipeplan.schedules.ir import loop_placement, v_placement
from pipeplan.schedules.memory import peak_per_rank

from .test_torch_interop import torch_csv

P, M = 4, 8
SETTINGS = {"F=1,B=1,W=1": Costs(), "F=1,B=1.5,W=0.5": Costs(1, 1.5, 0.5),
            "F=1,B=1,W=1,c=0.1": Costs(latency=0.1), "F=1,B=2,W=1": Costs(1, 2, 1)}


def v_optimum(p: int, m: int, c: Costs) -> float:
    """The issue's memory-aware bound for a V at uniform costs, m >= p, memory p, freed at W."""
    F, B, W, lat = c.F, c.B, c.W, c.latency
    return (m * (F + B + W) + (p - 1) * max(F / 2 + lat, B / 2 + 3 * lat)
            + max(0, (p - 1) * (B / 2 + lat) + W / 2 - p * W))


@pytest.mark.parametrize("name", list(SETTINGS))
def test_auto_beats_torch_zbv_and_reaches_the_optimum(name):
    costs, limit = SETTINGS[name], float(P)
    s = generate("auto", P, M, costs=costs, memory_limit=limit)
    verify(s, memory_limit=limit)  # activations counted until W
    assert max(peak_per_rank(s)[0]) <= limit
    r = simulate(s, costs)
    torch_zbv = simulate(schedule_from_csv(torch_csv(ts.ScheduleZBVZeroBubble)), costs, in_order=False)
    assert max(torch_zbv.peak_activations) == limit  # same memory as auto is given
    optimum = 1 - sum(r.busy) / (P * v_optimum(P, M, costs))
    print(f"\n{name:20} auto {r.bubble:.4f}  torch ZBV {torch_zbv.bubble:.4f}  optimum {optimum:.4f}  [{s.name}]")
    assert r.bubble <= torch_zbv.bubble + 1e-9
    assert optimum - 1e-9 <= r.bubble <= optimum + 0.005


def test_stage_costs_make_auto_leave_the_v():
    """Heavy first and last stage: the V puts both on rank 0 (0.375 at best); a loop spreads them."""
    table = [(0.5, 0.5, 0.5)] * (2 * P)
    table[0] = table[-1] = (1.0, 1.0, 1.0)
    costs = Costs(per_stage=tuple(table))
    s = generate("auto", P, M, costs=costs, memory_limit=P)
    assert s.stage_to_rank == loop_placement(P, 2)
    assert simulate(s, costs).bubble <= 0.236
    v = v_placement(P)
    assert 1 - sum(simulate(s, costs).busy) / (P * makespan_bound(v, M, costs.stage_table(v), P)) >= 0.375 - 1e-9


def rank_orders(actions, before):
    """Every order of one rank's actions that runs each after its same-rank prerequisites."""
    if not actions:
        yield ()
        return
    for a in actions:
        if not any(b in actions for b in before[a]):
            rest = [x for x in actions if x != a]
            for tail in rank_orders(rest, before):
                yield (a,) + tail


def exhaustive(placement, m: int, costs: Costs, limit):
    """The shortest makespan over every split-backward order of every rank (brute force)."""
    S, p = len(placement), max(placement) + 1
    acts = [Action(op, s, mb) for s in range(S) for mb in range(m) for op in "FBW"]
    before = {a: [] for a in acts}
    for a in acts:
        s, mb = a.stage, a.microbatch
        need = {"F": [("F", s - 1)], "B": [("F", s), ("B", s + 1)], "W": [("B", s)]}[a.op]
        before[a] = [Action(op, t, mb) for op, t in need if 0 <= t < S and placement[t] == placement[s]]
    per_rank = [list(rank_orders([a for a in acts if placement[a.stage] == r], before)) for r in range(p)]
    best = float("inf")
    for order in itertools.product(*per_rank):
        sched = Schedule("x", p, S, m, tuple(placement), order)
        try:
            verify(sched, memory_limit=limit)
        except ScheduleError:
            continue
        best = min(best, simulate(sched, costs).makespan)
    return best


TINY = [  # (ranks, microbatches, virtual, placements auto searches, costs, memory limit)
    (2, 2, 1, [loop_placement(2, 1)], Costs(1, 1.5, 0.5, latency=0.1), None),
    (2, 2, 1, [loop_placement(2, 1)], Costs(1, 2, 1), 1.0),
    (2, 1, 2, [v_placement(2), loop_placement(2, 2)], Costs(1, 1, 1, latency=0.2), None),
    (2, 1, 2, [v_placement(2), loop_placement(2, 2)], Costs(2, 1, 0.5), 1.0),
]


@pytest.mark.parametrize("p,m,v,placements,costs,limit", TINY)
def test_auto_finds_the_exhaustive_optimum_and_the_bound_holds(p, m, v, placements, costs, limit):
    optima = [exhaustive(pl, m, costs, limit) for pl in placements]
    for pl, opt in zip(placements, optima):  # no order of any rank beats the bound
        assert makespan_bound(pl, m, costs.stage_table(pl), limit) <= opt + 1e-9
    assert auto_bound(p, m, v, costs, limit) <= min(optima) + 1e-9
    s = generate("auto", p, m, virtual=v, costs=costs, memory_limit=limit)
    assert simulate(s, costs).makespan == pytest.approx(min(optima))


def test_auto_respects_a_tight_memory_limit():
    s = generate("auto", P, M, costs=Costs(1, 1.5, 0.5), memory_limit=2)
    assert max(simulate(s).peak_activations) <= 2


def test_auto_respects_requested_virtual_stages():
    assert generate("auto", P, M, virtual=1).stages == P
    assert generate("auto", P, M, virtual=2).stages == 2 * P
    with pytest.raises(ScheduleError, match="per-stage costs list 5 stages"):
        generate("auto", P, M, costs=Costs(per_stage=((1, 1, 1),) * 5))


def test_local_search_keeps_a_verified_schedule_and_shortens_it():
    from pipeplan.schedules.fifo_repair import delay_senders
    from pipeplan.schedules.gen_zero_bubble import zbv_tagged

    costs = Costs(latency=0.1)
    start = delay_senders(zbv_tagged(P, M))  # torch's order, senders put in channel order: p units
    verify(start, memory_limit=P)
    polished = search(start, costs, float(P), evaluations=2000)
    verify(polished, memory_limit=P)
    assert simulate(polished, costs).makespan < simulate(start, costs).makespan


def test_auto_is_a_pure_function_of_its_inputs():
    costs = Costs(1, 2, 1, latency=0.1)  # the search runs (no candidate reaches the bound)
    assert generate("auto", 3, 6, costs=costs, memory_limit=3).order == \
        generate("auto", 3, 6, costs=costs, memory_limit=3).order


@pytest.mark.parametrize("kind,virtual", [("1f1b", None), ("zbh1", None), ("zbv", 2),
                                          ("interleaved", 2)])
def test_the_local_searchs_resumed_timing_equals_a_full_pass_and_the_simulator(kind, virtual):
    """After each random valid move the walk times the order from where the move took effect
    (_Problem._time's `since`): the same start and end of every action as a full pass, and the
    makespan simulate.py (no shared code) gives the moved schedule."""
    import random

    from pipeplan.schedules.gen_search import _Problem

    rng = random.Random(7)
    s = generate(kind, 4, 8, virtual=virtual)
    costs = Costs(per_stage=tuple((rng.uniform(0.5, 2), rng.uniform(0.5, 2), rng.uniform(0.2, 1))
                                  for _ in range(s.stages)), latency=0.1)
    prob = _Problem(s, costs)
    rows = prob.encode(s)
    _, start, end = prob._time(rows)
    moved = 0
    for _ in range(1500):
        r = rng.randrange(len(rows))
        i = rng.randrange(len(rows[r]))
        j = max(0, min(len(rows[r]) - 1, i + rng.randint(-8, 8)))
        if i == j or not prob.move_valid(rows[r], i, j, None):
            continue
        rows[r].insert(j, rows[r].pop(i))
        full, resumed = prob._time(rows), prob._time(rows, (r, min(i, j), max(i, j), start, end))
        assert (full is None) == (resumed is None)
        if full is None:  # a deadlock: undo
            rows[r].insert(i, rows[r].pop(j))
            continue
        moved += 1
        assert resumed == full
        assert resumed[0][0] == pytest.approx(simulate(prob.decode(rows, kind), costs).makespan, abs=1e-9)
        _, start, end = full
    assert moved >= 40
