"""generate + verify + simulate at growing sizes (pytest-benchmark; runs once under --benchmark-disable).

Run with timings:  python -m pytest tests/benchmarks/test_bench_schedules.py --benchmark-enable
Aim: < 1 s for (64, 1024) for every fixed kind (the list-scheduled ones through their period
skip, schedules/greedy_period.py), linear in the number of actions.
Every kind at (64, 1024), auto against torch's ZBV and the optimum at p=4/8, and auto at
(16, 64) are in the on-demand script tests/benchmarks/bench_schedules.py (minutes; numbers
in BENCHMARKS.md and docs/schedules.md).
"""
import pytest

from pipeplan.schedules import Costs, generate, simulate, verify
from pipeplan.schedules.gen_zero_bubble import vhalf_limit, vmin_limit, zbh2_limit

SIZES = [(8, 64), (32, 256), (64, 1024)]


def pipeline(kind: str, p: int, m: int):
    s = generate(kind, p, m)
    verify(s, memory_limit=None)
    return s, simulate(s, Costs(1, 1.5, 0.5, latency=0.05))


@pytest.mark.parametrize("p,m", SIZES)
@pytest.mark.parametrize("kind", ["1f1b", "zbh1"])
def test_bench_closed_forms(benchmark, kind, p, m):
    s, r = benchmark.pedantic(pipeline, args=(kind, p, m), rounds=1, iterations=1)
    assert s.num_actions == p * m * (2 if kind == "1f1b" else 3)
    assert r.lower_bound <= r.makespan


@pytest.mark.parametrize("p,m", SIZES[:2])
@pytest.mark.parametrize("kind", ["interleaved", "zbv"])
def test_bench_multi_stage(benchmark, kind, p, m):
    s, r = benchmark.pedantic(pipeline, args=(kind, p, m), rounds=1, iterations=1)
    assert s.stages == 2 * p and r.lower_bound <= r.makespan


@pytest.mark.parametrize("p,m", SIZES)
@pytest.mark.parametrize("kind,limit", [("zbh2", zbh2_limit), ("vhalf", vhalf_limit), ("vmin", vmin_limit)])
def test_bench_list_scheduled(benchmark, kind, limit, p, m):
    s, r = benchmark.pedantic(pipeline, args=(kind, p, m), rounds=1, iterations=1)
    verify(s, memory_limit=limit(p))  # within the kind's memory at every size
    assert s.num_actions == s.stages * m * 3 and r.lower_bound <= r.makespan + 1e-9  # zbh2 meets it


def test_bench_auto_small(benchmark):
    s = benchmark.pedantic(generate, args=("auto", 8, 32), kwargs={"costs": Costs(1, 1.5, 0.5), "memory_limit": 8},
                           rounds=1, iterations=1)
    verify(s, memory_limit=8)
