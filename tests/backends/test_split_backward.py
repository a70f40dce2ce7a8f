"""Split backward (B then W, W reusing B's work) gives exactly the full backward's gradients;
the time model counts the autograd calls its W makes."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from pipeplan.backends.runtime.split_backward import backward_input, backward_weight, plan_split
from pipeplan.compiler import compile_plan
from pipeplan.dsl import load_plan
from pipeplan.examples.models.gpt import Block

REPO = Path(__file__).resolve().parents[2]


def full_grads(y, g, x, params):
    return torch.autograd.grad([y], [x] + list(params), [g], retain_graph=True, allow_unused=True)


def split_grads(plan, y, g, x, params):
    (dx,) = backward_input(plan, [y], [g], [x])
    by_id = backward_weight(plan, [y], [g])
    return [dx] + [by_id.get(id(p)) for p in params]


def test_transformer_blocks_split_exactly():
    torch.manual_seed(0)
    blocks = nn.Sequential(Block(16, 2, 32), Block(16, 2, 32))
    params = list(blocks.parameters())
    x = torch.randn(2, 5, 16, requires_grad=True)
    y = blocks(x)
    g = torch.randn_like(y)
    want = full_grads(y, g, x, params)
    plan = plan_split([y], [x], params)
    assert plan is not None and len(plan.seeds) >= 12  # every Linear and LayerNorm branch
    assert not plan.free_roots
    got = split_grads(plan, y, g, x, params)
    for w, h in zip(want, got):
        torch.testing.assert_close(h, w, rtol=0, atol=0)


def test_stage_without_inputs_computes_everything_in_w():
    emb = nn.Embedding(10, 4)
    lin = nn.Linear(4, 4)
    y = lin(emb(torch.tensor([[1, 2, 3]])))
    g = torch.randn_like(y)
    params = list(emb.parameters()) + list(lin.parameters())
    plan = plan_split([y], [], params)
    assert plan.seeds == [] and plan.free_roots == [0]
    by_id = backward_weight(plan, [y], [g])
    want = torch.autograd.grad([y], params, [g], retain_graph=True)
    for p, w in zip(params, want):
        torch.testing.assert_close(by_id[id(p)], w, rtol=0, atol=0)


def test_weight_used_above_and_below_falls_back():
    lin = nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True)
    y = lin(torch.tanh(lin(x)))  # the same weight on both sides of the outer use
    assert plan_split([y], [x], list(lin.parameters())) is None


def test_weight_used_twice_side_by_side_still_splits():
    lin = nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True)
    y = lin(x) * lin(x * 2)  # two uses, neither below the other
    g = torch.randn_like(y)
    params = list(lin.parameters())
    plan = plan_split([y], [x], params)
    assert plan is not None
    for w, h in zip(full_grads(y, g, x, params), split_grads(plan, y, g, x, params)):
        torch.testing.assert_close(h, w)


def test_split_cache_maps_one_analysis_onto_every_graph_of_the_shape():
    from pipeplan.backends.runtime.split_backward import SplitCache
    torch.manual_seed(0)
    blocks = nn.Sequential(Block(16, 2, 32), Block(16, 2, 32))
    params = list(blocks.parameters())
    cache = SplitCache(params)
    for mb in range(3):  # fresh graphs of one shape: one analysis, seeds mapped by position
        x = torch.randn(2, 5, 16, requires_grad=True)
        y = blocks(x)
        want, got = plan_split([y], [x], params), cache.plan([y], [x])
        assert [s.node for s in got.seeds] == [s.node for s in want.seeds]
        assert [s.params for s in got.seeds] == [s.params for s in want.seeds]
        assert (got.free_roots, got.free_params) == (want.free_roots, want.free_params)
    assert len(cache._plans) == 1
    x = torch.randn(2, 5, 16, requires_grad=True)
    y = blocks[0](x)  # another shape: analysed anew, never mapped onto the old seeds
    assert [s.node for s in cache.plan([y], [x]).seeds] == \
        [s.node for s in plan_split([y], [x], params).seeds]
    assert len(cache._plans) == 2


FAMILY = """\
model {{
  source = "pipeplan.tests.parallel.families:{factory}"
  args = {{ layers = 4 }}
  inputs = {{ input_ids = int64[batch, seq] }}
  capture = export
}}
data = synthetic(seed = 7, vocab = 64, seq_len = 16)
mesh {{ pp = 2 }}
pipeline {{ schedule = zbh1, microbatches = 2 }}
train {{ steps = 1, global_batch = 4 }}
"""


def _plan(tmp_path, which: str):
    if which == "gpt":
        return load_plan(str(REPO / "examples" / "gpt_pp4_1f1b.plan"),
                         overrides=["pipeline.schedule=zbh1"])
    path = tmp_path / f"{which}.plan"
    path.write_text(FAMILY.format(factory=which))
    return load_plan(str(path))


def _value(v) -> torch.Tensor:
    """A value received from the stage before: floats random, masks all true, ids zero."""
    dtype = getattr(torch, v.dtype)
    if dtype.is_floating_point:
        return torch.randn(v.shape, dtype=dtype)
    return torch.ones(v.shape, dtype=dtype) if dtype == torch.bool else \
        torch.zeros(v.shape, dtype=dtype)


def _runtime_calls(spec, last: bool, outputs: dict, rows: int, seq: int) -> tuple:
    """(W's autograd calls, whether B sends a gradient back) in the runtime, one microbatch."""
    from pipeplan.backends.runtime.stage import StageRunner
    module = spec.module.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.02)
    runner = StageRunner(spec, module, last)
    inputs = [torch.randint(0, 8, (rows, seq)) if r.source == "batch" else
              _value(outputs[r.name]) for r in spec.inputs]
    runner.forward(0, inputs)
    grads = None if last else [torch.randn(v.shape) for v in spec.outputs]
    sent = runner.backward_input(0, grads)
    split = runner._saved[0].split
    assert (split is not None) == bool(sent)  # none to plan where B sends nothing back
    calls = len(split.seeds) + int(bool(split.free_roots and split.free_params)) if sent else 1
    runner.backward_weight(0)
    return calls, bool(sent)


@pytest.mark.parametrize("which", ["gpt", "llama", "gemma2"])
def test_the_time_model_counts_the_calls_a_separate_w_makes(tmp_path, which):
    """What the time model charges a separate W per call (optime.weight_seeds, counted in
    the stage's FX graph) is the calls the runtime's W makes (its seeds, counted on the
    autograd graph of a real forward, and one for outputs off the inputs' path); the stage
    the time model says no gradient leaves is the one whose B sends none back: the
    example GPT's 4 stages, a Llama's and a Gemma 2's 2 (export capture)."""
    plan = _plan(tmp_path, which)
    compiled = compile_plan(plan)
    outputs = {v.name: v for st in compiled.stages for v in st.outputs}
    rows = plan.train.global_batch // (plan.mesh.dp * plan.microbatches)
    counted = []
    for spec, work in zip(compiled.stages, compiled.estimates.timing.work):
        last = spec.index == len(compiled.stages) - 1
        calls, sent = _runtime_calls(spec, last, outputs, rows, plan.data.seq_len)
        assert work.input_grads == sent
        if sent:
            counted.append((work.seeds, calls))
    assert counted and all(model == runtime > 0 for model, runtime in counted), counted
