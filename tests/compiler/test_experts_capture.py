"""The experts call stays one opaque call of the model's own module, under export and fx.

transformers' MoE models are captured by torch.export, which inlines every
module; pipeplan keeps each layer's `experts(h, top_k_index, top_k_weights)`
call as one `call_module` node on the model's own experts module (its
parameters under their original names), and the stage graphs still compute
exactly the model's loss and gradients.
"""
from __future__ import annotations

import pytest
import torch

from pipeplan.compiler import compile_plan
from pipeplan.compiler.capture.loss import reference_loss
from pipeplan.dsl.ast import ExpertsSpec

from ..parallel.moe_models import MODELS, MOE_LAYERS


def _grouped_mm_mixtral():
    """transformers' default experts kernel (grouped_mm, float32: no float64 CPU kernel);
    its meta kernel demands bf16, so the meta run takes the captured value."""
    from tests.compiler.models import tiny_mixtral
    return tiny_mixtral(layers=2)


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "moe_gpt", "grouped_mm"])
def test_one_call_of_the_models_experts_module(make_plan, chain, name):
    source = "tests/compiler/models.py:tiny_mixtral" if name == "grouped_mm" else \
        f"tests/parallel/moe_models.py:{name}"
    plan = make_plan(source, {"layers": 2} if name == "grouped_mm" else {}, pp=2, seq_len=8,
                     experts=ExpertsSpec(modules=(MOE_LAYERS.get(name, "model.layers.*.mlp"),),
                                         num_experts=4, top_k=2),
                     model_fields={"capture": "fx" if name == "moe_gpt" else "export"})
    torch.manual_seed(0)
    model = _grouped_mm_mixtral() if name == "grouped_mm" else MODELS[name]()
    compiled = compile_plan(plan, model)
    assert compiled.capture == ("fx" if name == "moe_gpt" else "export")
    experts = {n: m for n, m in model.named_modules() if n.endswith(".experts")}
    calls = [n for st in compiled.stages for n in st.module.graph.nodes
             if n.op == "call_module" and n.target in experts]
    assert sorted(n.target for n in calls) == sorted(experts)  # each exactly once
    for st in compiled.stages:
        for n in st.module.graph.nodes:
            if n.op == "call_module" and n.target in experts:
                assert st.module.get_submodule(n.target) is experts[n.target]  # the model's own
    names = {n for st in compiled.stages for n, _ in st.module.named_parameters()}
    assert {f"{e}.{p}" for e, m in experts.items() for p, _ in m.named_parameters()} <= names

    g = torch.Generator().manual_seed(1)
    batch = {"input_ids": torch.randint(0, 64, (2, 8), generator=g),
             "targets": torch.randint(0, 64, (2, 8), generator=g)}
    loss = chain(compiled, batch)
    loss.backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    want = reference_loss("cross_entropy", model(batch["input_ids"]), batch["targets"])
    want.backward()
    tol = dict(rtol=1e-5, atol=1e-6) if name == "grouped_mm" else dict(rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(loss, want, **tol)
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[n], p.grad, **tol, msg=n)
