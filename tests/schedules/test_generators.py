"""Every generated schedule verifies; closed forms and memory bounds hold at unit costs."""
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeplan.schedules import KINDS, Costs, ScheduleError, generate, simulate, verify
from pipeplan.schedules.gen_zero_bubble import vhalf_limit, vmin_limit

PROPS = settings(max_examples=25, derandomize=True, deadline=None,
                 suppress_health_check=[HealthCheck.too_slow])
ranks = st.integers(1, 16)
micro = st.integers(1, 64)


def peak(schedule):
    return max(simulate(schedule).peak_activations)


@PROPS
@given(p=ranks, m=micro, v=st.sampled_from([1, 2, 4]))
def test_gpipe_verifies_and_matches_closed_form(p, m, v):
    s = generate("gpipe", p, m, v)
    verify(s)
    r = simulate(s)
    if v == 1:
        assert r.bubble == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
    assert max(r.peak_activations) == pytest.approx(m)


@PROPS
@given(p=ranks, m=micro)
def test_1f1b_bubble_and_peak(p, m):
    s = generate("1f1b", p, m)
    r = simulate(s)
    assert r.bubble == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
    assert r.peak_activations[0] == min(m, p)
    assert all(r.peak_activations[k] == min(m, p - k) for k in range(p))


@PROPS
@given(p=ranks, m=micro, v=st.sampled_from([2, 4]))
def test_interleaved_verifies_for_any_microbatch_count(p, m, v):
    s = generate("interleaved", p, m, v)
    verify(s)
    assert s.stages == p * v and s.stage_to_rank == tuple(k % p for k in range(p * v))


@PROPS
@given(p=ranks, k=st.integers(1, 8), v=st.sampled_from([2, 4]))
def test_interleaved_closed_form_when_m_is_a_multiple_of_p(p, k, v):
    m = k * p
    r = simulate(generate("interleaved", p, m, v))
    assert r.bubble == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)
    assert max(r.peak_activations) <= p + (p - 1) / v + 1e-9


@PROPS
@given(p=ranks, m=micro)
def test_zbh1_and_zbh2_memory(p, m):
    s1, s2 = generate("zbh1", p, m), generate("zbh2", p, m)
    verify(s1, memory_limit=p)
    verify(s2, memory_limit=2 * p - 1)
    r1 = simulate(s1)
    if m >= p:  # ZB-H1 closed form: (p-1)(F+B-W) idle per rank
        assert r1.bubble == pytest.approx((p - 1) / (3 * m + p - 1), abs=1e-12)


@PROPS
@given(p=ranks, m=micro)
def test_v_kinds_verify_within_their_memory(p, m):
    paper = generate("zbv", p, m)  # the paper's order; in-order channels cost rank r half a unit per r
    verify(paper)
    assert all(peak <= p + r / 2 + 1e-9 for r, peak in enumerate(simulate(paper).peak_activations))
    verify(generate("zbv", p, m, memory_limit=p), memory_limit=p)  # list-scheduled within the limit
    verify(generate("vhalf", p, m), memory_limit=vhalf_limit(p))
    verify(generate("vmin", p, m), memory_limit=vmin_limit(p))
    assert vhalf_limit(p) <= p / 2 + 1 and vmin_limit(p) <= p / 3 + 1


@PROPS
@given(p=ranks, m=micro)
def test_dualpipev_verifies_or_names_its_constraint(p, m):
    if m < 2 * p:
        with pytest.raises(ScheduleError, match=r"dualpipev needs microbatches >= 2 x ranks"):
            generate("dualpipev", p, m)
        return
    s = generate("dualpipev", p, m)
    verify(s)
    assert s.stage_to_rank == tuple(range(p)) + tuple(reversed(range(p)))


@pytest.mark.parametrize("p,m", [(1, 1), (1, 5), (3, 1), (8, 2), (16, 3)])
def test_fewer_microbatches_than_ranks(p, m):
    for kind in ("gpipe", "1f1b", "interleaved", "zbh1", "zbh2", "zbv", "vhalf", "vmin"):
        verify(generate(kind, p, m))


def test_paper_targets_at_p4_m8():
    assert simulate(generate("zbv", 4, 8)).bubble <= 0.059  # (p-1)F/v over the iteration: 1.5/25.5
    assert simulate(generate("zbh1", 4, 8)).bubble == pytest.approx(1 / 9)  # the 0.111, exactly 3/27
    assert simulate(generate("gpipe", 4, 8)).bubble == pytest.approx(3 / 11)
    assert simulate(generate("interleaved", 4, 8)).bubble == pytest.approx(3 / 19)


def test_vhalf_and_vmin_trade_bubble_for_memory():
    p, m = 8, 32
    one = max(simulate(generate("1f1b", p, m)).peak_activations)
    half = max(simulate(generate("vhalf", p, m)).peak_activations)
    third = max(simulate(generate("vmin", p, m)).peak_activations)
    assert half <= one / 2 + 1 and third <= one / 3 + 1
    assert third < half < one


def test_fixed_kinds_do_not_depend_on_costs():
    for kind in KINDS[:-1]:
        m = 8
        a = generate(kind, 4, m)
        b = generate(kind, 4, m, costs=Costs(1, 2, 0.5, latency=0.3))
        assert a.order == b.order


@pytest.mark.parametrize("kind,kwargs,pattern", [
    ("nope", {}, "unknown schedule kind 'nope'"),
    ("zbv", {"virtual": 3}, "zbv needs virtual=2"),
    ("1f1b", {"virtual": 2}, "1f1b needs virtual=1"),
    ("interleaved", {"virtual": 1}, "interleaved needs virtual >= 2"),
    ("gpipe", {"microbatches": 0}, "microbatches must be an integer >= 1"),
    ("gpipe", {"ranks": 0}, "ranks must be an integer >= 1"),
    ("zbh2", {"memory_limit": 3}, "zbh2 needs 7 microbatches of activations per rank, above the memory limit 3"),
    ("auto", {"memory_limit": 0.5}, "auto: no schedule .* fits the memory limit 0.5"),
    ("gpipe", {"memory_limit": -1}, "memory limit must be > 0"),
])
def test_bad_arguments_raise_one_line_errors(kind, kwargs, pattern):
    args = {"ranks": 4, "microbatches": 8, **kwargs}
    with pytest.raises(ScheduleError, match=pattern) as info:
        generate(kind, **args)
    assert "\n" not in str(info.value)


def test_one_pass_fifo_repair_equals_follow_fifo():
    """dualpipev's and zbv's closed-form in-order repairs give what the general, event-driven
    follow_fifo gives on DeepSeek's and the paper's tag-matched orders (p 1..10, m around 2p..4p)."""
    from pipeplan.schedules.fifo_repair import early_forwards, follow_fifo
    from pipeplan.schedules.gen_dualpipev import _rank_order
    from pipeplan.schedules.gen_zero_bubble import zbv_tagged
    from pipeplan.schedules.ir import Schedule, v_placement
    for p in range(1, 11):
        for m in (2 * p, 2 * p + 1, 3 * p - 1, 4 * p):
            deepseek = Schedule("dualpipev", p, 2 * p, m, v_placement(p),
                                tuple(_rank_order(p, r, m) for r in range(p)))
            assert generate("dualpipev", p, m).order == follow_fifo(deepseek).order, (p, m)
            assert early_forwards(deepseek).order == follow_fifo(deepseek).order
            assert generate("zbv", p, m).order == follow_fifo(zbv_tagged(p, m)).order, (p, m)
