"""The judge (compare.py) on its own: rules, aliases, gradients, and the float32 bound.

The float32 rule is checked against real float32 disagreement between two
correct computations sharing no code with the rule: the single-process
reference trained with 2 and with 4 microbatches per step (the same function,
the gradient summed in another order) under AdamW. The uniform rtol 1e-5 /
atol 1e-6 calls them different (the gradients near Adam's eps); the
per-element bound accepts them, yet still refuses a real error of 1e-4 on one
element of a parameter with large gradients. In float64 the same pair agrees
within the fp64 rule.
"""
from __future__ import annotations

import dataclasses

import torch

from pipeplan.backends.verify.compare import FP64, Rule, alias_map, compare
from pipeplan.dsl.ast import (DataSpec, InputSpec, MeshSpec, ModelSpec, OptimizerSpec,
                              PipelineSpec, Plan, TrainSpec)
from pipeplan.backends.verify.reference import train_reference
from pipeplan.backends.verify.run import judge

from .test_equivalence import ADAMW, make_plan


def test_fp64_rule_is_element_wise_with_no_exemption():
    ref = {"w": torch.ones(4, dtype=torch.float64), "k_bias": torch.zeros(3, dtype=torch.float64)}
    close = {"w": ref["w"] * (1 + 5e-10), "k_bias": ref["k_bias"] + 5e-13}
    assert compare([1.0], ref, [[1.0 + 1e-10]], [close]).within
    far = dict(close, w=ref["w"] + torch.tensor([0, 0, 0, 2e-9], dtype=torch.float64))
    assert not compare([1.0], ref, [[1.0]], [far]).within
    # a zero-gradient parameter moved by an lr-sized step is not excused
    noisy = dict(close, k_bias=torch.full((3,), 3e-3, dtype=torch.float64))
    got = compare([1.0], ref, [[1.0]], [noisy])
    assert not got.within and got.worst_param == "k_bias"
    assert "EQUAL" not in got.render() and "rule fp64" in got.render()


def test_tied_weight_counts_as_held_under_either_name():
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = torch.nn.Embedding(5, 3)
            self.lm_head = torch.nn.Linear(3, 5, bias=False)
            self.lm_head.weight = self.wte.weight

    model = Tied()
    aliases = alias_map(model)
    assert aliases == {"wte.weight": "wte.weight", "lm_head.weight": "wte.weight"}
    ref = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    export_named = [{"lm_head.weight": ref["lm_head.weight"]}]  # what export keeps
    assert compare([1.0], ref, [[1.0]], export_named, aliases=aliases).within
    plain = compare([1.0], ref, [[1.0]], export_named)
    assert not plain.within and plain.missing == ("wte.weight",)


def test_gradients_are_judged_when_given():
    ref = {"w": torch.ones(2, dtype=torch.float64)}
    grads = {"w": torch.tensor([1e-3, -2e-3], dtype=torch.float64)}
    ok = compare([1.0], ref, [[1.0]], [ref], ref_grads=grads, grads_per_rank=[grads])
    assert ok.within and ok.grads_compared
    bad = compare([1.0], ref, [[1.0]], [ref], ref_grads=grads,
                  grads_per_rank=[{"w": grads["w"] * (1 + 1e-6)}])
    assert not bad.within and bad.worst_grad == "w" and bad.max_grad_diff > 0


def _as_rank(ref) -> dict:
    return {"losses": ref.losses, "params": ref.params, "grads": ref.grads}


def _pair(precision: str):
    plan = make_plan("gpt", "1f1b", 1, 1, ADAMW)
    plan = dataclasses.replace(plan, train=dataclasses.replace(plan.train, precision=precision))
    two = dataclasses.replace(plan, pipeline=dataclasses.replace(plan.pipeline, microbatches=2))
    four = dataclasses.replace(plan, pipeline=dataclasses.replace(plan.pipeline, microbatches=4))
    return train_reference(two, 3), train_reference(four, 3)


def test_fp32_rule_bounds_adam_by_its_denominator():
    a, b = _pair("fp32")
    assert a.params["lm_head.weight"].dtype == torch.float32
    uniform = Rule("uniform", 1e-5, 1e-6)
    assert not compare(a.losses, a.params, [b.losses], [b.params], rule=uniform).within
    verdict = judge(a, [_as_rank(b)], "fp32")
    assert verdict.within, verdict.render()
    assert "fp32-adam-bound" in verdict.render() and verdict.grads_compared
    # the bound is per element: where gradients are large, it stays near float32 precision
    slack = a.fp32_rule().param_slack
    name = min(slack, key=lambda n: float(slack[n].min()))
    broken = dict(b.params)
    broken[name] = b.params[name].clone()
    broken[name].view(-1)[int(slack[name].argmin())] += 1e-4
    assert not judge(a, [dict(_as_rank(b), params=broken)], "fp32").within


def test_fp64_pair_agrees_within_the_fp64_rule():
    a, b = _pair("fp64")
    assert a.params["lm_head.weight"].dtype == torch.float64
    verdict = judge(a, [_as_rank(b)])
    assert verdict.within and verdict.rule is FP64, verdict.render()


def test_a_gradient_zero_in_exact_arithmetic_is_judged_through_adams_reach():
    """tests/compiler/models.py's Centered: each block's bias cancels (its output centred over
    the sequence), so its exact gradient is zero and the computed one is float64 rounding
    noise (~1e-17), which AdamW's steps scale by up to lr/eps: the single-process reference
    with 2 and with 4 microbatches (one function, another summation order) moves those biases
    1.6e-11 apart, beyond `fp64`'s atol 1e-12, with every loss and gradient within it. The
    judge applies `fp64-adam-bound`: EQUAL; yet an lr-sized move of that bias, or 2e-9 on a
    weight with a healthy gradient, stays DIFFERENT."""
    plan = Plan(model=ModelSpec("pipeplan.tests.compiler.models:Centered",
                                inputs=(InputSpec("input_ids", "int64", ("batch", "seq")),)),
                data=DataSpec(seq_len=8, vocab=16, seed=7), mesh=MeshSpec(pp=1),
                pipeline=PipelineSpec(schedule="1f1b", microbatches=2),
                train=TrainSpec(steps=3, global_batch=8, seed=11, precision="fp64",
                                optimizer=OptimizerSpec(name="adamw", lr=1e-2, weight_decay=0.1)))
    four = dataclasses.replace(plan, pipeline=dataclasses.replace(plan.pipeline, microbatches=4))
    a, b = train_reference(plan, 3), train_reference(four, 3)
    strict = compare(a.losses, a.params, [b.losses], [b.params], rule=FP64,
                     ref_grads=a.grads, grads_per_rank=[b.grads])
    assert not strict.within and strict.worst_param.endswith(".bias"), strict.render()
    assert strict.max_loss_diff < 1e-12 and strict.max_grad_diff < 1e-12
    verdict = judge(a, [_as_rank(b)])
    assert verdict.within and verdict.rule.name == "fp64-adam-bound", verdict.render()
    bias, weight = strict.worst_param, "layers.0.weight"
    for name, by in ((bias, 1e-4), (weight, 2e-9)):
        broken = dict(b.params)
        broken[name] = b.params[name].clone()
        broken[name].view(-1)[0] += by
        assert not judge(a, [dict(_as_rank(b), params=broken)]).within, name
    # a gradient outside fp64 is never excused by the parameters' bound
    grads = dict(b.grads, **{weight: b.grads[weight] * (1 + 1e-6)})
    assert not judge(a, [dict(_as_rank(b), grads=grads)]).within
