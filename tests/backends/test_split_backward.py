"""Split backward (B then W, W reusing B's work) gives exactly the full backward's gradients."""
from __future__ import annotations

import torch
from torch import nn

from pipeplan.backends.runtime.split_backward import backward_input, backward_weight, plan_split
from pipeplan.examples.models.gpt import Block


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
