"""The graph nodes tensor parallelism inserts: where plain tensors become DTensors and back.

Each is a small parameter-free module the stage GraphModule calls
(`call_module`), so the rewritten stage reads as code (`python build/stage_0.py`)
and runs the same under recompute's node-by-node program. They hold the TP
DeviceMesh; everything between them is the model's own ops on DTensors.

    ToDTensor(placement)   a local tensor -> DTensor (stage inputs, constants,
                           buffers: Replicate; sharded parameters: Shard(d))
    ReplicatedParameter    a replicated parameter -> Replicate DTensor whose
                           gradient stays this rank's partial sum (sequence
                           parallel: summed over tp once per step)
    Redistribute(p)        DTensor.redistribute at a column input / row output
                           (the collective the style implies, and its conjugate
                           in backward)
    ToLocal                a stage output -> its full local tensor (all-gather or
                           all-reduce only if it is not replicated already)
    VocabParallelLoss      cross-entropy on vocab-sharded logits under torch's
                           loss_parallel, forward and backward
    WholeValues(op)        an op DTensor has no sharding strategy for, on the whole
                           values (gathered), each rank computing it
    CountedMean            the model's mean cross-entropy / nll_loss on row-sharded
                           inputs as the op defines its mean: summed losses over the
                           counted targets' total weight (not the shards' mean of means)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DeviceMesh, DTensor, Partial, Replicate, Shard
from torch.distributed.tensor import empty as distributed_empty
from torch.distributed.tensor.parallel import loss_parallel
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils._pytree import tree_leaves, tree_map

from ....compiler.graphs.joint import traceable_function
from .params import shard_offset


def placement(spec: str):
    """"replicate" | "shard:<dim>" (dims may be negative: counted at use) -> a Placement."""
    if spec == "replicate":
        return Replicate()
    kind, _, dim = spec.partition(":")
    assert kind == "shard", spec
    return int(dim)  # resolved against the tensor's rank at use


def _resolve(spec, ndim: int):
    return Shard(spec % ndim) if isinstance(spec, int) else spec


class _Placed(nn.Module):
    """A node that gives its input a placement (`spec`) on the tp mesh."""

    def __init__(self, mesh: DeviceMesh, spec: str = "replicate"):
        super().__init__()
        self.mesh, self.spec = mesh, spec
        self._placement = placement(spec)

    def extra_repr(self) -> str:
        return self.spec


class ToDTensor(_Placed):
    """Wrap this rank's local tensor as a DTensor with the given placement (autograd-aware:
    the gradient comes back as this rank's local part of that placement)."""

    def forward(self, x):
        if not isinstance(x, torch.Tensor) or isinstance(x, DTensor):
            return x
        p = _resolve(self._placement, x.dim())
        return DTensor.from_local(x, self.mesh, [p], run_check=False)


@traceable_function
class _PartialGradReplicate(torch.autograd.Function):
    """Forward: a Replicate DTensor of `p`. Backward: this rank's share of the gradient as
    a partial sum (Partial: its local value; Replicate: the value on rank 0, zeros
    elsewhere; Shard(d): its slice in place, zeros elsewhere -- OLMoE's experts' weights,
    indexed by expert on sequence shards, get theirs split by expert), so one all-reduce
    per step completes it."""

    @staticmethod
    def forward(ctx, p, mesh):
        ctx.mesh = mesh
        return DTensor.from_local(p.detach(), mesh, [Replicate()], run_check=False)

    @staticmethod
    def backward(ctx, grad):
        placement_ = grad.placements[0]
        local = grad._local_tensor
        if isinstance(placement_, Partial):
            return local, None
        if isinstance(placement_, Replicate):
            return (local if ctx.mesh.get_local_rank() == 0 else torch.zeros_like(local)), None
        if isinstance(placement_, Shard):
            return _in_place(grad, placement_.dim, ctx.mesh), None
        raise RuntimeError(f"a replicated parameter got a {placement_} gradient")


def _in_place(grad: DTensor, dim: int, mesh: DeviceMesh) -> torch.Tensor:
    """A Shard(dim) DTensor as a partial sum: this rank's shard where DTensor puts it
    (torch.chunk's rule), zeros elsewhere."""
    local = grad._local_tensor
    full = torch.zeros(grad.shape, dtype=local.dtype, device=local.device)
    n = grad.shape[dim]
    full.narrow(dim, min(shard_offset(n, mesh.get_group()), n), local.shape[dim]).copy_(local)
    return full


class ReplicatedParameter(nn.Module):
    """A replicated parameter used on sequence shards: its gradient is left partial."""

    def __init__(self, mesh: DeviceMesh):
        super().__init__()
        self.mesh = mesh

    def forward(self, p):
        if isinstance(p, DTensor):
            return p
        return _PartialGradReplicate.apply(p, self.mesh)


class Redistribute(_Placed):
    """`x.redistribute(mesh, [placement])`; backward moves the gradient back to x's
    placement (Replicate -> all-reduce of a partial gradient; Shard(seq) -> reduce-scatter)."""

    def forward(self, x):
        if not isinstance(x, DTensor):
            return x
        return x.redistribute(self.mesh, [_resolve(self._placement, x.dim())])

    def stand_in(self, x):
        """A value of the output's shape and placement, without communicating (what a
        dry run of the graph needs: recompute's FLOP count)."""
        if not isinstance(x, DTensor):
            return x
        return distributed_empty(x.shape, dtype=x.dtype, device_mesh=self.mesh,
                                 placements=[_resolve(self._placement, x.dim())])


class ToLocal(nn.Module):
    """A stage output as a full local tensor (what the next stage or the loss reads)."""

    def forward(self, x):
        if not isinstance(x, DTensor):
            return x
        if not x.placements[0].is_replicate():
            x = x.redistribute(x.device_mesh, [Replicate()])
        return x.to_local()


@traceable_function
class _VocabParallelCrossEntropy(torch.autograd.Function):
    """torch's loss_parallel around one cross-entropy: forward and backward inside it."""

    @staticmethod
    def forward(ctx, logits, targets, kwargs):
        leaf = logits.detach().requires_grad_(True)
        with torch.enable_grad(), loss_parallel():
            loss = F.cross_entropy(leaf, targets, **kwargs)
        ctx.leaf, ctx.loss = leaf, loss
        return loss.detach()

    @staticmethod
    def backward(ctx, grad):
        with loss_parallel():  # retained: a split backward may walk this node twice
            (g,) = torch.autograd.grad(ctx.loss, ctx.leaf, grad, retain_graph=True)
        return g, None, None


class VocabParallelLoss(nn.Module):
    """`F.cross_entropy(logits, targets, **kwargs)` with logits sharded over the vocabulary:
    torch's loss_parallel computes it from the shards (never gathering the logits)."""

    def __init__(self, **kwargs):
        super().__init__()
        self.kwargs = kwargs

    def forward(self, logits, targets):
        if isinstance(targets, DTensor):
            targets = targets.to_local()
        return _VocabParallelCrossEntropy.apply(logits, targets, self.kwargs)


class CountedMean(nn.Module):
    """The model's own mean-reduced `cross_entropy` / `nll_loss` (`op`, called with its
    normalized keyword arguments) where its input is a DTensor sharded along its rows --
    under sequence parallel, the logits of an LM head left whole hold this rank's positions.

    The op's mean is its summed loss over the total weight of the targets it counts (the
    class weight of each, 1 without weights; none for `ignore_index`). DTensor's strategy
    averages the shards' means instead ("avg"), which is that only while every shard counts
    the same weight: transformers' causal-LM loss ignores each sequence's last position
    (its labels padded with -100), so the shard holding the ends counts fewer, and the loss
    a run reports is not the model's. Here: the op with `reduction = sum` on the shards (a
    partial sum) divided by the weight counted on the whole target, which every tp rank
    holds (the stage's batch) -- the op's own formula, its gradient DTensor's. Any other
    input (replicated, vocab-split, soft targets) runs the op as the graph calls it.
    """

    def __init__(self, op, total):
        super().__init__()
        self.op, self.total = op, total  # total: the op's reduction value for a sum

    def forward(self, input, target, **kwargs):
        if not _rows_sharded(input) or target.is_floating_point():
            return self.op(input, target, **kwargs)
        summed = self.op(input, target, **{**kwargs, "reduction": self.total})
        return summed / _counted_weight(summed, target, kwargs.get("weight"),
                                        kwargs.get("ignore_index", -100))


def _rows_sharded(x) -> bool:
    """A DTensor split on a dim other than the classes' (dim 1; a 1-d input has no rows),
    in blocks or strided (DTensor's `_StridedShard`: [batch, seq] flattened to rows with
    the sequence split)."""
    return isinstance(x, DTensor) and x.dim() >= 2 and any(
        (p.is_shard() or isinstance(p, _StridedShard)) and p.dim % x.dim() != 1
        for p in x.placements)


def _counted_weight(like: DTensor, target, weight, ignore_index: int) -> DTensor:
    """The total weight of the targets the op counts, replicated over like's mesh, in the
    summed loss's dtype (float32 under autocast: a bf16 count is exact only up to 256)."""
    def whole(t):
        return t.full_tensor() if isinstance(t, DTensor) else t

    with torch.no_grad():
        t = whole(target)
        kept = t != ignore_index
        if weight is None:
            total = kept.sum().to(like.dtype)
        else:
            total = (whole(weight)[t.masked_fill(~kept, 0)] * kept).sum().to(like.dtype)
    return DTensor.from_local(total, like.device_mesh, [Replicate()] * like.device_mesh.ndim,
                              run_check=False)


class HeadLocal(nn.Module):
    """Attention (`scaled_dot_product_attention`) on this rank's heads: the model's own op,
    called on the local blocks when q is split on the heads dim (1) and k and v are too, or
    are one head that every query head reads (multi-query: whole on every rank, their
    gradient a partial sum); on the whole tensors when q, k and v are all whole (a fused
    projection DTensor had to gather: Falcon's multi-query slices), each rank computing
    the same attention.

    SDPA treats every (batch, head) independently, so on head shards it is exactly
    the op on the local heads; a mask with a heads dim is sliced to the same heads, and
    its gradient (a learned bias's) is each rank's heads' part, summed over the ranks.
    (DTensor would reach the same by propagating through the op's decomposition,
    which is far slower on CPU, and its fused CPU kernel's backward has no sharding
    strategy.) Any other placement runs the op on the DTensors.
    """

    def __init__(self, op):
        super().__init__()
        self.op = op

    def forward(self, q, k, v, *args, **kwargs):
        if not all(isinstance(t, DTensor) for t in (q, k, v)):
            return self.op(q, k, v, *args, **kwargs)
        place = [t.placements[0] for t in (q, k, v)]
        whole = all(p.is_replicate() for p in place)
        split = place[0] == Shard(1) and all(
            p == Shard(1) or p.is_replicate() and t.shape[1] == 1
            for p, t in zip(place[1:], (k, v)))
        if not (whole or split):
            return self.op(q, k, v, *args, **kwargs)
        mesh = q.device_mesh
        size, rank = mesh.size(), mesh.get_local_rank()

        def local(t, operand: bool = False):
            if not isinstance(t, DTensor):
                return t
            if t.placements[0] == Shard(1) and split:
                return t.to_local()
            if operand and split:  # one k/v head for this rank's query heads: partial grad
                return t.to_local(grad_placements=[Partial()])
            # split: this rank's heads give the whole mask a part of its gradient (a learned
            # bias: T5's relative positions), summed over the ranks
            full = t.redistribute(mesh, [Replicate()]).to_local(
                grad_placements=[Partial()] if split else None)
            if split and full.dim() == 4 and full.shape[1] == q.shape[1]:  # a per-head mask
                return full.chunk(size, dim=1)[rank]
            return full

        args = [local(a) for a in args]
        kwargs = {n: local(a) for n, a in kwargs.items()}
        out = self.op(local(q, True), local(k, True), local(v, True), *args, **kwargs)
        if whole:
            return DTensor.from_local(out, mesh, [Replicate()], run_check=False)
        shape = torch.Size((out.shape[0], q.shape[1]) + tuple(out.shape[2:]))
        return DTensor.from_local(out, mesh, [Shard(1)], run_check=False, shape=shape,
                                  stride=_stride_like(out, shape))


class WholeValues(nn.Module):
    """An op DTensor has no sharding strategy for (an op of a library of its own, as
    transformers' `grouped_mm_fallback` for experts stacked in one weight), run on the whole
    values on every rank: its DTensor operands gathered (redistributed to Replicate), the
    op called on their local tensors, its tensors handed on as Replicate -- each rank
    computes what the model computes. Gradients flow back through DTensor's own
    conversions (a partial one is summed over tp where it enters the op's output; a
    sharded operand's is sliced back). Without DTensor operands it is the op."""

    def __init__(self, op):
        super().__init__()
        self.op = op

    def forward(self, *args, **kwargs):
        found = [t for t in tree_leaves((args, kwargs)) if isinstance(t, DTensor)]
        if not found:
            return self.op(*args, **kwargs)
        mesh = found[0].device_mesh

        def whole(t):
            return t.redistribute(mesh, [Replicate()]).to_local() \
                if isinstance(t, DTensor) else t

        out = self.op(*tree_map(whole, args), **tree_map(whole, kwargs))
        return tree_map(lambda t: DTensor.from_local(t, mesh, [Replicate()], run_check=False)
                        if isinstance(t, torch.Tensor) else t, out)


def has_sharding_strategy(op) -> bool:
    """DTensor can propagate `op` (an OpOverload): a strategy, a rule, a handler of its own,
    or a decomposition it propagates through."""
    from torch.distributed.tensor._decompositions import DecompShardingStrategy

    dispatcher = DTensor._op_dispatcher
    prop = dispatcher.sharding_propagator
    return (op in prop.op_strategy_funcs or op in prop.op_to_rules
            or op in getattr(prop, "op_single_dim_strategy_funcs", {})
            or op in dispatcher._custom_op_handlers or DecompShardingStrategy.has_decomp(op))


class BatchLocal(nn.Module):
    """`baddbmm(input, batch1, batch2)` on this rank's batch entries: the model's own op on
    the local blocks when batch1 and batch2 are split alike on the batch dim (0), as heads
    folded into it leave them (BLOOM's [batch * heads, seq, dim] with the heads split:
    DTensor's strided shard of dim 0); `input` (ALiBi's bias) is cut to the same entries
    where it has them, else broadcast whole, its gradient then each rank's part, summed.

    A batched matmul treats every batch entry independently, so on the local entries it is
    exactly the op. DTensor has no such strategy for baddbmm (a replicated `input` with
    strided batches): it all-gathers the batches and computes every head on every rank, the
    attention then neither divided in time nor in memory, unlike its estimate. Any other
    placement runs the op on the DTensors.
    """

    def __init__(self, op):
        super().__init__()
        self.op = op

    def forward(self, *args, **kwargs):
        names = ("input", "batch1", "batch2")
        given = list(args[:3]) + [kwargs.pop(n, None) for n in names[len(args[:3]):]]
        if given[0] is None:  # aten's and a method call's name for it
            given[0] = kwargs.pop("self", None)
        inp, b1, b2 = given
        rest = args[3:]
        place = [t.placements[0] if isinstance(t, DTensor) else None for t in (b1, b2)]
        if place[0] is None or type(place[0]) is not type(place[1]) or \
                place[0] != place[1] or getattr(place[0], "dim", None) != 0 or \
                b1.device_mesh.ndim != 1:  # (a Shard's dim, or DTensor's strided shard's)
            return self.op(inp, b1, b2, *rest, **kwargs)
        mesh, p = b1.device_mesh, place[0]
        if isinstance(inp, DTensor):
            if inp.placements[0] == p and type(inp.placements[0]) is type(p):
                inp = inp.to_local()
            elif not inp.placements[0].is_replicate():
                return self.op(inp, b1, b2, *rest, **kwargs)
            elif inp.dim() == 3 and inp.shape[0] == b1.shape[0]:  # its own entry a batch
                inp = inp.redistribute(mesh, [p]).to_local()
            else:  # broadcast over the batch: every rank reads it whole
                inp = inp.to_local(grad_placements=[Partial()])
        out = self.op(inp, b1.to_local(), b2.to_local(), *rest, **kwargs)
        shape = torch.Size((b1.shape[0], b1.shape[1], b2.shape[2]))
        return DTensor.from_local(out, mesh, [p], run_check=False, shape=shape,
                                  stride=_contiguous_stride(shape))


def _stride_like(local: torch.Tensor, shape: torch.Size) -> tuple[int, ...]:
    """Global strides for attention's output: a fused kernel's [batch, seq, heads, dim]
    buffer viewed as [batch, heads, seq, dim] where the local output is laid out so (DTensor
    decides views by these strides: the usual transpose-and-reshape back to features then
    stays a view, as on one device, instead of a copy of the output)."""
    if local.dim() == 4 and local.transpose(1, 2).is_contiguous():
        b, h, t, d = shape
        return (t * h * d, d, h * d, 1)
    return _contiguous_stride(shape)


def _contiguous_stride(shape) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(stride))

def decompose_outside_fake() -> None:
    """DTensor's sharding propagation through an op's decomposition (ops with no strategy of
    their own: aten.polar in Llama 4's RoPE) runs on meta tensors it makes itself; under a
    FakeTensorMode (a joint trace: compile.mode = graphs, the compiler's fake world) those
    become fake and the propagation fails, so a trace refuses what an eager run computes.
    Run it with the fake mode set aside (torch 2.13: torch.distributed.tensor's
    DecompShardingStrategy._propagate_through_decomp); idempotent."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.tensor._decompositions import DecompShardingStrategy

    method = DecompShardingStrategy._propagate_through_decomp
    if getattr(method, "_outside_fake", False):
        return

    def outside(self, *args, **kwargs):
        with unset_fake_temporarily():
            return method(self, *args, **kwargs)

    outside._outside_fake = True
    DecompShardingStrategy._propagate_through_decomp = outside


_VIEWS = ("view.default", "_unsafe_view.default")


def views_follow_the_local_layout() -> None:
    """A view of a DTensor that fails where the model's view on one device succeeded copies
    first, as `reshape` would on one device. Two ways it fails, both because DTensor takes
    an op's output strides from the op's meta function, which may lay out the output
    otherwise than the CPU/CUDA kernel:
    * The DTensor's strides do not allow the view: DTensor says a fused attention output
      is [batch, heads, seq, dim] contiguous where the CPU kernel lays it out [batch, seq,
      heads, dim], so AFMoE's `output.transpose(1, 2).view(batch, seq, -1)` (a view on one
      device; the export records no copy) was refused at check. Copied contiguous first.
    * The strides allow it, the local tensor's do not: torch 2.13's meta
      `softplus_backward` is contiguous where the kernel follows a transposed gradient,
      and the linear's backward `reshape` of it chose a view on the DTensor's strides,
      which failed on the local tensor ("view size is not compatible"): Doge's backward
      at any tp > 1. The local tensor is copied into the said dim order first.
    The values are the view's; stage graphs are functional (export), so no alias is lost.
    The handler steps aside while it calls the op again (DTensor's own dispatch is in C++;
    a rank runs its compute on one thread). Idempotent."""
    handlers = DTensor._op_dispatcher._custom_op_handlers
    for name in _VIEWS:
        op = getattr(torch.ops.aten, name.split(".")[0]).default
        if op not in handlers:
            handlers[op] = _said_layout_view


def _dim_order(shape, stride) -> list[int]:
    return sorted((d for d in range(len(shape)) if shape[d] != 1), key=lambda d: -stride[d])


def _viewable(x, shape) -> bool:
    try:
        torch.empty_strided(x.shape, x.stride(), device="meta").view(shape)
        return True
    except Exception:  # (not a view of these strides)
        return False


def _in_said_order(x):
    """`x` with its local tensor copied into the dim order its DTensor strides say."""
    order = _dim_order(x.shape, x.stride())
    full = order + [d for d in range(x.ndim) if d not in order]
    local = x._local_tensor.permute(full).contiguous()
    return DTensor(local.permute([full.index(d) for d in range(x.ndim)]), x._spec,
                   requires_grad=x.requires_grad)


def _said_layout_view(op, args, kwargs):
    """The view as DTensor runs it; only where that fails, copied first and run again (a
    view that runs pays nothing but this call)."""
    x, rest = args[0], args[1:]
    handlers = DTensor._op_dispatcher._custom_op_handlers
    del handlers[op]
    try:
        try:
            return op(x, *rest, **kwargs)
        except Exception:
            local = x._local_tensor
            if not _viewable(x, rest[0]):
                x = x.contiguous()  # (DTensor's clone: the local tensor contiguous too)
            elif _dim_order(local.shape, local.stride()) != _dim_order(x.shape, x.stride()):
                x = _in_said_order(x)
            else:
                raise
            return op(x, *rest, **kwargs)
    finally:
        handlers[op] = _said_layout_view
