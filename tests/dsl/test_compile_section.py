"""The `compile` section: its values reach the plan, and what graphs mode does not run is
refused at the `compile.mode` line (the example plans, as the CLI reads them)."""
from __future__ import annotations

import os

import pytest

from pipeplan.dsl.errors import PlanError
from pipeplan.dsl.load import load_plan

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples")


def _load(name: str, *overrides: str):
    return load_plan(os.path.join(EXAMPLES, name), list(overrides))


def test_mode_default_and_values():
    assert _load("gpt_pp4_1f1b.plan").compile.mode == "eager"
    for mode in ("graphs", "inductor"):
        assert _load("gpt_pp4_1f1b.plan", f"compile.mode={mode}").compile.graphs


def test_tp_ep_and_cp_plans_load_in_graphs_and_inductor_mode():
    for name in ("hybrid_pp2_dp2_tp2.plan", "moe_pp2_ep2_zbv.plan"):
        for mode in ("graphs", "inductor"):
            assert _load(name, f"compile.mode={mode}").compile.graphs
    for method in ("ring", "ulysses"):
        for mode in ("graphs", "inductor"):
            plan = _load("gpt_pp4_1f1b.plan", f"compile.mode={mode}", "mesh.cp=2",
                         f"context.method={method}")
            assert plan.mesh.cp == 2 and plan.context.method == method


@pytest.mark.parametrize("name, edits, why", [
    ("moe_pp2_ep2_zbv.plan", ["experts.dropless=false", "experts.capacity_factor=1.0"],
     "experts.dropless = false"),
    ("moe_pp2_ep2_zbv.plan", ["mesh.tp=2", "mesh.ep=4"], "expert parallelism across tp")])
def test_what_graphs_mode_does_not_run_is_refused_at_the_mode_line(name, edits, why):
    with pytest.raises(PlanError) as e:
        _load(name, "compile.mode=graphs", *edits)
    text = str(e.value)
    mode = "inductor" if "compile.mode=inductor" in edits else "graphs"
    assert why in text and f"compile.mode = {mode}" in text
    assert "compile { mode = eager }" in text  # the hint


def test_unknown_mode_is_refused():
    with pytest.raises(PlanError, match="eager"):
        _load("gpt_pp4_1f1b.plan", "compile.mode=fast")
