"""`--set key=value` overrides: spliced into the plan, checked like the file, errors point at them."""
from __future__ import annotations

import pytest

from pipeplan.dsl import PlanError, parse_plan
from pipeplan.dsl.ast import RecomputeRule


def test_override_replaces_a_value_and_its_span(base):
    plan = parse_plan(base, "t.plan", ["pipeline.microbatches=16"])
    assert plan.pipeline.microbatches == 16
    span = plan.spans["pipeline.microbatches"]
    assert (span.file, span.line, span.col) == ("<--set 1>", 1, 23)
    assert plan.sources["<--set 1>"] == "pipeline.microbatches=16"


def test_override_reaches_into_calls_and_args(base):
    plan = parse_plan(base, "t.plan", ["train.optimizer.lr=0.01", "data.seed=3",
                                       "model.args.dim=128"])
    assert plan.train.optimizer.lr == 0.01 and plan.data.seed == 3
    assert plan.model.args["dim"] == 128


def test_override_replaces_a_whole_call_and_adds_new_keys(base):
    plan = parse_plan(base, "t.plan", ["train.optimizer=sgd(lr = 0.1, momentum = 0.9)",
                                       "mesh.dp=2", "train.global_batch=32", "zero=1",
                                       "recompute.layers.*.mlp=full"])
    assert (plan.train.optimizer.name, plan.train.optimizer.momentum) == ("sgd", 0.9)
    assert (plan.mesh.dp, plan.zero) == (2, 1)
    assert plan.recompute == (RecomputeRule("layers.*.mlp", "full"),)


def test_the_last_override_of_a_key_wins(base):
    plan = parse_plan(base, "t.plan", ["pipeline.microbatches=4", "pipeline.microbatches=16"])
    assert plan.microbatches == 16


@pytest.mark.parametrize("override,where,message", [
    ("pipeline.microbatchs=4", (1, 10), "unknown key 'microbatchs' in pipeline"),
    ("mesh.pp=x", (1, 9), "mesh.pp must be an integer, got a name 'x'"),
    ("pipeline.microbatches", (1, 1), "override 'pipeline.microbatches' is not key=value"),
    ("mesh.pp.x=1", (1, 1), "cannot set 'mesh.pp.x': mesh.pp is a single value, not a block"),
    ("mesh.pp=(", (1, 9), "unexpected '('"),
])
def test_bad_overrides_point_at_the_override(base, errors_of, override, where, message):
    found = errors_of(base, path="t.plan", overrides=[override])
    assert ("<--set 1>", *where, message) in found, found


def test_override_errors_render_the_override_line(base):
    with pytest.raises(PlanError) as info:
        parse_plan(base, "t.plan", ["mesh.pp=1", "mesh.pp=x"])
    assert str(info.value).splitlines()[:3] == [
        "<--set 2>:1:9: error: mesh.pp must be an integer, got a name 'x'",
        "    mesh.pp=x",
        "            ^"]
