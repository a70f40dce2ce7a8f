"""`experts.balance`: what the compiler marks, and what it refuses at the plan line.

`compile_plan` on the meta device (what `pipeplan check` runs). The runs
(balance = step equal to the whole-batch model, and different from balance =
microbatch) are tests/backends/test_balance_step.py.
"""
from __future__ import annotations

import math

import pytest
import torch

from pipeplan.compiler import compile_plan
from pipeplan.compiler.parallel.ep_balance import StepStatistics, step_statistic
from pipeplan.dsl import PlanError, parse_plan

from .test_experts_plan_errors import PLAN, ROUTER, _extra, _position

HF_NO_AUX = ROUTER.replace("mixtral_router_logits", "mixtral")
HF_AUX = ROUTER.replace("loss = cross_entropy", "loss = model\n  inputs = { input_ids = "
                        "int64[batch, seq], labels = int64[batch, seq] }") \
    .replace("seq_len = 8)", "seq_len = 8, inputs = { labels = tokens })")

CASES = [  # (id, plan text, where the error points ("|": the column), message)
    ("tp", _extra("balance = step").replace("dp = 2  ep = 2", "dp = 2  tp = 2  ep = 2"),
     "balance = |step", "with tp > 1 the statistics would be DTensors"),
    ("zero3", _extra("balance = step").replace("train {", "zero = 3\ntrain {"),
     "balance = |step", "zero = 3 would gather parameters around the routing pre-pass"),
    ("no-statistic", HF_NO_AUX.replace("num_experts = 4\n}", "num_experts = 4\n  balance = step\n}"),
     "balance = |step", "computes no load-balancing statistic"),
    ("diloco", _extra("balance = step", ep=1).replace("train {", "sync = diloco(inner_steps = 2)\ntrain {"),
     "balance = |step", "across the dp ranks that diloco makes separate islands"),  # dsl/sync_checks.py
    ("unknown", _extra("balance = global"), "balance = |global", "unknown balance 'global'"),
]


@pytest.mark.parametrize("text,needle,message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_refused_at_the_plan_line(text, needle, message):
    with pytest.raises(PlanError) as info:
        compile_plan(parse_plan(text, "t.plan"))
    hits = [d for d in info.value.diagnostics if message in d.message]
    assert hits, [d.message for d in info.value.diagnostics]
    assert (hits[0].span.line, hits[0].span.col) == _position(text, needle)


def _marked(text: str) -> list[list[str]]:
    compiled = compile_plan(parse_plan(text, "t.plan"))
    return [[n.args[1] for n in st.module.graph.nodes if n.target is step_statistic]
            for st in compiled.stages]


def test_each_layers_share_of_slots_is_marked_where_it_is_computed():
    """The example MoE: one statistic per MoE layer (f = the share of routed slots), on
    that layer's stage; nothing under balance = microbatch (the graph is unchanged)."""
    two_stages = PLAN.replace("dp = 2  ep = 2", "pp = 2  dp = 2  ep = 2") \
        .replace("microbatches = 1", "microbatches = 2").replace("global_batch = 4", "global_batch = 8")
    step = _marked(two_stages.replace("num_experts = 4\n}", "num_experts = 4\n  balance = step\n}"))
    assert [len(s) for s in step] == [1, 1]
    assert _marked(two_stages) == [[], []]


def test_transformers_statistic_is_on_the_last_stage():
    """Mixtral with output_router_logits: load_balancing_loss_func runs where the loss is,
    on the router logits every layer sends there (one statistic: tokens_per_expert)."""
    text = HF_AUX.replace("mesh { dp = 2  ep = 2 }", "mesh { pp = 2  dp = 2  ep = 2 }") \
        .replace("num_experts = 4\n}", "num_experts = 4\n  balance = step\n}") \
        .replace("microbatches = 1", "microbatches = 2").replace("global_batch = 4", "global_batch = 8")
    marked = _marked(text)
    assert [len(s) for s in marked] == [0, 1]


def test_step_statistics_collect_then_apply():
    stats = StepStatistics()
    a, b = torch.tensor([0.25, 0.75]), torch.tensor([0.5, 0.5])
    assert step_statistic(a, "k") is a  # no runtime active: the model's own value
    with stats.active("collect"):
        assert step_statistic(a, "k") is a and step_statistic(b, "k") is b
    stats.values = {"k": stats.sums["k"] / 2}
    with stats.active("apply"):
        assert torch.equal(step_statistic(a, "k"), torch.tensor([0.375, 0.625]))
    assert step_statistic(a, "k") is a


def test_the_routing_prepass_is_in_the_estimates():
    """One more forward per microbatch and stage: its simulated time in the step time, its
    FLOPs and its activation sends in every rank's numbers; nothing under microbatch."""
    two_stages = PLAN.replace("dp = 2  ep = 2", "pp = 2  dp = 2  ep = 2") \
        .replace("microbatches = 1", "microbatches = 2").replace("global_batch = 4", "global_batch = 8")
    # a device without host time per op, its memory free: the statistics' wrappers add
    # memory-bound ops, not FLOPs, so the two plans' schedules run the same op times
    two_stages += "device {\n  flops = 1PFLOP/s\n  memory_bandwidth = 1000000TB/s\n}\n"
    micro = compile_plan(parse_plan(two_stages, "t.plan"))
    step = compile_plan(parse_plan(
        two_stages.replace("num_experts = 4\n}", "num_experts = 4\n  balance = step\n}"), "t.plan"))
    a, b = micro.estimates, step.estimates
    assert a.prepass_s == 0 and b.prepass_s > 0
    assert b.step_time_s == pytest.approx(a.step_time_s + b.prepass_s, rel=1e-12)
    forward = [sum(st.flops for st in step.stages if st.rank == r) * 2 for r in range(2)]
    for ra, rb in zip(a.ranks, b.ranks):
        assert rb.flops == pytest.approx(ra.flops + forward[ra.rank // 2], rel=1e-12)
        sent = rb.comm_bytes["p2p"] - ra.comm_bytes["p2p"]  # stage 0's outputs, once more
        outputs = sum(math.prod(o.shape) * 4 for o in step.stages[0].outputs)  # float32
        assert sent == (2 * outputs if ra.rank // 2 == 0 else 0)  # 2 microbatches
