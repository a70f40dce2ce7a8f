"""The simulator: timing semantics, bounds, idle attribution, critical path."""
import dataclasses

import pytest

from pipeplan.schedules import Action, Costs, Schedule, generate, simulate


def test_uniform_costs_are_per_rank_share():
    # v=2: each stage op costs half, so interleaved and 1f1b do equal work per rank.
    a, b = simulate(generate("1f1b", 4, 8)), simulate(generate("interleaved", 4, 8))
    assert a.busy == b.busy == (24.0,) * 4


def test_latency_only_on_cross_rank_edges():
    s = Schedule("v1", 1, 2, 1, (0, 0), ((Action("F", 0, 0), Action("F", 1, 0), Action("BW", 1, 0),
                                          Action("BW", 0, 0)),))
    assert simulate(s, Costs(latency=5)).makespan == pytest.approx(3.0)  # all on one rank
    two = generate("gpipe", 2, 1)
    assert simulate(two, Costs(latency=0.5)).makespan == pytest.approx(6.0 + 2 * 0.5)


def test_per_stage_costs_are_absolute():
    s = generate("gpipe", 2, 1)
    r = simulate(s, Costs(per_stage=((2, 1, 1), (1, 1, 1))))
    assert r.busy == (4.0, 3.0)
    assert r.makespan == pytest.approx(2 + 1 + 2 + 2)


def test_a_split_backward_costs_its_w_more_and_the_fused_one_nothing():
    """Costs.split: what a separate W adds on the host is charged to every W of its stage
    and never to BW, and the bound (no schedule is shorter) leaves it out."""
    from pipeplan.schedules.errors import ScheduleError
    split = Costs(per_stage=((1, 1, 1), (1, 1, 1)), split=(0.5, 0.25))
    zb = generate("zbh1", 2, 2)
    plain = simulate(zb, Costs(per_stage=split.per_stage))
    added = simulate(zb, split)
    assert sum(added.busy) - sum(plain.busy) == pytest.approx(2 * 0.5 + 2 * 0.25)
    assert added.busy[0] - plain.busy[0] == pytest.approx(2 * 0.5)  # stage 0 on rank 0
    fused = generate("1f1b", 2, 2)
    assert simulate(fused, split).busy == simulate(fused, Costs(per_stage=split.per_stage)).busy
    assert added.lower_bound == pytest.approx(plain.lower_bound)
    with pytest.raises(ScheduleError, match="split"):
        Costs(split=(0.5,))


def test_bubble_definitions():
    r = simulate(generate("1f1b", 4, 8))
    assert r.bubble == pytest.approx(1 - sum(r.busy) / (4 * r.makespan))
    spans = [row_e[-1] - row_s[0] for row_s, row_e in zip(r.start, r.end)]
    assert r.span_bubble == pytest.approx(1 - sum(r.busy) / sum(spans))
    assert r.idle == tuple(r.makespan - b for b in r.busy)


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "interleaved", "zbh1", "zbh2", "zbv", "vhalf", "dualpipev"])
@pytest.mark.parametrize("costs", [Costs(), Costs(1, 1.5, 0.5), Costs(1, 2, 1, latency=0.1)])
def test_lower_bound_never_exceeds_makespan(kind, costs):
    r = simulate(generate(kind, 4, 8), costs)
    assert r.lower_bound <= r.makespan + 1e-9
    assert r.lower_bound_bubble <= r.bubble + 1e-9


def test_zbv_reaches_the_lower_bound_at_unit_costs():
    r = simulate(generate("zbv", 4, 8))
    assert r.makespan == pytest.approx(r.lower_bound)


def test_idle_attribution_accounts_for_all_idle_time():
    r = simulate(generate("1f1b", 4, 8), Costs(latency=0.1))
    for rank in range(4):
        gaps = [g for g in r.idle_attribution if g.rank == rank]
        assert sum(g.duration for g in gaps) == pytest.approx(r.idle[rank])
    first = next(g for g in r.idle_attribution if g.rank == 3)
    assert str(first) == "rank 3 idle 3.3 at t=0 waiting for F(stage 2, mb 0) on rank 2"


def test_critical_path_is_a_chain_from_time_zero_to_makespan():
    r = simulate(generate("1f1b", 4, 8))
    path = r.critical_path
    assert path[0] == (0, Action("F", 0, 0))
    assert path[-1][1] == r.schedule.order[path[-1][0]][-1]
    index = {(rank, a): i for rank, row in enumerate(r.schedule.order) for i, a in enumerate(row)}
    total = sum(r.end[rk][index[(rk, a)]] - r.start[rk][index[(rk, a)]] for rk, a in path)
    assert total == pytest.approx(r.makespan)  # no latency: the path is busy all the way


def test_peak_activations_held_until_w():
    r = simulate(generate("zbh1", 4, 8))
    assert r.peak_activations == (4.0, 4.0, 4.0, 4.0)


def test_concurrency_is_what_a_computing_rank_sees():
    """Two ranks, one action each: rank 0 computes [0, 2], rank 1 [1, 2]. From 0 to 1 one
    rank computes (k = 1), from 1 to 2 both (k = 2): sum k^2 dt / sum k dt = (1 + 4) / (1 + 2)."""
    from pipeplan.schedules.costs import Costs
    from pipeplan.schedules.simulate import SimResult
    sim = SimResult(schedule=None, costs=Costs(per_stage=((1.0, 1.0, 1.0),)), makespan=2.0,
                    bubble=0.25, span_bubble=0.0, busy=(2.0, 1.0), idle=(0.0, 1.0),
                    peak_activations=(0.0, 0.0), lower_bound=2.0, start=((0.0,), (1.0,)),
                    end=((2.0,), (2.0,)))
    assert sim.concurrency == pytest.approx(5 / 3)
    alone = SimResult(schedule=None, costs=sim.costs, makespan=2.0, bubble=0.0, span_bubble=0.0,
                      busy=(2.0,), idle=(0.0,), peak_activations=(0.0,), lower_bound=2.0,
                      start=((0.0, 1.0),), end=((1.0, 2.0),))
    assert alone.concurrency == pytest.approx(1.0)


def test_concurrency_counts_only_the_computing_share_of_an_action():
    """Costs.waiting: a rank waiting in a collective inside its action leaves the core to
    the others. One stage per rank, rank 0's F on [0, 2] all computing, rank 1's F on
    [1, 2] half waiting (its F is 1 s, 0.5 of it waiting): k = 1 on [0, 1], 1.5 on [1, 2]:
    (1 + 2.25) / (1 + 1.5). Waiting is clipped to the op's own time, needs per-stage costs."""
    from pipeplan.schedules.costs import Costs
    from pipeplan.schedules.errors import ScheduleError
    from pipeplan.schedules.simulate import SimResult
    sched = Schedule(name="custom", ranks=2, stages=2, microbatches=1,
                     stage_to_rank=(0, 1), order=((Action("F", 0, 0),), (Action("F", 1, 0),)))
    costs = Costs(per_stage=((2.0, 0.0, 0.0), (1.0, 0.0, 0.0)),
                  waiting=((0.0, 0.0, 0.0), (0.5, 9.0, 0.0)))
    assert costs.waiting[1] == (0.5, 0.0, 0.0)  # clipped: B costs nothing here
    sim = SimResult(schedule=sched, costs=costs, makespan=2.0, bubble=0.25, span_bubble=0.0,
                    busy=(2.0, 1.0), idle=(0.0, 1.0), peak_activations=(0.0, 0.0),
                    lower_bound=2.0, start=((0.0,), (1.0,)), end=((2.0,), (2.0,)))
    assert sim.concurrency == pytest.approx(3.25 / 2.5)
    plain = dataclasses.replace(sim, costs=Costs(per_stage=costs.per_stage))
    assert plain.concurrency == pytest.approx(5 / 3)  # waiting unknown: all computing
    with pytest.raises(ScheduleError, match="waiting"):
        Costs(waiting=((0.0, 0.0, 0.0),))


def test_held_states_give_the_peaks_held_peaks_walks():
    """The planner's memory bound reads one walk of an order for many candidates' bytes
    (memory.held_states / peaks_of): the same peaks as walking the order each time, for
    every fixed kind, with whole and fractional amounts."""
    import random
    from pipeplan.schedules import generate
    from pipeplan.schedules.kinds import FIXED_KINDS, KINDS_TABLE
    from pipeplan.schedules.memory import held_peaks, held_states, peaks_of
    rng = random.Random(0)
    for kind in FIXED_KINDS:
        for p, m in ((2, 4), (3, 7), (4, 8)):
            for v in (1, 2, 3):
                if not KINDS_TABLE[kind].allows(v):
                    continue
                try:
                    schedule = generate(kind, ranks=p, microbatches=m, virtual=v)
                except Exception:
                    continue  # a combination the kind refuses
                states = held_states(schedule)
                for _ in range(5):
                    whole = [float(rng.randint(0, 10 ** 9)) for _ in range(p * v)]
                    assert peaks_of(states, whole) == held_peaks(schedule, whole)[0]
                    part = [rng.random() for _ in range(p * v)]
                    assert peaks_of(states, part) == pytest.approx(
                        held_peaks(schedule, part)[0], rel=1e-12)
