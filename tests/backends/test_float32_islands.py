"""A model's own float32 computation inside a float64 verify: found in the graph, judged by rule.

`Float32AttentionLM` (tests/parallel/families.py) computes its attention in float32 on
purpose (`q.float()` ..., `.to(x.dtype)`), as DeepSeek-V3's router does. In float64 its
graph narrows to float32 at those casts (compiler/estimate/precision.py
`narrowing_casts`); ring attention over cp2 computes that float32 attention in blocks, so
its rounding differs from the whole-sequence reference by float32 amounts: the `fp64`
rule says DIFFERENT, and the judge applies the float32 bound (`fp32-island`), naming the
casts that set it. A model without such casts is never given that bound.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from pipeplan.dsl import parse_plan

PLAN = """\
model {{
  source = "pipeplan.tests.parallel.families:{model}"
  inputs = {{ input_ids = int64[batch, seq] }}
  capture = fx
}}
data = synthetic(seed = 7, vocab = 64, seq_len = 16)
mesh {{ cp = {cp} }}
{context}
pipeline {{ microbatches = 2 }}
train {{
  steps = 3
  global_batch = 4
  grad_clip = 0.5
  seed = 11
  precision = fp64
  optimizer = adamw(lr = 0.003, weight_decay = 0.1)
}}
"""
STEPS = 3


def plan_for(model: str, cp: int = 1):
    context = "context { method = ring }" if cp > 1 else ""
    return parse_plan(PLAN.format(model=model, cp=cp, context=context), "plan.plan")


def test_the_graph_names_the_models_own_float32_casts():
    from pipeplan.backends.verify.reference import float_islands

    assert float_islands(plan_for("Float32AttentionLM")) == [
        "float_1 (the root, float32)", "float_2 (the root, float32)",
        "float_3 (the root, float32)"]
    assert float_islands(plan_for("SeqOpLM")) == []  # float64 throughout
    fp32 = plan_for("Float32AttentionLM")
    fp32 = dataclasses.replace(fp32, train=dataclasses.replace(fp32.train, precision="fp32"))
    assert float_islands(fp32) == []  # the rule is for float64 runs


def _nudged(ref, rel: float) -> dict:
    """A rank's result: the reference moved by `rel` relative in every loss, grad and param."""
    def move(t):
        return t * (1 + rel) + rel * 1e-3

    return {"losses": [l * (1 + rel) for l in ref.losses],
            "params": {n: move(p) for n, p in ref.params.items()},
            "grads": {n: move(g) for n, g in ref.grads.items()}}


@pytest.mark.parametrize("model, rel, rule, equal", [
    ("Float32AttentionLM", 1e-7, "fp32-island", True),  # float32-sized: the casts' bound
    ("Float32AttentionLM", 1e-2, "fp32-island", False),  # far beyond float32 rounding
    ("SeqOpLM", 1e-7, "fp64", False),  # no float32 in the model: fp64 stays the rule
    ("Float32AttentionLM", 0.0, "fp64", True),  # equal in fp64: fp64 is the verdict
])
def test_the_float32_bound_applies_only_where_the_model_narrows(model, rel, rule, equal):
    from pipeplan.backends.verify.reference import train_reference
    from pipeplan.backends.verify.run import judge

    plan = plan_for(model)
    ref = train_reference(plan, STEPS)
    verdict = judge(ref, [_nudged(ref, rel)], "fp64", plan)
    assert verdict.rule.name == rule and verdict.within is equal, verdict.render()
    if rule == "fp32-island":
        assert "narrows to float32 at 3 nodes: float_1 (the root, float32)" in verdict.render()


def _worker(rank, world):
    from .judging import train_for_judge

    return train_for_judge(plan_for("Float32AttentionLM", cp=2), STEPS)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ring_attention_on_a_float32_island_is_equal_under_its_rule(spawn):
    from pipeplan.backends.verify.reference import train_reference
    from pipeplan.backends.verify.run import judge

    results = spawn(_worker, 2, timeout=280)
    plan = plan_for("Float32AttentionLM", cp=2)
    ref = train_reference(plan, STEPS)
    strict = judge(ref, results, "fp64")  # no plan: the fp64 rule alone
    assert not strict.within and strict.max_loss_diff > 1e-12, strict.render()
    verdict = judge(ref, results, "fp64", plan)
    assert verdict.within and verdict.rule.name == "fp32-island", verdict.render()
    assert verdict.max_param_diff < 1e-4  # float32 rounding carried through 3 Adam steps
