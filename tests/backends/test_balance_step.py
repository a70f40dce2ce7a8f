"""`experts.balance = step`: load-balancing statistics over the step's global tokens.

pp2 x dp2 x ep2 (world 4), float64, 3 AdamW steps with clipping, rtol 1e-9 /
atol 1e-12. The reference is one process running the unmodified model on the
whole global batch in ONE call per step (`chunk_groups`: the model's own aux
code then sees every microbatch of every dp/ep rank), not the pipelined path.
Mixtral also runs with `balance = microbatch` (the model's call per
microbatch, the default) in the same processes: it must equal the per-chunk
reference; each step run must differ from its model's microbatch run, so the
setting changes what runs.

Models: pipeplan's example MoE (its (logits, aux) return: Switch load balancing
and z-loss computed per MoE layer, on each layer's stage) and transformers'
Mixtral with `output_router_logits = True` and labels, `loss = model`: its own
loss, cross-entropy + router_aux_loss_coef * load_balancing_loss_func over the
router logits of every layer, which the captured graph carries from stage 0 to
the last stage as activations.
"""
from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from pipeplan.backends.runtime import data
from pipeplan.backends.verify.compare import compare
from pipeplan.backends.state.model import build_model
from ..parallel.comm_meter import CommMeter
from pipeplan.backends.verify.reference import train_reference
from pipeplan.backends.runtime.trainer import PipelineTrainer
from pipeplan.compiler import compile_plan
from pipeplan.dsl.ast import InputSpec, Plan

from .test_equivalence_moe import ATOL, RTOL, STEPS, moe_plan


def mixtral_plan(kind: str, name: str = "mixtral", **experts) -> Plan:
    """A transformers MoE returning its aux loss, given labels = the tokens: the model's
    own loss."""
    plan = moe_plan(name, kind, **experts)
    model = dataclasses.replace(
        plan.model, source=f"tests/parallel/moe_models.py:{name}_router_logits", loss="model",
        inputs=(InputSpec("input_ids", "int64", ("batch", "seq")),
                InputSpec("labels", "int64", ("batch", "seq"))))
    return dataclasses.replace(plan, model=model,
                               data=dataclasses.replace(plan.data, inputs=(("labels", "tokens"),)))


PLANS = {  # run pipelined (the example MoE under microbatch: tests/backends/test_equivalence_moe.py)
    ("moe_gpt", "step"): lambda: moe_plan("moe_gpt", "1f1b", balance="step"),
    ("mixtral", "step"): lambda: mixtral_plan("zbv", balance="step"),
    ("mixtral", "microbatch"): lambda: mixtral_plan("zbv"),
}


def _worker(rank, world, configs):
    out = []
    for config in configs:
        trainer = PipelineTrainer.for_plan(PLANS[config]())
        meter = CommMeter({"ep": trainer.layout.groups.ep})  # step 1's EP collectives
        losses = []
        for t in range(STEPS):
            with meter if t == 1 else contextlib.nullcontext():
                losses.append(trainer.step(t).loss)
        out.append((losses, trainer.named_parameters(), meter.calls))
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_balance_step_equals_the_whole_batch_model(spawn):
    configs = list(PLANS)
    results = spawn(_worker, 4, configs, timeout=580)
    runs = {c: ([r[k][0] for r in results], [r[k][1] for r in results])
            for k, c in enumerate(configs)}
    for k, config in enumerate(configs):  # the estimates count the pre-pass's all-to-alls
        estimates = compile_plan(PLANS[config]()).estimates
        for rank, r in enumerate(results):
            key = ("ep", "alltoall")  # none on a rank without MoE layers (Mixtral's rank 0)
            assert r[k][2].get(key, 0) == estimates.ranks[rank].collective_calls.get(key, 0), \
                (config, rank)
        assert any(r[k][2].get(key) for r in results)
    failures = []
    for config in configs:
        ref = train_reference(PLANS[config](), STEPS)
        losses, params = runs[config]
        if config == ("mixtral", "step"):
            # transformers computes its loss in float32 (`logits.float()` in ForCausalLMLoss,
            # float32 router statistics): the whole batch's token mean and the mean of the
            # microbatches' means round differently there (~1e-7), so the loss VALUES are
            # judged at float32's rtol; parameters (gradients in float64 past those ops)
            # at the float64 rule below
            assert losses[0] == pytest.approx(ref.losses, rel=1e-6, abs=0)
            losses = [ref.losses] * len(losses)
        got = compare(ref.losses, ref.params, losses, params, rtol=RTOL, atol=ATOL)
        if not got.within:
            failures.append(f"{config}: " + got.render())
        assert min(ref.grad_norms) > 0 and len(set(ref.losses)) == STEPS  # it trained
    assert not failures, "\n".join(failures)
    # the setting changes the run: the microbatch run (Mixtral) or its reference (the
    # example MoE, whose pipelined microbatch run equals it: test_equivalence_moe.py)
    micro = {"moe_gpt": train_reference(moe_plan("moe_gpt", "1f1b"), STEPS).losses,
             "mixtral": runs[("mixtral", "microbatch")][0][0]}
    for model in ("moe_gpt", "mixtral"):
        step = runs[(model, "step")][0][0]
        assert step[0] != pytest.approx(micro[model][0], rel=1e-9, abs=0)
        assert step[-1] != pytest.approx(micro[model][-1], rel=1e-9, abs=0)
    # Mixtral's step-1 loss is its own `loss` output on the whole global batch (no
    # pipeplan code on this side: transformers' forward given labels)
    plan = PLANS[("mixtral", "step")]()
    model = build_model(plan)
    model.train()
    batch = data.global_batch(plan, 0)
    with torch.no_grad():
        own = model(input_ids=batch.input_ids, labels=batch.input_ids)
    assert own.aux_loss is not None and float(own.aux_loss) > 0
    assert runs[("mixtral", "step")][0][0][0] == pytest.approx(float(own.loss), rel=1e-6,
                                                               abs=0)


HEAVY = {(name, balance): (lambda n=name, b=balance: mixtral_plan("1f1b", n, balance=b))
         for name in ("qwen2_moe", "olmoe") for balance in ("step", "microbatch")}


def _heavy_worker(rank, world, configs):
    out = []
    for config in configs:
        trainer = PipelineTrainer.for_plan(HEAVY[config]())
        out.append(([trainer.step(t).loss for t in range(STEPS)], trainer.named_parameters()))
    return out


@pytest.mark.heavy
@pytest.mark.timeout(1200)
def test_qwen2_moe_and_olmoe_own_loss_under_both_balances(spawn):
    """Qwen2-MoE (shared expert) and OLMoE, their own loss (loss = model, labels) under
    1f1b: `microbatch` equal to the per-chunk reference at the float64 rule; `step` to
    the whole-batch model, its loss values at float32's rtol (transformers' float32 loss,
    see above); the two different."""
    configs = list(HEAVY)
    results = spawn(_heavy_worker, 4, configs, timeout=1180)
    failures, first = [], {}
    for k, config in enumerate(configs):
        ref = train_reference(HEAVY[config](), STEPS)
        losses, params = [r[k][0] for r in results], [r[k][1] for r in results]
        first[config] = losses[0]
        if config[1] == "step":
            assert losses[0] == pytest.approx(ref.losses, rel=1e-6, abs=0)
            losses = [ref.losses] * len(losses)
        got = compare(ref.losses, ref.params, losses, params, rtol=RTOL, atol=ATOL)
        if not got.within:
            failures.append(f"{config}: " + got.render())
    assert not failures, "\n".join(failures)
    for name in ("qwen2_moe", "olmoe"):
        assert first[(name, "step")][-1] != pytest.approx(first[(name, "microbatch")][-1],
                                                          rel=1e-9, abs=0)
