"""Ring attention on a captured stage graph: each cp rank keeps its queries and passes key /
value blocks around the cp ring, merging the blocks' outputs by their log-sum-exp.

Layout (load balancing for causal attention): the sequence is cut into 2*cp chunks of
c = S/(2cp) positions; cp rank r holds chunks r and 2cp-1-r, concatenated (its q, k, v
are [B, H, 2c, D]; backends/runtime/data.py slices tokens, targets and positions the same way,
`ring_columns`). At ring step i rank r holds the K/V of rank s = (r - i) mod cp, and
under is_causal its queries see (`_visible`):

  i = 0       its own chunks: is_causal on the concatenation is exact (chunk r < 2cp-1-r);
  s < r       both q chunks see K/V chunk s whole and K/V chunk 2cp-1-s not at all;
  s > r       q chunk r sees nothing, q chunk 2cp-1-r sees both K/V chunks whole;

so every rank computes the same amount at every step. Without is_causal (and no mask)
every block is seen whole.

Each block runs through torch's SDPA kernel that returns the log-sum-exp
(`aten._scaled_dot_product_flash_attention_for_cpu`, the kernel F.scaled_dot_product_attention
dispatches to on CPU, float64 included), and its backward kernel with the merged output and
log-sum-exp, which gives the block's exact share of dq, dk, dv. Forward: K/V go round
cp-1 hops. Backward (`RingAttention.backward`, run once in B: attention has no weights,
backends/runtime/split_backward.py): K/V go round again and each block's dK/dV accumulator
follows its block from rank s+1 to s+cp-1 and hops home to s: cp-1 hops each. Grouped-query
attention sends the KV heads and repeats them per block (dK/dV summed back per group).

Why not torch's `context_parallel` (torch.distributed.tensor.experimental): it patches SDPA
globally under a context manager, expects DTensor inputs and dispatches only the CUDA
kernels (flash / efficient / cudnn attention and their backwards), so CPU and float64 - what
pipeplan runs and judges equivalence in - never reach its ring; and its sharding of buffers
assumes it owns the data loader. Here the rewrite is per SDPA call of one stage graph, with
the data layout pipeplan's own (backends/runtime/data.py).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.fx as fx

from ....compiler.parallel.cp import sdpa_arguments
from ....errors import PipeplanError
from ....compiler.graphs.joint import traceable_function
from .attention import ContextAttention, wrap_attention
from .functional import hop, traced

_aten = torch.ops.aten
TAG_KV, TAG_DKV = 71, 72  # two messages travel between the same neighbours in backward


def ring_columns(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """The positions cp rank `rank` holds: chunks rank and 2cp-1-rank of 2cp."""
    c = seq_len // (2 * cp)
    return torch.cat([torch.arange(rank * c, (rank + 1) * c),
                      torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)])


def _visible(rank: int, step: int, cp: int, causal: bool) -> tuple[slice, slice, bool]:
    """(query half, K/V half, is_causal) of ring step `step` on rank `rank` (module docstring)."""
    every = slice(None)
    if not causal:
        return every, every, False
    if step == 0:
        return every, every, True
    if (rank - step) % cp < rank:
        return every, slice(0, 1), False  # first K/V chunk (slice in chunk units)
    return slice(1, 2), every, False  # second query chunk


def _chunks(x: torch.Tensor, part: slice) -> torch.Tensor:
    """`part` (in units of the 2 local chunks) of x's sequence dim 2."""
    if part == slice(None):
        return x
    c = x.shape[2] // 2
    return x[:, :, part.start * c:part.stop * c]


def _repeat_heads(kv: torch.Tensor, heads: int) -> torch.Tensor:
    """Grouped-query attention: query head h reads KV head h // (heads / kv_heads)."""
    g = heads // kv.shape[1]
    return kv if g == 1 else kv.repeat_interleave(g, dim=1)


def _sum_groups(dkv: torch.Tensor, kv_heads: int) -> torch.Tensor:
    b, h, s, d = dkv.shape
    return dkv if h == kv_heads else dkv.view(b, kv_heads, h // kv_heads, s, d).sum(2)


def block_forward(q, k, v, causal: bool, scale, mask=None):
    """One block's attention output and log-sum-exp, through torch's SDPA kernel. `mask`:
    the block's additive mask and which query rows see any key (`block_mask`); rows that
    see none get output 0 and log-sum-exp -inf (the kernel says 0), so merging stays exact."""
    h = q.shape[1]
    q, k, v = (t.contiguous() for t in (q, _repeat_heads(k, h), _repeat_heads(v, h)))
    additive, seen = mask if mask is not None else (None, None)
    o, l = _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal,
                                                             attn_mask=additive, scale=scale)
    if seen is not None:
        l = torch.where(seen, l, float("-inf"))
        o = torch.where(seen.unsqueeze(-1), o, 0.0)
    return o, l


def block_backward(dout, q, k, v, out, lse, causal: bool, scale, mask=None):
    """One block's share of dq, dk, dv given the merged output and log-sum-exp."""
    h, kv_heads = q.shape[1], k.shape[1]
    dout, q, k, v, out, lse = (t.contiguous() for t in (
        dout, q, _repeat_heads(k, h), _repeat_heads(v, h), out, lse))
    dq, dk, dv = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, attn_mask=None if mask is None else mask[0],
        scale=scale)
    return dq, _sum_groups(dk, kv_heads), _sum_groups(dv, kv_heads)


def block_mask(mask: torch.Tensor, rank: int, source: int, cp: int, dtype):
    """The block of the whole-sequence `mask` [.., S, S] (the model's own,
    compiler/parallel/cp_masks.py) that rank `rank`'s queries see of rank `source`'s K/V:
    rows of ring_columns(rank), columns of ring_columns(source). Returns (additive float mask,
    rows seeing any key), or None when the block is masked whole (skipped)."""
    seq = mask.shape[-1]
    rows = ring_columns(seq, cp, rank).to(mask.device)
    cols = ring_columns(seq, cp, source).to(mask.device)
    m = mask.index_select(-2, rows).index_select(-1, cols)
    if m.dtype == torch.bool:
        seen = m.any(-1)
        m = torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill(~m, float("-inf"))
    else:
        m = m.to(dtype)
        seen = (m > float("-inf")).any(-1)
    if not bool(seen.any()):
        return None
    while m.dim() < 4:
        m, seen = m.unsqueeze(0), seen.unsqueeze(0)
    return m, seen


class _Ring:
    """Point-to-point hops to the next cp rank, received from the previous one."""

    def __init__(self, group):
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)

    def hop(self, x: torch.Tensor, tag: int):
        """Send x onward and receive the previous rank's x (the same shape); returns a wait()
        that gives what was received. Inside a joint-graph trace: a functional collective."""
        if traced(x):
            got = hop(x, self.group)
            return lambda: got
        got = torch.empty_like(x)
        works = [dist.irecv(got, group=self.group, group_src=(self.rank - 1) % self.size, tag=tag),
                 dist.isend(x, group=self.group, group_dst=(self.rank + 1) % self.size, tag=tag)]

        def wait() -> torch.Tensor:
            for w in works:
                w.wait()
            return got
        return wait


def _pack(k, v) -> torch.Tensor:
    return torch.cat([k.reshape(-1), v.reshape(-1)])


def _unpack(kv: torch.Tensor, like: torch.Tensor):
    n = like.numel()
    return kv[:n].view(like.shape), kv[n:].view(like.shape)


def _merge(out, lse, q_part, o, l) -> None:
    """Fold a block's (o, l) into the running (out, lse) rows `q_part`, in place."""
    out_rows, lse_rows = _chunks(out, q_part), _chunks(lse.unsqueeze(-1), q_part)
    new = torch.logaddexp(lse_rows, l.unsqueeze(-1))
    safe = torch.where(torch.isinf(new), 0.0, new)  # rows that have seen no key yet
    out_rows.copy_(out_rows * torch.exp(lse_rows - safe) + o * torch.exp(l.unsqueeze(-1) - safe))
    lse_rows.copy_(new)


@traceable_function  # (compile.mode = graphs: tensor ops and functional hops when traced)
class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, scale, mask):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        ring = _Ring(group)
        acc = torch.promote_types(q.dtype, torch.float32)  # blocks merged in at least fp32
        out = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device)
        kv = _pack(k, v)
        for i in range(ring.size):
            nxt = ring.hop(kv, TAG_KV) if i + 1 < ring.size else None
            kb, vb = _unpack(kv, k)
            qp, kvp, c = _visible(ring.rank, i, ring.size, causal)
            bm = None if mask is None else block_mask(mask, ring.rank, (ring.rank - i) % ring.size,
                                                       ring.size, q.dtype)
            if mask is None or bm is not None:  # a block masked whole adds nothing
                o, l = block_forward(_chunks(q, qp), _chunks(kb, kvp), _chunks(vb, kvp), c,
                                     scale, bm)
                _merge(out, lse, qp, o.to(acc), l.to(acc))
            if nxt is not None:
                kv = nxt()
        out, lse = out.to(q.dtype), lse.to(q.dtype)  # as the kernel's backward takes them
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal, ctx.scale, ctx.mask = group, causal, scale, mask
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dout = dout.contiguous()
        ring = _Ring(ctx.group)
        acc = torch.promote_types(q.dtype, torch.float32)  # dK/dV summed over cp blocks
        dq = torch.zeros_like(q, dtype=acc)
        kv, own, incoming = _pack(k, v), None, None
        for i in range(ring.size):
            nxt = ring.hop(kv, TAG_KV) if i + 1 < ring.size else None
            kb, vb = _unpack(kv, k)
            qp, kvp, c = _visible(ring.rank, i, ring.size, ctx.causal)
            bm = None if ctx.mask is None else block_mask(
                ctx.mask, ring.rank, (ring.rank - i) % ring.size, ring.size, q.dtype)
            dk, dv = torch.zeros_like(k, dtype=acc), torch.zeros_like(v, dtype=acc)
            if ctx.mask is None or bm is not None:
                bq, bk, bv = block_backward(
                    _chunks(dout, qp), _chunks(q, qp), _chunks(kb, kvp), _chunks(vb, kvp),
                    _chunks(out, qp), _chunks(lse.unsqueeze(-1), qp).squeeze(-1),
                    c, ctx.scale, bm)
                _chunks(dq, qp).add_(bq)
                _chunks(dk, kvp).add_(bk)
                _chunks(dv, kvp).add_(bv)
            mine = _pack(dk, dv)
            if i == 0:
                own = mine  # this rank's share of its own block's gradient
            else:  # the block's accumulator came from the previous rank (none at step 1)
                total = mine if incoming is None else incoming() + mine
                incoming = ring.hop(total, TAG_DKV)
            if nxt is not None:
                kv = nxt()
        if incoming is not None:  # the accumulator of this rank's own block, home again
            own = own + incoming()
        dk, dv = _unpack(own, k)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def check_ring_device(device_type: str) -> None:
    """Refused before the process group forms (backends/runtime/worker.py) and at the call."""
    if device_type != "cpu":
        raise PipeplanError("ring attention runs its blocks through the CPU SDPA kernel "
                            f"that returns the log-sum-exp, and this rank runs on "
                            f"{device_type}: use context {{ method = ulysses }} there, or "
                            "hide the GPUs (CUDA_VISIBLE_DEVICES=) to run on CPU")


def ring_attention(q, k, v, group, is_causal: bool = False, scale=None, mask=None):
    """Attention of this rank's queries over the whole (ring-laid-out) sequence. `mask`: the
    model's whole-sequence mask [.., S, S] in the sequence's own order (not the layout's)."""
    check_ring_device(q.device.type)
    if mask is not None and is_causal:
        raise PipeplanError("ring attention takes a mask or is_causal, not both (as SDPA)")
    return _RingAttention.apply(q, k, v, group, bool(is_causal), scale, mask)


class RingAttention(ContextAttention):
    """Stands in for one SDPA call of a stage graph (compiler/parallel/cp.py refuses
    dropout at the plan line; a mask comes whole, compiler/parallel/cp_masks.py); on the tp-local heads inside a tensor-parallel
    stage (ContextAttention: the cp ring of a rank holds its tp coordinate, so the K/V
    blocks passed around are the same heads on every member)."""

    def local(self, *args, **kwargs):
        a = sdpa_arguments(args, kwargs)
        if a["dropout_p"]:
            raise PipeplanError("ring attention takes no dropout")
        return ring_attention(a["query"], a["key"], a["value"], self.group,
                              a["is_causal"], a["scale"], a["attn_mask"])


def apply_ring(gm: fx.GraphModule, group) -> int:
    """Swap every SDPA call of `gm` for RingAttention in place; returns how many."""
    return wrap_attention(gm, lambda op: RingAttention(group), "ring")
