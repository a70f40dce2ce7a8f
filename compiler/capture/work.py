"""What each graph node asks of a device: its matmuls by shape, and the bytes its other ops move.

Recorded during the meta run (analysis.py) by `WorkMeter`, one aten op at a time, after
autograd's decompositions (the kernels an eager device runs):

* an op torch's flop counter has a formula for (mm, addmm, bmm, baddbmm, convolutions,
  attention kernels) is a `Gemm`: batch, M, N, K read off its operands (for ops that are
  not plain matmuls, M x N is the output and K = FLOPs / (2 M N));
* an op whose output aliases an input (view, transpose, expand, ...) moves nothing;
* any other op moves the bytes of its tensor inputs and outputs; a parameter an op gathers
  from (an embedding lookup, index_select, index, gather, take) is read as the rows it
  gathers, i.e. the bytes the op writes, not the table. (Until stop 38: any parameter at
  most the bytes its op writes. That min() bends where the batch's rows outgrow the table,
  which the planner's line through two microbatch sizes did not follow: the example GPT's
  embedding at 8 sequences of 64 tokens was 33% more elements in the plan than in check.)

Float bytes are kept apart from integer/bool bytes so the time model can count floats in
the plan's compute precision (the meta run is float32 under bf16 autocast).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry


@dataclass(frozen=True)
class Gemm:
    """One matmul-like kernel: `batch` products of [m, k] x [k, n]."""

    batch: int
    m: int
    n: int
    k: int
    attention: bool = False  # a fused attention kernel (its k: twice the head dimension)

    @property
    def flops(self) -> float:
        return 2.0 * self.batch * self.m * self.n * self.k

    @property
    def elements(self) -> float:
        """Elements read and written: both operands and the result."""
        return float(self.batch) * (self.m * self.k + self.k * self.n + self.m * self.n)


@dataclass(frozen=True)
class Work:
    """One node's forward, per microbatch."""

    gemms: tuple[Gemm, ...] = ()
    float_elements: float = 0.0  # elements of floating tensors moved by memory-bound ops
    other_bytes: float = 0.0  # bytes of integer / bool tensors they move
    kernels: int = 0  # memory-bound kernels

    def __add__(self, other: "Work") -> "Work":
        return Work(self.gemms + other.gemms, self.float_elements + other.float_elements,
                     self.other_bytes + other.other_bytes, self.kernels + other.kernels)


def attention_work(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, flops: float) -> Work:
    """A fused attention call as one kernel: [..., sq, d] queries against sk keys."""
    batch = max(1, q.numel() // (q.shape[-2] * q.shape[-1]))
    sq, sk = q.shape[-2], k.shape[-2]
    per = max(flops / (2.0 * batch * sq * sk), 1.0)  # the K of the fused product: 2d
    return Work(gemms=(Gemm(batch, sq, sk, int(round(per)), attention=True),))


@dataclass
class WorkLog:
    """Accumulates the ops of the node being run."""

    gemms: list = field(default_factory=list)
    float_elements: float = 0.0
    other_bytes: float = 0.0
    kernels: int = 0

    def take(self) -> Work:
        w = Work(tuple(self.gemms), self.float_elements, self.other_bytes, self.kernels)
        self.gemms, self.float_elements, self.other_bytes, self.kernels = [], 0.0, 0.0, 0
        return w

    def record(self, func, args, kwargs, out, is_param: Callable[[torch.Tensor], bool]) -> None:
        if func.overloadpacket in _FUSED_ATTENTION:
            self.gemms.append(_fused_attention(args))
            return
        if func.overloadpacket in flop_registry:
            self.gemms.append(_gemm(func, args, kwargs, out))
            return
        if _is_view(func) or func.overloadpacket in _ALLOCATIONS:
            return
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        written = sum(_nbytes(t) for t in outs)
        if not outs:
            return
        self.kernels += 1
        for t in outs:
            self._add(t, _nbytes(t))
        gathers = func.overloadpacket in _GATHERS
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor):
                self._add(t, written if gathers and is_param(t) else _nbytes(t))

    def _add(self, t: torch.Tensor, nbytes: float) -> None:
        if t.dtype.is_floating_point:
            self.float_elements += nbytes / t.element_size()
        else:
            self.other_bytes += nbytes


# ops that run no kernel although their schema does not say they alias: allocations, and
# _unsafe_view (a view whose result autograd treats as new)
_ALLOCATIONS = {torch.ops.aten.empty, torch.ops.aten.empty_like, torch.ops.aten.empty_strided,
                torch.ops.aten.new_empty, torch.ops.aten.new_empty_strided,
                torch.ops.aten._unsafe_view}


# ops reading only the rows of an input they gather (what they write), not the whole of it
_GATHERS = {torch.ops.aten.embedding, torch.ops.aten.index_select, torch.ops.aten.index,
            torch.ops.aten.gather, torch.ops.aten.take}


# fused attention kernels torch's flop counter has no formula for (the CPU's)
_FUSED_ATTENTION = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu}


def _fused_attention(args) -> Gemm:
    """q [..., sq, d] against k [..., sk, d] and v [..., sk, dv]: QK^T and PV, 2 sq sk (d + dv)
    FLOPs per batch, as torch's formula for the other fused kernels counts them."""
    q, k, v = args[:3]
    batch = max(1, q.numel() // (q.shape[-2] * q.shape[-1]))
    flops = 2.0 * batch * q.shape[-2] * k.shape[-2] * (q.shape[-1] + v.shape[-1])
    return attention_work(None, q, k, flops).gemms[0]


def _gemm(func, args, kwargs, out) -> Gemm:
    packet = func.overloadpacket
    aten = torch.ops.aten
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if packet in (aten.mm, aten.addmm, aten.bmm, aten.baddbmm):
        a, b = tensors[-2], tensors[-1]
        batch = a.shape[0] if a.dim() == 3 else 1
        return Gemm(int(batch), int(a.shape[-2]), int(b.shape[-1]), int(a.shape[-1]))
    flops = flop_registry[packet](*args, **(kwargs or {}), out_val=out)
    first = tree_leaves(out)[0]
    n = int(first.shape[-1]) if first.dim() else 1
    m = max(1, first.numel() // max(n, 1))
    return Gemm(1, m, n, max(1, int(round(flops / (2.0 * m * n)))))


def _is_view(func) -> bool:
    """The op's outputs alias its inputs (its schema says so): no data moves."""
    rets = func._schema.returns
    return bool(rets) and all(r.alias_info is not None and not r.alias_info.is_write
                              for r in rets)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
