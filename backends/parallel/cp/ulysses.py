"""DeepSpeed-Ulysses on a captured stage graph: attention sees the whole sequence for
heads/cp heads, every other op runs on this cp rank's sequence slice.

The stage graph was captured at seq_len / cp (compiler/parallel/cp.py checks what
makes this exact). `apply_ulysses` swaps each `scaled_dot_product_attention` call for
`UlyssesAttention`, which calls the model's own op between two all-to-alls over the cp
group:

  q, k, v [B, H, S/cp, D]  --all-to-all-->  [B, H/cp, S, D]   (sequence -> heads)
  SDPA (is_causal on the whole sequence is exact; a mask is the model's own, rebuilt on
        the whole sequence by compiler/parallel/cp_masks.py, its head block taken)
  out     [B, H/cp, S, D]  --all-to-all-->  [B, H, S/cp, D]   (heads -> sequence)

Rank c of the cp group holds sequence slice c and, inside attention, head block c; KV
heads are split the same way, so grouped-query attention's head i -> KV head
i // (H/KV) mapping stays inside a block. The all-to-all is torch's autograd-aware one
(torch.distributed.nn.functional.all_to_all_single): its backward is the inverse
all-to-all, so gradients of q, k, v return to the ranks that own their positions.

Inside a tensor-parallel stage each tp rank runs the above on its local heads
(backends/parallel/cp/attention.py: `ContextAttention`, shared with ring attention).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.fx as fx
from torch.distributed.nn.functional import all_to_all_single  # autograd-aware, eager

from .attention import ContextAttention, wrap_attention
from .functional import all_to_all as functional_all_to_all, traced


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """Exchange dim-0 blocks: block j goes to rank j, block i of the result came from rank i."""
    if traced(x):  # a joint-graph trace (compile.mode = graphs): a functional collective
        return functional_all_to_all(x, group)
    x = x.contiguous()  # (empty_like of a permuted view would keep its strides)
    return all_to_all_single(torch.empty_like(x), x, group=group)


def seq_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """[B, H, S/cp, D] sequence slice -> [B, H/cp, S, D] head block (all-to-all over cp)."""
    cp = dist.get_world_size(group)
    b, h, s, d = x.shape
    blocks = x.reshape(b, cp, h // cp, s, d).permute(1, 0, 2, 3, 4)  # [cp(dest), B, H/cp, s, D]
    got = _all_to_all(blocks, group)  # [cp(source = sequence slice), B, H/cp, s, D]
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * s, d)


def heads_to_seq(y: torch.Tensor, group) -> torch.Tensor:
    """[B, H/cp, S, D] head block -> [B, H, S/cp, D] sequence slice (the inverse)."""
    cp = dist.get_world_size(group)
    b, hc, full, d = y.shape
    blocks = y.reshape(b, hc, cp, full // cp, d).permute(2, 0, 1, 3, 4)  # [cp(dest slice), ...]
    got = _all_to_all(blocks, group)  # [cp(source = head block), B, H/cp, s, D]
    return got.permute(1, 0, 2, 3, 4).reshape(b, cp * hc, full // cp, d)


class UlyssesAttention(ContextAttention):
    """The model's attention op on whole sequences and this rank's head block."""

    def __init__(self, op, group):
        super().__init__(group)
        self.op = op

    def local(self, q, k, v, *args, **kwargs):
        q, k, v = (seq_to_heads(t, self.group) for t in (q, k, v))
        if args:
            args = (head_block(args[0], self.group),) + tuple(args[1:])
        if "attn_mask" in kwargs:
            kwargs = {**kwargs, "attn_mask": head_block(kwargs["attn_mask"], self.group)}
        return heads_to_seq(self.op(q, k, v, *args, **kwargs), self.group)


def head_block(mask, group):
    """The whole-sequence mask (compiler/parallel/cp_masks.py) for this rank's head block:
    itself when it is one for all heads, else its rank-th 1/cp of the heads (dim -3)."""
    if not isinstance(mask, torch.Tensor) or mask.dim() < 3 or mask.shape[-3] == 1:
        return mask
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    h = mask.shape[-3] // cp
    return mask.narrow(-3, rank * h, h)


def apply_ulysses(gm: fx.GraphModule, group) -> int:
    """Swap every SDPA call of `gm` for UlyssesAttention in place, and give every attention
    region the model writes out (compiler/parallel/cp_regions.py: UlyssesRegion) the
    all-to-alls over `group`; returns how many."""
    from ....compiler.parallel.cp_regions import UlyssesRegion

    regions = [m for m in gm.modules() if isinstance(m, UlyssesRegion)]
    for m in regions:
        m.to_heads = lambda t: seq_to_heads(t, group)
        m.to_seq = lambda t: heads_to_seq(t, group)
        m.block = lambda t, dim: t.narrow(dim, dist.get_rank(group) * (
            t.shape[dim] // dist.get_world_size(group)), t.shape[dim] // dist.get_world_size(group))
    return wrap_attention(gm, lambda op: UlyssesAttention(op, group), "ulysses") + len(regions)
