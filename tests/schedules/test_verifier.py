"""The verifier models the runtime: each op once, dependency order, FIFO channels, no deadlock, memory."""
import pytest

from pipeplan.schedules import Action, Schedule, ScheduleError, generate, verify


def two_rank(order0, order1, name="hand"):
    return Schedule(name, 2, 2, 1, (0, 1), (tuple(order0), tuple(order1)))


F0, F1 = Action("F", 0, 0), Action("F", 1, 0)
BW0, BW1 = Action("BW", 0, 0), Action("BW", 1, 0)


def test_minimal_pipeline_verifies():
    verify(two_rank([F0, BW0], [F1, BW1]))


def test_missing_action_names_rank_and_op():
    with pytest.raises(ScheduleError, match=r"rank 1: BW \(or B and W\) of stage 1 mb 0 is missing"):
        verify(two_rank([F0, BW0], [F1]))


def test_duplicate_action():
    with pytest.raises(ScheduleError, match="appears twice"):
        verify(two_rank([F0, F0, BW0], [F1, BW1]))


def test_action_on_wrong_rank():
    with pytest.raises(ScheduleError, match=r"rank 0, position 1: F\(stage 1, mb 0\) is on rank 0 but stage 1"):
        verify(two_rank([F0, F1, BW0], [BW1]))


def test_local_order_backward_before_forward():
    with pytest.raises(ScheduleError, match=r"rank 1: BW\(stage 1, mb 0\) at position 0 needs F\(stage 1, mb 0\)"):
        verify(two_rank([F0, BW0], [BW1, F1]))


def test_w_before_b():
    s = Schedule("hand", 1, 1, 1, (0,), ((Action("F", 0, 0), Action("W", 0, 0), Action("B", 0, 0)),))
    with pytest.raises(ScheduleError, match=r"W\(stage 0, mb 0\) at position 1 needs B\(stage 0, mb 0\)"):
        verify(s)


def test_mixed_bw_and_split_backward_rejected():
    s = Schedule("hand", 1, 1, 1, (0,), ((Action("F", 0, 0), Action("B", 0, 0), Action("BW", 0, 0),
                                          Action("W", 0, 0)),))
    with pytest.raises(ScheduleError, match="both BW and a split"):
        verify(s)


def test_circular_wait_is_a_deadlock_naming_both_ranks():
    # rank 0 waits for mb 0's gradient before sending mb 1; rank 1 wants mb 1 before that gradient.
    order0 = [Action("F", 0, 0), Action("BW", 0, 0), Action("F", 0, 1), Action("BW", 0, 1)]
    order1 = [Action("F", 1, 0), Action("F", 1, 1), Action("BW", 1, 0), Action("BW", 1, 1)]
    s = Schedule("hand", 2, 2, 2, (0, 1), (tuple(order0), tuple(order1)))
    with pytest.raises(ScheduleError, match=r"deadlock: rank 0 blocks at BW\(stage 0, mb 0\) waiting for "
                                            r"BW\(stage 1, mb 0\) on rank 1; rank 1 blocks at F\(stage 1, mb 1\)"):
        verify(s)


def test_channel_fifo_order_mismatch_is_reported_even_without_deadlock():
    # rank 0 sends mb 0 then mb 1; rank 1 receives mb 1 first. With tagged messages this
    # would run, but on an in-order channel rank 1 would take mb 0's activation as mb 1's.
    order0 = [Action("F", 0, 0), Action("F", 0, 1), Action("BW", 0, 0), Action("BW", 0, 1)]
    order1 = [Action("F", 1, 1), Action("F", 1, 0), Action("BW", 1, 0), Action("BW", 1, 1)]
    s = Schedule("hand", 2, 2, 2, (0, 1), (tuple(order0), tuple(order1)))
    with pytest.raises(ScheduleError, match=r"channel rank 0 -> rank 1 out of order: message 0"):
        verify(s)


def test_same_rank_handover_needs_no_channel():
    # V placement with one rank: both stages on rank 0, hand-over in memory.
    s = Schedule("hand", 1, 2, 1, (0, 0), ((Action("F", 0, 0), Action("F", 1, 0), Action("BW", 1, 0),
                                             Action("BW", 0, 0)),))
    verify(s)


def test_memory_limit_names_rank_and_action():
    s = generate("gpipe", 2, 4)
    verify(s, memory_limit=4)
    with pytest.raises(ScheduleError, match=r"rank 0 holds 4 microbatches .* after F\(stage 0, mb 3\).*limit 3"):
        verify(s, memory_limit=3)


def test_split_backward_holds_memory_until_w():
    # F adds one unit; B frees nothing; W frees it.
    s = Schedule("hand", 1, 1, 2, (0,), ((Action("F", 0, 0), Action("B", 0, 0), Action("F", 0, 1),
                                          Action("B", 0, 1), Action("W", 0, 0), Action("W", 0, 1)),))
    verify(s, memory_limit=2)
    with pytest.raises(ScheduleError, match="holds 2 microbatches"):
        verify(s, memory_limit=1.5)


@pytest.mark.parametrize("bad", [
    Schedule("x", 0, 1, 1, (0,), ()),
    Schedule("x", 1, 1, 0, (0,), ((),)),
    Schedule("x", 1, 2, 1, (0,), ((),)),
    Schedule("x", 1, 1, 1, (3,), ((),)),
    Schedule("x", 1, 1, 1, (0,), ((Action("X", 0, 0),),)),
    Schedule("x", 1, 1, 1, (0,), ((Action("F", 5, 0),),)),
    Schedule("x", 1, 1, 1, (0,), ((Action("F", 0, -1),),)),
    Schedule("x", 2, 1, 1, (0,), ((),)),
])
def test_malformed_schedules_raise_one_line_errors(bad):
    with pytest.raises(ScheduleError) as info:
        verify(bad)
    assert "\n" not in str(info.value)


# A mutated schedule is either valid or rejected with a ScheduleError: never a crash or a hang.
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from pipeplan.schedules import simulate  # noqa: E402

BASES = [generate(k, 3, 4) for k in ("1f1b", "zbh1", "zbv", "interleaved")]


@settings(max_examples=150, derandomize=True, deadline=None)
@given(base=st.sampled_from(BASES), kind=st.sampled_from(["swap", "move", "drop", "dup", "retag"]),
       seed=st.integers(0, 10_000))
def test_mutated_schedules_verify_or_raise_schedule_error(base, kind, seed):
    import random
    rng = random.Random(seed)
    order = [list(row) for row in base.order]
    r = rng.randrange(len(order))
    i = rng.randrange(len(order[r]))
    if kind == "swap":
        j = rng.randrange(len(order[r]))
        order[r][i], order[r][j] = order[r][j], order[r][i]
    elif kind == "move":
        order[rng.randrange(len(order))].insert(0, order[r].pop(i))
    elif kind == "drop":
        order[r].pop(i)
    elif kind == "dup":
        order[r].insert(rng.randrange(len(order[r]) + 1), order[r][i])
    else:
        a = order[r][i]
        order[r][i] = Action(rng.choice(["F", "B", "W", "BW", "X"]), a.stage, rng.randrange(-1, 6))
    s = Schedule("mutant", base.ranks, base.stages, base.microbatches, base.stage_to_rank,
                 tuple(tuple(row) for row in order))
    try:
        verify(s)
    except ScheduleError as e:
        assert "\n" not in str(e)
        with pytest.raises(ScheduleError):
            simulate(s)
        return
    assert simulate(s).makespan > 0
