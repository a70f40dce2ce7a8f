"""Token dispatch for expert parallelism: slots, capacity, autograd-aware all-to-all, and
one rank's experts call with its tokens routed (`routed_call`; `static_call` for compiled
stages). Run by the runtime (backends/parallel/ep/experts.py) and, on the measured CPU,
timed by the probe (compiler/estimate/cpu_probe.measure_dispatch): what it costs the host
beyond the experts' own ops is the dispatcher's measured time, not a formula.

A *slot* is one (token, k) pair of the routing: the token's hidden row, the
global expert index `top_k_index[t, j]` and the weight `top_k_weights[t, j]`.
`dispatch_slots` lists them sorted by expert (the slots over an expert's
capacity, if the plan asks, moved after the kept ones, so no shape depends on
the routing before the caller's one host read of the split sizes); the
all-to-alls carry the sorted kept rows to
the ranks holding those experts and back. Their backward is the transposed
all-to-all, so gradients (of the hidden rows and the top-k weights, hence of
the router) equal the undistributed run's.

Capacity (optional, `capacity_factor`): each rank, on its own tokens before
dispatch, keeps at most C = ceil(capacity_factor * T_local * top_k / E) slots
per expert (`drop_policy` "probs": highest weight first; "position": earliest
token first). Dropped slots contribute nothing (the block's residual carries
the token on); kept weights are not renormalised. This is the per-rank capacity
of Megatron-Core and GShard.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ...errors import PipeplanError
from .ep import ExpertShard

DROP_POLICIES = ("probs", "position")


class _AllToAll(torch.autograd.Function):
    """Rows of `x` split by `in_splits` go to each rank; backward is the transpose."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        back = grad.new_empty((sum(ctx.in_splits),) + tuple(grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), ctx.in_splits, ctx.out_splits,
                               group=ctx.group)
        return back, None, None, None


def all_to_all(x: torch.Tensor, out_splits: Sequence[int], in_splits: Sequence[int],
               group) -> torch.Tensor:
    """Differentiable all_to_all_single of rows (identity without a group)."""
    if group is None:
        return x
    return _AllToAll.apply(x, list(out_splits), list(in_splits), group)


def static_dispatch(x: torch.Tensor, ep_size: int, group) -> torch.Tensor:
    """Every row of `x` [S, ...] to every rank of `group`: an all-to-all of equal splits
    (a functional collective, differentiable, traceable); the result [ep*S, ...] holds
    rank r's rows at block r."""
    from torch.distributed import _functional_collectives as funcol

    send = x.repeat((ep_size,) + (1,) * (x.dim() - 1)).contiguous()
    if not x.is_floating_point():
        return funcol.all_to_all_single(send, None, None, group)
    return funcol.all_to_all_single_autograd(send, None, None, group)


def static_combine(terms: torch.Tensor, ep_size: int, group) -> torch.Tensor:
    """The inverse of `static_dispatch`: block r of `terms` back to rank r, then summed
    over the ranks that computed them -> [S, ...]."""
    from torch.distributed import _functional_collectives as funcol

    back = funcol.all_to_all_single_autograd(terms.contiguous(), None, None, group)
    return back.reshape((ep_size, -1) + tuple(terms.shape[1:])).sum(0)


def exchange_counts(send: torch.Tensor, group) -> torch.Tensor:
    """Each rank's per-expert slot counts for every rank: [E] sent -> [E] received, laid out
    as [source rank, local expert]."""
    if group is None:
        return send.clone()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv


# ------------------------------------------------------------------ capacity
def expert_capacity(capacity_factor: float, tokens: int, top_k: int, num_experts: int) -> int:
    return math.ceil(capacity_factor * tokens * top_k / num_experts)


def capacity_keep(top_i: torch.Tensor, top_w: torch.Tensor, num_experts: int,
                  capacity: int, policy: str = "probs") -> torch.Tensor:
    """Bool [T, k]: which routed slots fit their expert's capacity.

    Slots are ranked per expert, "probs": by weight (highest first, earlier token
    first on ties); "position": by token index, then by k. The first
    `capacity` of each expert are kept.
    """
    if policy not in DROP_POLICIES:
        raise PipeplanError(f"unknown drop policy {policy!r} (choose one of {DROP_POLICIES})")
    flat_e = top_i.reshape(-1)
    n = flat_e.numel()
    position = torch.arange(n, device=flat_e.device)  # token-major, then k
    if policy == "probs":
        order = torch.sort(-top_w.detach().reshape(-1), stable=True).indices
    else:
        order = position
    # Stable sort by expert keeps the policy's ranking inside each expert.
    order = order[torch.sort(flat_e[order], stable=True).indices]
    counts = expert_counts(flat_e, num_experts)
    starts = torch.cumsum(counts, 0) - counts
    rank_in_expert = position - starts[flat_e[order]]
    keep = torch.empty(n, dtype=torch.bool, device=flat_e.device)
    keep[order] = rank_in_expert < capacity
    return keep.view_as(top_i)


# --------------------------------------------------------------------- slots
def expert_counts(expert: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Slots per expert, [E] int64 (values in [0, num_experts]; the value num_experts, a
    dropped slot, is not counted). A scatter-add, not `bincount`: on CUDA bincount reads
    the largest value on the host to size its output."""
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=expert.device)
    counts.scatter_add_(0, expert, torch.ones_like(expert))
    return counts[:num_experts]


@dataclass(frozen=True)
class Slots:
    """Every slot of one call, the kept ones first sorted by global expert (stable), the
    dropped ones after them; `counts[e]`: kept slots of expert e. Nothing here is read on
    the host: how many slots are kept is `counts.sum()`, known to the caller only after its
    one host read of the split sizes (`kept(n)`)."""

    token: torch.Tensor  # [T*k] token row of each slot
    expert: torch.Tensor  # [T*k] global expert index (num_experts: dropped)
    weight: torch.Tensor  # [T*k] its top-k weight (differentiable)
    counts: torch.Tensor  # [E] kept slots per expert, on the device

    def kept(self, n: int) -> "Slots":
        """The first `n` slots: the kept ones when n == counts.sum()."""
        return Slots(self.token[:n], self.expert[:n], self.weight[:n], self.counts)


def dispatch_slots(top_k_index: torch.Tensor, top_k_weights: torch.Tensor, num_experts: int,
                   capacity_factor: Optional[float] = None,
                   drop_policy: str = "probs") -> Slots:
    """The routed slots sorted by expert, slots over capacity (if asked) moved last: the
    kept slots in the same order as filtering them out and sorting the rest, without a
    data-dependent shape (a boolean mask would read its count on the host)."""
    tokens, k = top_k_index.shape
    token = torch.arange(tokens, device=top_k_index.device).repeat_interleave(k)
    expert, weight = top_k_index.reshape(-1), top_k_weights.reshape(-1)
    key = expert
    if capacity_factor is not None:
        cap = expert_capacity(capacity_factor, tokens, k, num_experts)
        keep = capacity_keep(top_k_index, top_k_weights, num_experts, cap, drop_policy)
        key = torch.where(keep.reshape(-1), expert, num_experts)
    order = torch.sort(key, stable=True).indices
    return Slots(token[order], key[order], weight[order], expert_counts(key, num_experts))


# ------------------------------------------------------------------- a call
def routed_call(local, shard: ExpertShard, group, hidden: torch.Tensor,
                top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                capacity_factor: Optional[float] = None,
                drop_policy: str = "probs") -> torch.Tensor:
    """One rank's experts call with its tokens routed (the dynamic dispatch): the slots
    sorted by expert (over capacity dropped, if asked), the counts exchanged, the kept
    slots' rows and weights sent to the ranks holding their experts, `local` (the model's
    own experts module on `shard`'s experts) run on the received rows one slot per row,
    and the terms sent back and summed per token. `group` None: this rank holds every
    expert (a capacity without expert parallelism)."""
    s = shard
    routed = dispatch_slots(top_k_index, top_k_weights, s.num_experts, capacity_factor,
                            drop_policy)
    recv_per_expert = exchange_counts(routed.counts, group).view(s.ep_size, s.local)
    # The one host read of the call: all_to_all_single takes its split sizes as host
    # integers, and they depend on the routing (docs/runtime.md, host synchronisation).
    send, recv = torch.stack([routed.counts.view(s.ep_size, s.local).sum(1),
                              recv_per_expert.sum(1)]).tolist()
    slots = routed.kept(sum(send))

    rows = all_to_all(hidden[slots.token], recv, send, group)
    weights = all_to_all(slots.weight, recv, send, group)
    # received rows come grouped by source rank, then by local expert
    local_ids = torch.arange(s.local, device=hidden.device).repeat(s.ep_size)
    index = local_ids.repeat_interleave(recv_per_expert.reshape(-1), output_size=sum(recv))
    terms = local(rows, index.unsqueeze(-1), weights.unsqueeze(-1))
    back = all_to_all(terms, send, recv, group)
    return back.new_zeros(hidden.shape).index_add(0, slots.token, back)


def static_call(local, shard: ExpertShard, group, hidden: torch.Tensor,
                top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """The static dispatch (compiled stages: fixed shapes, no host read): every slot to
    every rank of `group`, each computing the terms of its own experts' slots (weight 0
    elsewhere), the terms back and summed over the ranks."""
    s = shard
    tokens, k = top_k_index.shape
    token = torch.arange(tokens, device=hidden.device).repeat_interleave(k)
    rows = static_dispatch(hidden[token], s.ep_size, group)
    weights = static_dispatch(top_k_weights.reshape(-1), s.ep_size, group)
    expert = static_dispatch(top_k_index.reshape(-1), s.ep_size, group)
    mine = (expert >= s.first) & (expert < s.stop)
    index = torch.where(mine, expert - s.first, 0)
    weights = torch.where(mine, weights, torch.zeros_like(weights))
    terms = local(rows, index.unsqueeze(-1), weights.unsqueeze(-1))
    back = static_combine(terms, s.ep_size, group)
    return back.new_zeros(hidden.shape).index_add(0, token, back)
