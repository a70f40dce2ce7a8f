"""The list scheduler's period skip (greedy_period) changes nothing but the time: runs that skip
repeated periods give, action for action, the orders of the original implementation
(test_greedy_reference's verbatim copy, which never skips) and of the same run stepped through;
the skip is refused where it could not be exact (times not on a 2^-10 grid, random jitter,
fixed sequences)."""
import itertools
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_greedy_reference import reference_list_schedule  # noqa: E402

from pipeplan.schedules import Costs, generate, simulate  # noqa: E402
from pipeplan.schedules.gen_greedy import Policy, Stall, timed_run  # noqa: E402
from pipeplan.schedules.gen_zero_bubble import vhalf_limit, vmin_limit, zbh2_limit  # noqa: E402
from pipeplan.schedules.ir import B, F, loop_placement, v_placement  # noqa: E402

KINDS = {"zbh2": (lambda p: loop_placement(p, 1), zbh2_limit),
         "vhalf": (v_placement, vhalf_limit), "vmin": (v_placement, vmin_limit)}


def same_when_stepped(placement, m, table, policy):
    """The skipping run, asserted equal to the same run stepped through; None if both stall."""
    try:
        stepped = timed_run("x", placement, m, table, policy, skip_periods=False)
    except Stall:
        with pytest.raises(Stall):
            timed_run("x", placement, m, table, policy)
        return None
    fast = timed_run("x", placement, m, table, policy)
    assert fast.rows == stepped.rows and fast.makespan == stepped.makespan
    return fast


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_fixed_kinds_skip_and_match_reference(kind):
    place, limit = KINDS[kind]
    for p, m in ((4, 40), (6, 60), (8, 96)):
        placement = place(p)
        table = Costs().stage_table(placement)
        for forward_first in (False, True):
            policy = Policy(split=True, limits=(limit(p),) * p, forward_first=forward_first)
            run = timed_run(kind, placement, m, table, policy)
            assert run.skip is not None and run.skip.copies * run.skip.shift >= m // 3  # most is skipped
            assert sum(map(len, run.simulated)) < 0.7 * 3 * len(placement) * m
            got = run.schedule()
            assert got.order == reference_list_schedule(kind, placement, m, table, policy).order
            assert run.makespan == simulate(got).makespan


def test_skip_near_the_end_of_the_supply():
    """Every m around the point where the last copy must still leave an entering microbatch."""
    skipped = 0
    for p in (2, 3, 4, 6):
        for kind, (place, limit) in KINDS.items():
            placement = place(p)
            table = Costs().stage_table(placement)
            for m in range(1, 6 * p + 3):
                for forward_first in (False, True):
                    policy = Policy(split=True, limits=(limit(p),) * p, forward_first=forward_first)
                    fast = same_when_stepped(placement, m, table, policy)
                    skipped += fast is not None and fast.skip is not None
    assert skipped > 100


@pytest.mark.parametrize("costs", [Costs(1, 1.5, 0.5), Costs(1, 2, 1, latency=0.25), "stages"])
def test_auto_policies_skip_exactly(costs):
    """The options `auto` sets, at costs on the 2^-10 grid, with enough microbatches to skip."""
    if costs == "stages":  # ragged per-stage costs, all multiples of 1/8
        costs = Costs(per_stage=tuple((1.0 + 0.25 * (s % 3), 1.5 - 0.125 * (s % 4), 0.5) for s in range(8)))
    skipped = checked = 0
    for placement in (loop_placement(4, 1), loop_placement(4, 2), v_placement(4)):
        p, m = 4, 36
        if costs.per_stage is not None and len(costs.per_stage) != len(placement):
            continue
        table = costs.stage_table(placement)
        for lim in (2.0, 4.0, 8.0):
            for split, eager, fits, ff, whole in itertools.product(*[(False, True)] * 5):
                policy = Policy(split=split, limits=(lim,) * p, eager_w=eager, w_fits_gap=fits,
                                forward_first=ff, reserve_whole=whole)
                fast = same_when_stepped(placement, m, table, policy)
                if fast is None or fast.skip is None:
                    continue
                skipped += 1
                if checked < 12:  # a few against the original as well
                    assert fast.schedule().order == reference_list_schedule("x", placement, m, table, policy).order
                    checked += 1
    assert skipped >= 20 and checked >= 4


def test_no_skip_where_it_could_not_be_exact():
    p, m, placement = 4, 40, v_placement(4)
    plain = Policy(split=True, limits=(3.0,) * p)
    assert timed_run("x", placement, m, Costs().stage_table(placement), plain).skip is not None
    for costs in (Costs(latency=0.05), Costs(1, 1.1, 0.9)):  # not multiples of 2^-10
        assert timed_run("x", placement, m, costs.stage_table(placement), plain).skip is None
    table = Costs().stage_table(placement)
    jitter = Policy(split=True, limits=(3.0,) * p, jitter=0.1, seed=1)
    assert timed_run("x", placement, m, table, jitter).skip is None
    base = timed_run("x", placement, m, table, plain).schedule()
    fwd = tuple(tuple((a.stage, a.microbatch) for a in o if a.op == F) for o in base.order)
    bwd = tuple(tuple((a.stage, a.microbatch) for a in o if a.op == B) for o in base.order)
    assert timed_run("x", placement, m, table, Policy(split=True, limits=(3.0,) * p, fwd_seq=fwd,
                                                         bwd_seq=bwd)).skip is None


def test_give_up_after_a_skip():
    for kind, (place, limit) in KINDS.items():
        placement = place(6)
        table = Costs().stage_table(placement)
        policy = Policy(split=True, limits=(limit(6),) * 6)
        full = timed_run(kind, placement, 72, table, policy)
        assert full.skip is not None
        assert timed_run(kind, placement, 72, table, policy, give_up_at=full.makespan - 0.5) is None
        assert timed_run(kind, placement, 72, table, policy, give_up_at=full.makespan + 0.5) == full


@pytest.mark.parametrize("kind", [pytest.param("vhalf", marks=pytest.mark.heavy), "vmin",
                                  pytest.param("zbh2", marks=pytest.mark.heavy)])
def test_generation_size_matches_reference(kind):
    """At the benchmark's size (p=64, m=1024) the kind is the reference's pick, action for action
    (vmin, whose period is 29 microbatches, in the default suite: ~6 s; the others -m heavy)."""
    place, limit = KINDS[kind]
    p, m = 64, 1024
    placement = place(p)
    table = Costs().stage_table(placement)
    runs = [reference_list_schedule(kind, placement, m, table,
                                    Policy(split=True, limits=(limit(p),) * p, forward_first=ff))
            for ff in (False, True)]
    best = min(runs, key=lambda s: simulate(s).makespan)  # ties keep backward-first, as generate()
    assert generate(kind, p, m).order == best.order
