"""The makespan lower bound (bound.py) holds for every schedule: generated, searched or random."""
import random
from unittest.mock import patch

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeplan.schedules import gen_auto
from pipeplan.schedules import Action, Costs, Schedule, ScheduleError, generate, simulate, verify
from pipeplan.schedules.bound import makespan_bound
from pipeplan.schedules.ir import loop_placement, v_placement


def random_schedule(placement, m: int, rng: random.Random) -> Schedule:
    """A uniformly random run of the executor: any ready action on any rank, split or whole backward.

    Receives are taken only at the head of their rank-pair channel, so the result
    is FIFO-consistent and deadlock-free; it ignores memory (the bound is then
    checked at the schedule's own peak).
    """
    S, p = len(placement), max(placement) + 1
    done, channels = set(), {}
    order = [[] for _ in range(p)]
    split = {(s, mb): rng.random() < 0.5 for s in range(S) for mb in range(m)}
    todo = {("F", s, mb) for s in range(S) for mb in range(m)}
    todo |= {("B" if split[s, mb] else "BW", s, mb) for s in range(S) for mb in range(m)}
    todo |= {("W", s, mb) for s in range(S) for mb in range(m) if split[s, mb]}

    def source(op, s, mb):
        """(channel, message) the action receives, or None when its input is on its own rank."""
        src = s - 1 if op == "F" else s + 1
        if op == "W" or not 0 <= src < S or placement[src] == placement[s]:
            return None
        return (placement[src], placement[s]), (op == "F", src, mb)

    def ready(a):
        op, s, mb = a
        if op == "W":
            return ("B", s, mb) in done
        if op == "F":
            local = s == 0 or ("F", s - 1, mb) in done
        else:
            local = ("F", s, mb) in done and (s == S - 1 or {("B", s + 1, mb), ("BW", s + 1, mb)} & done)
        src = source(op, s, mb)
        return local and (src is None or (channels.get(src[0]) or [None])[0] == src[1])

    while todo:
        a = rng.choice(sorted(x for x in todo if ready(x)))
        todo.remove(a)
        done.add(a)
        op, s, mb = a
        src = source(op, s, mb)
        if src is not None:
            channels[src[0]].pop(0)
        for dst in ((s + 1,) if op == "F" else (s - 1,) if op in ("B", "BW") else ()):
            if 0 <= dst < S and placement[dst] != placement[s]:
                channels.setdefault((placement[s], placement[dst]), []).append((op == "F", s, mb))
        order[placement[s]].append(Action(op, s, mb))
    return Schedule("random", p, S, m, tuple(placement), tuple(map(tuple, order)))


costs_strategy = st.builds(
    lambda f, b, w, c: Costs(f, b, w, latency=c),
    st.sampled_from([0.5, 1.0, 2.0]), st.sampled_from([0.5, 1.0, 1.5, 2.0]),
    st.sampled_from([0.0, 0.5, 1.0]), st.sampled_from([0.0, 0.1, 0.5]))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(p=st.integers(1, 4), m=st.integers(1, 6), layout=st.sampled_from(["loop1", "loop2", "V"]),
       costs=costs_strategy, seed=st.integers(0, 10 ** 6), ends=st.booleans())
def test_no_random_schedule_beats_the_bound(p, m, layout, costs, seed, ends):
    placement = {"loop1": loop_placement(p, 1), "loop2": loop_placement(p, 2), "V": v_placement(p)}[layout]
    if ends:  # per-stage costs: heavy first and last stage
        table = [(costs.F, costs.B, costs.W)] * len(placement)
        table[0] = table[-1] = (3 * costs.F, 2 * costs.B, costs.W + 1)
        costs = Costs(per_stage=tuple(table), latency=costs.latency)
    s = random_schedule(placement, m, random.Random(seed))
    verify(s)
    r = simulate(s, costs)  # bound at the schedule's own peak memory
    assert r.lower_bound <= r.makespan + 1e-9, (s.order, r.lower_bound, r.makespan)


KINDS_V = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zbh1", 1), ("zbh2", 1), ("zbv", 2),
           ("vhalf", 2), ("vmin", 2), ("dualpipev", 2)]


@settings(max_examples=60, deadline=None)
@given(p=st.integers(1, 6), m=st.integers(1, 12), kind=st.sampled_from(KINDS_V), costs=costs_strategy)
def test_no_generated_schedule_beats_the_bound(p, m, kind, costs):
    try:
        s = generate(kind[0], p, m, kind[1])
    except ScheduleError:
        return  # the kind does not exist for these p, m
    r = simulate(s, costs)
    assert r.lower_bound <= r.makespan + 1e-9


@settings(max_examples=25, deadline=None)
@given(p=st.integers(2, 4), m=st.integers(2, 8), costs=costs_strategy, limit=st.sampled_from([1.0, 2.0, 3.0, 4.0]))
def test_auto_never_beats_the_bound_at_its_memory_limit(p, m, costs, limit):
    try:
        with patch.object(gen_auto, "SEARCH_WORK", 20_000):  # the bound, not the search, is under test
            s = generate("auto", p, m, costs=costs, memory_limit=limit)
    except ScheduleError:
        return
    r = simulate(s, costs, memory_limit=limit)
    assert r.lower_bound <= r.makespan + 1e-9


def test_memory_limit_adds_the_unavoidable_front_and_tail_idle():
    # V placement, B=1.5, W=0.5, p=4, m=8: rank 3 can hold 8 stage-forwards before its first
    # backward at t=6.25 (idle 0.75 besides its 1.5 head), and after its last B it has at most
    # 8 pending W (2.0) to cover a 2.5 chain (idle 0.5): 24 + 1.5 + 0.75 + 0.5.
    costs = Costs(1, 1.5, 0.5)
    placement = v_placement(4)
    table = costs.stage_table(placement)
    assert makespan_bound(placement, 8, table, 4.0) == pytest.approx(26.75)
    assert makespan_bound(placement, 8, table, None) == pytest.approx(25.5)


def test_memory_cycle_bounds_a_tight_limit_and_auto_meets_it():
    # Loop, p=4, m=8, F=B=W=1, limit 1: each microbatch holds rank 0's only slot from its F(0)
    # to its W(0), the chain F(0..3) B(3..0) W(0) = 9, so the step is at least 8 x 9 = 72 (the
    # front and tail windows alone say 8 x 3 + 3 + 0 = 27); auto's schedule takes exactly that.
    costs = Costs(1, 1, 1)
    placement = loop_placement(4, 1)
    assert makespan_bound(placement, 8, costs.stage_table(placement), 1.0) == pytest.approx(72)
    s = generate("auto", 4, 8, 1, costs=costs, memory_limit=1.0)
    assert simulate(s, costs, memory_limit=1.0).makespan == pytest.approx(72)
    # With latency 0.5 the chain crosses 6 rank edges: 8 x 12
    lat = Costs(1, 1, 1, latency=0.5)
    assert makespan_bound(placement, 8, lat.stage_table(placement), 1.0) == pytest.approx(96)
    # two lanes halve it (and the start of rank r's first F shifts its own: rank 0 binds)
    assert makespan_bound(placement, 8, costs.stage_table(placement), 2.0) == pytest.approx(36)


def test_forward_rate_limits_a_rank_behind_a_slow_stage():
    # Stage 0 costs 1 and stage 3 costs 0.5 (loop placement, 2 stages per rank): rank 3 is fed at
    # most one forward per unit of time, so it idles 3.0 before its first backward can start.
    table = [(0.5, 0.5, 0.5)] * 8
    table[0] = table[-1] = (1.0, 1.0, 1.0)
    placement = loop_placement(4, 2)
    bound = makespan_bound(placement, 8, Costs(per_stage=tuple(table)).stage_table(placement), 4.0)
    assert bound == pytest.approx(36 + 3.0)


def test_v_bound_is_at_least_the_closed_form_optimum():
    """For a V at uniform costs, m >= p and memory p (freed at W), the bound is never below the
    issue's T* = m(F+B+W) + (p-1) max(F/2+c, B/2+3c) + max(0, (p-1)(B/2+c) + W/2 - pW)."""
    for p in range(2, 9):
        for m in (p, 2 * p, 3 * p):
            for F, B, W in ((1, 1, 1), (1, 1.5, 0.5), (1, 2, 1), (2, 1, 1), (1, 1, 3), (1, 3, 0.2)):
                for c in (0.0, 0.1, 0.5):
                    t_star = (m * (F + B + W) + (p - 1) * max(F / 2 + c, B / 2 + 3 * c)
                              + max(0, (p - 1) * (B / 2 + c) + W / 2 - p * W))
                    placement = v_placement(p)
                    bound = makespan_bound(placement, m, Costs(F, B, W, c).stage_table(placement), float(p))
                    assert bound >= t_star - 1e-9, (p, m, F, B, W, c)
