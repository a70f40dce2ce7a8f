"""Expert parallel MoE equals the dense reference MoE (outputs, aux, every gradient)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from pipeplan.backends.expert_parallel import (
    ExpertParallelMoE, capacity_keep, expert_capacity, expert_shard, gather_experts)
from pipeplan.errors import PipeplanError
from pipeplan.examples.models.moe_gpt import MoE

D, H, BATCH, SEQ = 16, 32, 2, 5
TOL = dict(rtol=1e-5, atol=1e-6)


def reference(moe: MoE, x_all: torch.Tensor, capacity_factor=None, policy="probs"):
    """Dense reference on the concatenated tokens of all ranks ([ranks, b, t, d]).

    With a capacity factor, each rank's chunk keeps the slots that fit, as the
    same per-rank capacity semantics say; aux uses the routing before dropping.
    """
    ranks = x_all.shape[0]
    tokens = x_all.reshape(-1, D)
    gates, aux = moe.route(tokens)
    if capacity_factor is not None:
        logits = moe.router(tokens)
        top_p, top_i = logits.softmax(-1).topk(moe.top_k, dim=-1)
        top_w = top_p / top_p.sum(-1, keepdim=True)
        per_rank = tokens.shape[0] // ranks
        cap = expert_capacity(capacity_factor, per_rank, moe.top_k, moe.num_experts)
        keep = torch.cat([capacity_keep(i, w, moe.num_experts, cap, policy) for i, w in
                          zip(top_i.split(per_rank), top_w.split(per_rank))])
        gates = torch.zeros_like(gates).scatter(-1, top_i, top_w * keep)
    out = torch.einsum("te,ted->td", gates, moe.experts(tokens))
    return out.reshape(x_all.shape), aux


def _compare_worker(rank, world, cases):
    group = dist.group.WORLD if world > 1 else None
    for num_experts, top_k, capacity_factor, policy in cases:
        torch.manual_seed(0)
        ref = MoE(D, H, num_experts, top_k, aux_loss=0.01, z_loss=0.001)
        x_all = torch.randn(world, BATCH, SEQ, D)
        g_all = torch.randn(world, BATCH, SEQ, D)
        layer = ExpertParallelMoE(copy.deepcopy(ref), group, capacity_factor, policy)

        xr = x_all.clone().requires_grad_()
        out_ref, aux_ref = reference(ref, xr, capacity_factor, policy)
        ((out_ref * g_all).sum() + aux_ref).backward()

        x = x_all[rank].clone().requires_grad_()
        out, aux = layer(x)
        ((out * g_all[rank]).sum() + aux / world).backward()

        case = f"E={num_experts} k={top_k} cap={capacity_factor} {policy} rank {rank}"
        torch.testing.assert_close(out, out_ref[rank].detach(), **TOL, msg=case)
        torch.testing.assert_close(aux, aux_ref.detach(), **TOL, msg=case)
        torch.testing.assert_close(x.grad, xr.grad[rank], **TOL, msg=case)
        router_grad = layer.router.weight.grad.clone()
        if group is not None:
            dist.all_reduce(router_grad, group=group)
        torch.testing.assert_close(router_grad, ref.router.weight.grad, **TOL, msg=case)
        s = layer.shard
        torch.testing.assert_close(layer.w_up.grad, ref.w_up.grad[s.first:s.stop], **TOL, msg=case)
        torch.testing.assert_close(layer.w_down.grad, ref.w_down.grad[s.first:s.stop], **TOL,
                                   msg=case)
        full = gather_experts(layer)
        assert torch.equal(full["w_up"], ref.w_up.detach()), case
        assert torch.equal(full["w_down"], ref.w_down.detach()), case
        assert set(layer.state_dict()) == set(ref.state_dict()), case


CASES = [
    (8, 2, None, "probs"),  # dropless
    (8, 2, 1.0, "probs"),  # capacity: drops some slots
    (8, 2, 0.5, "position"),
    (4, 1, None, "probs"),
]


def test_single_process_layer_equals_dense_reference():
    _compare_worker(0, 1, CASES)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_equals_reference(run_workers, world):
    run_workers(_compare_worker, world, CASES)


def test_capacity_keep_by_probs_and_by_position():
    # 4 tokens, top-1, 2 experts; expert 0 gets tokens 0, 1, 3; capacity 2.
    top_i = torch.tensor([[0], [0], [1], [0]])
    top_w = torch.tensor([[0.2], [0.9], [0.5], [0.7]])
    by_probs = capacity_keep(top_i, top_w, 2, 2, "probs")
    by_pos = capacity_keep(top_i, top_w, 2, 2, "position")
    assert by_probs.reshape(-1).tolist() == [False, True, True, True]
    assert by_pos.reshape(-1).tolist() == [True, True, True, False]


def test_capacity_drops_something_in_the_test_cases():
    """Guards the capacity cases above against silently dropping nothing."""
    torch.manual_seed(0)
    ref = MoE(D, H, 8, 2)
    tokens = torch.randn(BATCH * SEQ, D)
    top_p, top_i = ref.router(tokens).softmax(-1).topk(2, dim=-1)
    keep = capacity_keep(top_i, top_p, 8, expert_capacity(1.0, BATCH * SEQ, 2, 8))
    assert 0 < int((~keep).sum()) < keep.numel()


def test_shard_mapping_and_errors():
    s = expert_shard(8, 4, 2)
    assert (s.first, s.stop, s.global_index(1)) == (4, 6, 5)
    with pytest.raises(PipeplanError, match="does not divide the 6 experts"):
        expert_shard(6, 4, 0)
    with pytest.raises(PipeplanError, match="unknown drop policy"):
        capacity_keep(torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1), 2, 1, "random")
    with pytest.raises(PipeplanError, match="stacked-expert MoE"):
        ExpertParallelMoE(torch.nn.Linear(2, 2))


def test_shards_are_the_compilers_placement():
    from pipeplan.compiler.experts import place_experts
    from pipeplan.dsl.ast import ExpertsSpec, MeshSpec, ModelSpec, Plan
    from pipeplan.examples.models.moe_gpt import MoEGPT

    plan = Plan(model=ModelSpec(source="m.py:MoEGPT"), mesh=MeshSpec(dp=4, ep=4),
                experts=ExpertsSpec(modules=("layers.*.moe",), num_experts=8))
    model = MoEGPT(vocab=32, dim=16, layers=2, heads=2, seq_len=8, num_experts=8)
    for placement in place_experts(plan, model):
        assert placement.shards == tuple(
            tuple(range(expert_shard(8, 4, r).first, expert_shard(8, 4, r).stop))
            for r in range(4))
