"""Benchmarks (numbers, not timed assertions): parsing+checking and formatting a plan.

    python -m pytest -q tests/dsl/test_bench_parse.py --benchmark-enable
"""
from __future__ import annotations

from pathlib import Path

from pipeplan.dsl import format_plan, parse_plan

HYBRID = Path(__file__).resolve().parents[2] / "examples" / "hybrid_pp2_dp2_tp2.plan"


def test_bench_parse_and_check(benchmark):
    text = HYBRID.read_text()
    plan = benchmark(parse_plan, text, str(HYBRID))
    assert plan.mesh.world_size == 8


def test_bench_format(benchmark):
    plan = parse_plan(HYBRID.read_text(), str(HYBRID))
    assert benchmark(format_plan, plan) == HYBRID.read_text()
