"""The `sync` setting (DiLoCo): reading, canonical form, and refusals at the plan line."""
from __future__ import annotations

import pytest

from pipeplan.dsl import PlanError, format_plan, parse_plan
from pipeplan.dsl.ast import OuterOptimizerSpec, SyncSpec

PLAN = """\
model {{ source = "m.py:M" }}
mesh {{ pp = 2  dp = {dp}{extra} }}
pipeline {{ microbatches = 2 }}
{zero}sync = {sync}
train {{ steps = 12 }}
"""


def plan_text(sync: str, dp: int = 2, extra: str = "", zero: str = "") -> str:
    return PLAN.format(sync=sync, dp=dp, extra=extra, zero=zero)


def test_diloco_reads_and_writes_back():
    text = plan_text("diloco(inner_steps = 3, outer_optimizer = nesterov(lr = 0.5, "
                     "momentum = 0.8), fragments = 2, decoupled = true, timeout = 2s)")
    plan = parse_plan(text, "p.plan")
    assert plan.sync == SyncSpec("diloco", 3, OuterOptimizerSpec("nesterov", 0.5, 0.8), 2, True,
                                 2.0)
    assert parse_plan(format_plan(plan)).sync == plan.sync
    assert parse_plan(plan_text("every_step")).sync == SyncSpec()
    assert parse_plan(plan_text("diloco(inner_steps = 4, outer_optimizer = sgd(lr = 1, "
                                "momentum = 0))")).sync.outer_optimizer.name == "sgd"


@pytest.mark.parametrize("sync,dp,extra,zero,message,col_text", [
    ("diloco(inner_steps = 3)", 1, "", "", "diloco needs islands: mesh.dp = 1", "1 }"),
    ("diloco(inner_steps = 3)", 2, "", "zero = 1\n", "zero = 1 shards the optimizer", "1\nsync"),
    ("diloco(inner_steps = 3)", 2, "  ep = 2", "", "ep = 2 does not divide tp = 1, so its EP "
     "groups would cross diloco's islands", "2 }"),
    ("diloco(inner_steps = 3)", 2, "  tp = 2  ep = 4", "", "ep = 4 does not divide tp = 2",
     "4 }"),
    ("diloco(inner_steps = 3, fragments = 3)", 2, "", "", "fragments = 3 does not divide the 2",
     "3)"),
    ("diloco(inner_steps = 1, fragments = 2)", 2, "", "", "fragments = 2 is more than", "2)"),
    ("diloco(inner_steps = 13)", 2, "", "", "the islands would never sync", "13)"),
    ("diloco(inner_steps = 3, timeout = 5s)", 2, "", "", "timeout does nothing unless", "5s)"),
    ("diloco(fragments = 1)", 2, "", "", "diloco needs inner_steps", "diloco("),
    ("diloco(inner_steps = 3, outer_optimizer = nesterov(lr = 0.7, momentum = 0))", 2, "", "",
     "nesterov needs momentum > 0", "0))"),
    ("diloco(inner_steps = 0)", 2, "", "", "inner_steps", "0)"),
    ("diloco(inner_steps = 2, outer_optimizer = adam(lr = 1))", 2, "", "",
     "unknown outer_optimizer 'adam'", "adam("),
    ("sometimes", 2, "", "", "unknown sync 'sometimes'", "sometimes"),
])
def test_refusals_point_at_the_plan_line(sync, dp, extra, zero, message, col_text):
    text = plan_text(sync, dp, extra, zero)
    with pytest.raises(PlanError) as e:
        parse_plan(text, "p.plan")
    found = [d for d in e.value.diagnostics if message in d.message]
    assert found, [d.message for d in e.value.diagnostics]
    offset = text.index(col_text)
    line = text.count("\n", 0, offset) + 1
    col = offset - (text.rfind("\n", 0, offset) + 1) + 1
    assert (found[0].span.line, found[0].span.col) == (line, col), found[0]


@pytest.mark.parametrize("tp", [2, 4])
def test_diloco_takes_ep_dividing_tp_inside_the_islands(tp):
    """ep dividing tp: EP groups are tp ranks of one island (dsl/layout.py), never across
    islands; the edp groups (the same experts, gradients summed every step) are cut at the
    islands, and the same experts in the other islands are the dp group."""
    from pipeplan.dsl.layout import group_sizes, groups, mesh_layout

    text = plan_text("diloco(inner_steps = 3)", extra=f"  tp = {tp}  ep = 2").replace(
        "pipeline {", 'experts { modules = ["layers.*.moe"]  num_experts = 4 }\npipeline {')
    plan = parse_plan(text, "p.plan")
    assert plan.mesh.islands and group_sizes(plan.mesh).edp == tp // 2
    layout = mesh_layout(plan.mesh)
    for g in groups(layout, "ep", islands=True):  # one island, one stage, consecutive tp ranks
        assert len({(layout[r].pp, layout[r].dp) for r in g}) == 1 and len(g) == 2
        assert [layout[r].tp % 2 for r in g] == [0, 1]
    for g in groups(layout, "edp", islands=True):
        assert len({(layout[r].pp, layout[r].dp, layout[r].ep) for r in g}) == 1
        assert len(g) == tp // 2
    for g in groups(layout, "dp"):  # the other islands' ranks hold the same experts
        assert len({layout[r].ep for r in g}) == 1
    # the same mesh under every-step sync puts EP over the dp ranks
    every = parse_plan(text.replace("diloco(inner_steps = 3)", "every_step"), "p.plan")
    assert not every.mesh.islands and groups(mesh_layout(every.mesh), "ep") == \
        groups(mesh_layout(every.mesh), "dp")


def test_diloco_refuses_step_balance_at_its_line():
    text = plan_text("diloco(inner_steps = 3)").replace(
        "pipeline {", 'experts { modules = ["layers.*.moe"]  num_experts = 4  balance = step }\n'
        "pipeline {")
    with pytest.raises(PlanError) as e:
        parse_plan(text, "p.plan")
    [found] = [d for d in e.value.diagnostics if "experts.balance = step" in d.message]
    offset = text.index("step }")
    assert (found.span.line, found.span.col) == (
        text.count("\n", 0, offset) + 1, offset - text.rfind("\n", 0, offset))


def test_diloco_takes_checkpoints_synchronous_and_decoupled():
    ckpt = 'train { steps = 12  checkpoint { every = 3  dir = "c" } }'
    for sync in ("diloco(inner_steps = 3)", "diloco(inner_steps = 3, decoupled = true, "
                                            "timeout = 2s)"):
        text = plan_text(sync).replace("train { steps = 12 }", ckpt)
        assert parse_plan(text, "p.plan").train.checkpoint.every == 3
