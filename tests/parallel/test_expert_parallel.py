"""Expert parallel runs the model's own experts module: outputs and every gradient equal it.

Each experts module (transformers' Mixtral, Qwen2-MoE, OLMoE; pipeplan's example
GELU and SiLU experts), in float64, on 1 and 2 gloo ranks: the reference is the
unmodified experts module called on the concatenated tokens of all ranks with
their routing; each rank's `ExpertParallelExperts` sees only its own tokens and
holds half of the experts.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from pipeplan.compiler.parallel.ep_dispatch import capacity_keep, expert_capacity
from pipeplan.backends.parallel.ep.experts import (ExpertParallelExperts, expert_shard, gather_experts)
from pipeplan.compiler.parallel.ep import find_experts, offers_interface
from pipeplan.errors import PipeplanError

from .moe_models import MODELS, experts_of

T, D, E, K = 6, 32, 4, 2
TOL = dict(rtol=1e-9, atol=1e-12)


def _routing(world: int):
    g = torch.Generator().manual_seed(3)
    h = torch.randn(world, T, D, dtype=torch.float64, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(world * T)])
    w = torch.rand(world * T, K, dtype=torch.float64, generator=g)
    cot = torch.randn(world, T, D, dtype=torch.float64, generator=g)
    return h, idx.view(world, T, K), w.view(world, T, K), cot


def _keep(idx, w, capacity_factor):
    if capacity_factor is None:
        return torch.ones_like(w)
    cap = expert_capacity(capacity_factor, T, K, E)
    return torch.stack([capacity_keep(i, x, E, cap).to(w.dtype) for i, x in zip(idx, w)])


def _compare_worker(rank, world, name, capacity_factor):
    group = dist.group.WORLD if world > 1 else None
    experts = experts_of(name)
    h, idx, w, cot = _routing(world)
    # reference: the model's module on every rank's tokens; dropped slots weigh 0
    hr, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
    keep = _keep(idx, w, capacity_factor)
    out_ref = experts(hr.view(-1, D), idx.view(-1, K), (wr * keep).view(-1, K)).view(world, T, D)
    (out_ref * cot).sum().backward()

    layer = ExpertParallelExperts(experts, E, group, capacity_factor)
    x, wx = h[rank].clone().requires_grad_(), w[rank].clone().requires_grad_()
    out = layer(x, idx[rank], wx)
    (out * cot[rank]).sum().backward()
    torch.testing.assert_close(out, out_ref[rank].detach(), **TOL)
    torch.testing.assert_close(x.grad, hr.grad[rank], **TOL)
    torch.testing.assert_close(wx.grad, wr.grad[rank], **TOL)
    s = layer.shard
    for (n, p), (m, q) in zip(layer.named_parameters(), experts.named_parameters()):
        assert n == m and p.shape[0] == s.local
        torch.testing.assert_close(p.grad, q.grad[s.first:s.stop], **TOL)
    full = gather_experts(layer)
    assert all(torch.equal(full[n], q.detach()) for n, q in experts.named_parameters())


@pytest.mark.parametrize("name", sorted(MODELS))
def test_one_rank_equals_the_models_experts(name):
    _compare_worker(0, 1, name, None)


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "olmoe", "silu_moe_gpt"])
def test_two_ranks_equal_the_models_experts(run_workers, name):
    run_workers(_compare_worker, 2, name, None)


def test_capacity_drops_slots_and_equals_the_masked_reference(run_workers):
    run_workers(_compare_worker, 2, "mixtral", 0.5)
    h, idx, w, _ = _routing(1)
    assert 0 < int((_keep(idx, w, 0.5) == 0).sum()) < w.numel()  # the case drops some slots


def test_silu_experts_differ_from_gelu():
    """The SiLU model's experts are its own: running them as GELU would change the output."""
    silu, gelu = experts_of("silu_moe_gpt"), experts_of("moe_gpt")
    h, idx, w, _ = _routing(1)
    assert torch.equal(silu.w_up, gelu.w_up)
    assert not torch.allclose(silu(h[0], idx[0], w[0]), gelu(h[0], idx[0], w[0]))


def test_capacity_keep_by_probs_and_by_position():
    # 4 tokens, top-1, 2 experts; expert 0 gets tokens 0, 1, 3; capacity 2.
    top_i = torch.tensor([[0], [0], [1], [0]])
    top_w = torch.tensor([[0.2], [0.9], [0.5], [0.7]])
    assert capacity_keep(top_i, top_w, 2, 2, "probs").reshape(-1).tolist() == \
        [False, True, True, True]
    assert capacity_keep(top_i, top_w, 2, 2, "position").reshape(-1).tolist() == \
        [True, True, True, False]


def test_shard_mapping_and_errors():
    s = expert_shard(8, 4, 2)
    assert (s.first, s.stop, s.global_index(1)) == (4, 6, 5)
    with pytest.raises(PipeplanError, match="does not divide the 6 experts"):
        expert_shard(6, 4, 0)
    with pytest.raises(PipeplanError, match="unknown drop policy"):
        capacity_keep(torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1), 2, 1, "random")


def test_the_runtime_takes_the_compiled_placement():
    """The compiled plan names each layer's experts module and each rank's experts; the
    runtime shards what it names, refuses placements its layout cannot hold, and a plan that
    distributes experts needs the placement."""
    from pipeplan.backends.parallel import build_parallel_groups, parallelize_stage
    from pipeplan.compiler.parallel.ep import place_experts
    from pipeplan.dsl.ast import ExpertsSpec, MeshSpec, ModelSpec, Plan
    from pipeplan.examples.models.moe_gpt import MoEGPT
    model = MoEGPT(vocab=32, dim=16, layers=2, heads=2, seq_len=8, num_experts=4)
    plan = Plan(model=ModelSpec("m.py:M"), mesh=MeshSpec(dp=2, ep=2),
                experts=ExpertsSpec(modules=("layers.*.moe",), num_experts=4, top_k=2))
    placed = place_experts(plan, model)
    assert [(p.module, p.experts, p.shards) for p in placed] == [
        ("layers.0.moe", "layers.0.moe.experts", ((0, 1), (2, 3))),
        ("layers.1.moe", "layers.1.moe.experts", ((0, 1), (2, 3)))]
    experts = model.layers[0].moe.experts
    with pytest.raises(PipeplanError, match=r"places experts \[1, 0, 2, 3\] on expert-parallel "
                                            r"rank 0; this runtime holds contiguous blocks"):
        ExpertParallelExperts(experts, 4, None, indices=(1, 0, 2, 3))
    with pytest.raises(PipeplanError, match="no expert placement was given"):
        capacity = dataclasses.replace(plan.experts, dropless=False, capacity_factor=1.0)
        parallelize_stage(model, Plan(model=plan.model, experts=capacity),  # ep 1, capacity
                          build_parallel_groups(MeshSpec()))


def test_interface_is_found_by_structure():
    from tests.compiler.models import LoopMoE
    for name in MODELS:
        torch.manual_seed(0)
        model = MODELS[name]()
        layer = next(m for n, m in model.named_modules() if n.endswith(("mlp", "moe")))
        assert find_experts(layer, E) == "experts", name
        assert not offers_interface(layer, E)  # the router lives beside the experts
        assert find_experts(layer, 8) is None  # the stacked dim must be num_experts
    assert find_experts(LoopMoE(8, 4, 2), 4) is None  # a ModuleList of Linear experts
