"""Bytes through each collective, counted at the dispatcher, equal the hand-derived counts."""
from __future__ import annotations


import pytest
import torch
import torch.distributed as dist

from pipeplan.backends.parallel.ep.experts import ExpertParallelExperts
from .comm_meter import CommMeter
import torch.fx as fx

from pipeplan.backends.parallel.tp import TensorParallelRules, apply_tensor_parallel
from pipeplan.examples.models.gpt import Block
from pipeplan.examples.models.moe_gpt import MoE

B, T, D = 2, 4, 16
ACT = B * T * D * 4  # bytes of one [b, t, d] fp32 activation


def _tp_worker(rank, world, sequence_parallel):
    group = dist.group.WORLD
    torch.manual_seed(0)
    block = fx.symbolic_trace(Block(D, 2, 2 * D))
    rules = TensorParallelRules(column=("attn.q", "attn.k", "attn.v", "mlp.up"),
                                row=("attn.proj", "mlp.down"), sequence_parallel=sequence_parallel)
    apply_tensor_parallel(block, rules, group)
    x = torch.randn(B, T, D, requires_grad=True)
    with CommMeter({"tp": group}) as meter:
        block(x).sum().backward()
    if not sequence_parallel:
        # forward: g after attn.proj and mlp.down; backward: f before attention (q, k, v
        # share one) and before mlp.up.
        assert meter.bytes == {("tp", "allreduce"): 4 * ACT}, meter.bytes
        assert meter.calls == {("tp", "allreduce"): 4}
    else:
        shard = ACT // world
        # The block's input arrives whole (stages exchange full tensors), so attention's
        # entry needs no gather; its input gradient is all-reduced. Forward: attn.proj and
        # mlp.down reduce-scatter to sequence shards, mlp.up's entry and the exit
        # all-gather. Backward: the row outputs' and the residual's slice all-gather,
        # mlp.up's entry reduce-scatters.
        print(meter.bytes, meter.calls)
        assert meter.bytes == {("tp", "allreduce"): ACT, ("tp", "allgather"): 5 * shard,
                               ("tp", "reduce_scatter"): 3 * ACT}, meter.bytes


def _ep_worker(rank, world):
    group = dist.group.WORLD
    experts, k, tokens = 8, 2, B * T
    torch.manual_seed(0)
    moe = MoE(D, 2 * D, experts, k)
    layer = ExpertParallelExperts(moe.experts, experts, group)
    x = torch.randn(B * T, D, requires_grad=True)
    with CommMeter({"ep": group}) as meter:
        top_w, top_i, aux = moe.route(x)
        (layer(x, top_i, top_w).sum() + aux).backward()
    slots = tokens * k
    rows = slots * D * 4  # every routed slot's row, dropless
    # Per rank: counts (int64 per expert) once; rows and their weights out, rows back
    # forward, and the transposes backward. Only the group total of rows received is fixed
    # by the routing, so the all-to-all bytes are checked summed over the group. The aux
    # loss is the model's own, over its call's tokens: no collective.
    a2a = torch.tensor(meter.bytes[("ep", "alltoall")])
    dist.all_reduce(a2a)
    assert int(a2a) == world * (experts * 8 + 4 * rows + 2 * slots * 4)
    assert ("ep", "allreduce") not in meter.bytes


@pytest.mark.slow
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tensor_parallel_block_bytes(run_workers, sequence_parallel):
    run_workers(_tp_worker, 2, sequence_parallel)


@pytest.mark.slow
def test_expert_parallel_bytes(run_workers):
    run_workers(_ep_worker, 2)


def _ep_static_worker(rank, world):
    group = dist.group.WORLD
    experts, k, tokens = 8, 2, B * T
    torch.manual_seed(0)
    moe = MoE(D, 2 * D, experts, k)
    layer = ExpertParallelExperts(moe.experts, experts, group, static=True)
    x = torch.randn(B * T, D, requires_grad=True)
    with CommMeter({"ep": group}) as meter:
        top_w, top_i, aux = moe.route(x)
        (layer(x, top_i, top_w).sum() + aux).backward()
    slots = tokens * k
    rows = slots * D * 4
    # Compiled stages' static dispatch: every slot to every rank, whatever the routing, so
    # each rank's bytes are fixed: rows out and terms back (forward), their transposes
    # (backward), the weights out and their gradient back, the int64 indices out; no counts.
    assert meter.bytes == {("ep", "alltoall"): world * (4 * rows + 2 * slots * 4 + slots * 8)}
    assert meter.calls == {("ep", "alltoall"): 7}


@pytest.mark.slow
def test_expert_parallel_static_dispatch_bytes(run_workers):
    run_workers(_ep_static_worker, 2)
