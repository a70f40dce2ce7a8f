"""Expert parallelism: a MoE layer whose experts are sharded over an EP process group.

`ExpertParallelMoE` replaces a stacked-expert MoE layer (the layout of
`examples/models/moe_gpt.py:MoE`: a `router` Linear, `w_up[E, D, H]`,
`w_down[E, H, D]`, gelu MLP experts, top-k gates renormalised, aux =
load-balancing + router z-loss). Each EP rank keeps the router whole and only
its contiguous block of experts:

    ep rank r holds global experts [r * E/ep, (r+1) * E/ep)
    local w_up[i] == global w_up[r * E/ep + i]          (same for w_down)

The parameter names stay `w_up` / `w_down` (so a rank's state_dict keys equal
the reference model's); only dim 0 is the local slice. `ExpertShard` states
the mapping and `gather_experts` rebuilds the full stacked tensors.

Forward, per rank (every rank holds different tokens):
  1. route the local tokens (same ops as the reference: bitwise the same gates);
  2. optionally drop the slots over an expert's capacity (`capacity_keep`);
  3. sort slots by expert, exchange per-expert counts (`all_to_all_single`),
     then the token rows themselves;
  4. run each local expert on exactly the rows routed to it;
  5. send the results back with the inverse all-to-all and add them, weighted
     by their gates, into the token order the layer was given.
Both all-to-alls are autograd Functions whose backward is the transposed
all-to-all, so gradients of router and experts equal the dense reference's.

"Global" aux statistics: the load-balancing fractions f_e, mean router
probabilities P_e and the z-loss mean are taken over the tokens of ALL ranks
of the EP group in this call (one microbatch on each rank), exactly as the
dense reference layer computes them on the concatenation of those tokens in
EP-rank order. Every rank returns that same aux value. Its backward all-reduces
(sums) the gradient over the group, so if every rank adds aux / ep to its loss,
the gradients summed over the group equal those of the reference objective
`sum_r loss_r + aux`; with the runtime's DP scaling (each rank's loss divided by
dp, gradients summed) a rank adds aux as is and the result is the reference's
`mean_r loss_r + aux`.

Capacity (optional, `capacity_factor`): each rank, on its own tokens before
dispatch, keeps at most C = ceil(capacity_factor * T_local * top_k / E) slots
per expert (`drop_policy` "probs": highest gate first; "position": earliest
token first). Dropped slots contribute nothing (the block's residual carries
the token on); kept gates are not renormalised. Aux statistics use the routing
before dropping. This is the per-rank capacity of Megatron-Core and GShard.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..errors import PipeplanError

DROP_POLICIES = ("probs", "position")


# ------------------------------------------------------------------ placement
@dataclass(frozen=True)
class ExpertShard:
    """The contiguous block of global experts one EP rank holds."""

    num_experts: int
    ep_size: int
    ep_rank: int

    @property
    def local(self) -> int:
        return self.num_experts // self.ep_size

    @property
    def first(self) -> int:
        return self.ep_rank * self.local

    @property
    def stop(self) -> int:
        return self.first + self.local

    def global_index(self, local_index: int) -> int:
        return self.first + local_index


def expert_shard(num_experts: int, ep_size: int, ep_rank: int) -> ExpertShard:
    if ep_size < 1 or num_experts % ep_size:
        raise PipeplanError(
            f"expert parallel size {ep_size} does not divide the {num_experts} experts "
            f"(choose mesh.ep among the divisors of {num_experts})")
    return ExpertShard(num_experts, ep_size, ep_rank)



# ------------------------------------------------- autograd-aware collectives
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


class _AllReduceSum(torch.autograd.Function):
    """Sum over `group`; backward sums the gradient over `grad_group`.

    `grad_group`: the ranks whose copies of the result enter *different* losses
    (the EP group). Ranks that hold copies of one loss (tensor-parallel peers)
    each pass back only their own copy's gradient (None: no reduction).
    """

    @staticmethod
    def forward(ctx, x, group, grad_group):
        ctx.grad_group = grad_group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        if ctx.grad_group is not None:
            dist.all_reduce(grad, group=ctx.grad_group)
        return grad, None, None


def all_to_all(x: torch.Tensor, out_splits: Sequence[int], in_splits: Sequence[int],
               group) -> torch.Tensor:
    return _AllToAll.apply(x, list(out_splits), list(in_splits), group)


def all_reduce_sum(x: torch.Tensor, group, grad_group) -> torch.Tensor:
    return _AllReduceSum.apply(x, group, grad_group)


# -------------------------------------------------------------------- routing
@dataclass(frozen=True)
class Routing:
    """One call's routing of T local tokens to top-k experts."""

    logits: torch.Tensor  # [T, E] router logits
    probs: torch.Tensor  # [T, E] softmax
    top_i: torch.Tensor  # [T, k] chosen experts
    top_w: torch.Tensor  # [T, k] renormalised gates of the chosen experts


def route(router: nn.Module, tokens: torch.Tensor, top_k: int) -> Routing:
    """The reference's routing ops, in the same order (so gates are bitwise equal)."""
    logits = router(tokens)
    probs = logits.softmax(dim=-1)
    top_p, top_i = probs.topk(top_k, dim=-1)
    top_w = top_p / top_p.sum(dim=-1, keepdim=True)
    return Routing(logits, probs, top_i, top_w)


def expert_capacity(capacity_factor: float, tokens: int, top_k: int, num_experts: int) -> int:
    return math.ceil(capacity_factor * tokens * top_k / num_experts)


def capacity_keep(top_i: torch.Tensor, top_w: torch.Tensor, num_experts: int,
                  capacity: int, policy: str = "probs") -> torch.Tensor:
    """Bool [T, k]: which routed slots fit their expert's capacity.

    Slots are ranked per expert, "probs": by gate (highest first, earlier token
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
    counts = torch.bincount(flat_e, minlength=num_experts)
    starts = torch.cumsum(counts, 0) - counts
    rank_in_expert = position - starts[flat_e[order]]
    keep = torch.empty(n, dtype=torch.bool, device=flat_e.device)
    keep[order] = rank_in_expert < capacity
    return keep.view_as(top_i)


def aux_loss(routing: Routing, num_experts: int, top_k: int, aux_coef: float,
             z_coef: float, group=None, grad_group=None) -> torch.Tensor:
    """Load-balancing + z-loss over the tokens of every rank in `group` (None: local).

    `grad_group`: the ranks of `group` whose losses are distinct (see _AllReduceSum).
    """
    chosen = torch.zeros_like(routing.probs).scatter(-1, routing.top_i, 1.0)
    chosen_sum = chosen.sum(dim=0)
    probs_sum = routing.probs.sum(dim=0)
    z_sum = torch.logsumexp(routing.logits, dim=-1).pow(2).sum().reshape(1)
    count = routing.probs.new_tensor([float(routing.probs.shape[0])])
    if group is not None and dist.get_world_size(group) > 1:
        stats = all_reduce_sum(torch.cat([probs_sum, z_sum]), group, grad_group)
        probs_sum, z_sum = stats[:num_experts], stats[num_experts:]
        counts = torch.cat([chosen_sum, count])
        dist.all_reduce(counts, group=group)
        chosen_sum, count = counts[:num_experts], counts[num_experts:]
    f = chosen_sum / count / top_k
    p = probs_sum / count
    return aux_coef * num_experts * (f * p).sum() + z_coef * (z_sum / count).sum()


# ----------------------------------------------------------------- the layer
def _check_moe_layout(moe: nn.Module) -> None:
    needed = ("router", "w_up", "w_down", "num_experts", "top_k", "aux_coef", "z_coef")
    missing = [a for a in needed if not hasattr(moe, a)]
    if missing:
        raise PipeplanError(
            f"expert parallel supports stacked-expert MoE layers (router, w_up[E,D,H], "
            f"w_down[E,H,D]) like examples/models/moe_gpt.py:MoE; "
            f"{type(moe).__name__} lacks {', '.join(missing)}")


class ExpertParallelMoE(nn.Module):
    """A MoE layer holding one EP rank's experts; returns (output, aux) like the reference."""

    def __init__(self, moe: nn.Module, group=None, capacity_factor: Optional[float] = None,
                 drop_policy: str = "probs", stats_group=None):
        """`group`: the EP group. `stats_group`: the ranks whose tokens the aux statistics
        cover when it is more than the EP group (sequence parallel: EP group x TP group)."""
        super().__init__()
        _check_moe_layout(moe)
        ep_size = dist.get_world_size(group) if group is not None else 1
        ep_rank = dist.get_rank(group) if group is not None else 0
        self.shard = expert_shard(moe.num_experts, ep_size, ep_rank)
        self.group = group
        self.stats_group = stats_group if stats_group is not None else group
        self.num_experts, self.top_k = moe.num_experts, moe.top_k
        self.aux_coef, self.z_coef = moe.aux_coef, moe.z_coef
        self.capacity_factor, self.drop_policy = capacity_factor, drop_policy
        self.router = moe.router  # replicated: the same module object
        s = self.shard
        self.w_up = nn.Parameter(moe.w_up.detach()[s.first:s.stop].clone())
        self.w_down = nn.Parameter(moe.w_down.detach()[s.first:s.stop].clone())

    def forward(self, x: torch.Tensor):
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        r = route(self.router, tokens, self.top_k)
        aux = aux_loss(r, self.num_experts, self.top_k, self.aux_coef, self.z_coef,
                       self.stats_group, self.group)
        out = self._dispatch_compute_combine(tokens, r.top_i, r.top_w)
        return out.reshape(shape), aux

    # -- steps of the forward
    def _slots(self, tokens, top_i, top_w):
        """Flat (token, expert, gate) slots sorted by expert, over-capacity slots removed."""
        k = top_i.shape[1]
        slot_token = torch.arange(tokens.shape[0], device=tokens.device).repeat_interleave(k)
        slot_expert, slot_gate = top_i.reshape(-1), top_w.reshape(-1)
        if self.capacity_factor is not None:
            cap = expert_capacity(self.capacity_factor, tokens.shape[0], k, self.num_experts)
            keep = capacity_keep(top_i, top_w, self.num_experts, cap, self.drop_policy).reshape(-1)
            slot_token, slot_expert, slot_gate = slot_token[keep], slot_expert[keep], slot_gate[keep]
        order = torch.sort(slot_expert, stable=True).indices
        return slot_token[order], slot_expert[order], slot_gate[order]

    def _dispatch_compute_combine(self, tokens, top_i, top_w):
        s = self.shard
        slot_token, slot_expert, slot_gate = self._slots(tokens, top_i, top_w)
        send_per_expert = torch.bincount(slot_expert, minlength=self.num_experts)
        recv_per_expert = self._exchange_counts(send_per_expert)  # [ep, local]
        send_splits = send_per_expert.view(s.ep_size, s.local).sum(1).tolist()
        recv_splits = recv_per_expert.sum(1).tolist()

        rows = self._exchange(tokens[slot_token], recv_splits, send_splits)
        rows_out = self._run_local_experts(rows, recv_per_expert)
        back = self._exchange(rows_out, send_splits, recv_splits)

        weighted = back * slot_gate.unsqueeze(-1).to(back.dtype)
        # In the experts' dtype (bf16 under autocast), as the dense reference's mix is.
        return weighted.new_zeros(tokens.shape).index_add(0, slot_token, weighted)

    def _exchange_counts(self, send_per_expert: torch.Tensor) -> torch.Tensor:
        s = self.shard
        if s.ep_size == 1:
            return send_per_expert.view(1, s.local)
        recv = torch.empty_like(send_per_expert)
        dist.all_to_all_single(recv, send_per_expert, group=self.group)
        return recv.view(s.ep_size, s.local)  # [source rank, local expert]

    def _exchange(self, x, out_splits, in_splits):
        if self.shard.ep_size == 1:
            return x
        return all_to_all(x, out_splits, in_splits, self.group)

    def _run_local_experts(self, rows: torch.Tensor, recv_per_expert: torch.Tensor):
        """Rows arrive grouped by source rank, then expert: regroup by expert, run, restore."""
        s = self.shard
        local_ids = torch.arange(s.local, device=rows.device).repeat(s.ep_size)
        row_expert = local_ids.repeat_interleave(recv_per_expert.reshape(-1))
        perm = torch.sort(row_expert, stable=True).indices
        grouped = rows[perm].split(recv_per_expert.sum(0).tolist())
        outs = [F.gelu(g @ self.w_up[e]) @ self.w_down[e] for e, g in enumerate(grouped)]
        return torch.cat(outs)[torch.argsort(perm)]


# ----------------------------------------------------------------- gathering
def gather_experts(layer: ExpertParallelMoE) -> dict[str, torch.Tensor]:
    """The full stacked expert tensors by global index (on every rank), for checks/checkpoints."""
    full = {}
    for name in ("w_up", "w_down"):
        local = getattr(layer, name).detach().contiguous()
        if layer.shard.ep_size == 1:
            full[name] = local.clone()
            continue
        out = local.new_empty((layer.num_experts,) + tuple(local.shape[1:]))
        dist.all_gather_single(out, local, group=layer.group)
        full[name] = out
    return full
