"""The sequence rules of context parallel: one rule per op, how it moves or mixes the sequence.

Each rule takes one graph op (`Op`: its arguments, their meta values and which of their
dims carry the sequence) and returns the dims of its output that carry the sequence --
views, transposes and broadcasts move them, a linear or a norm over features keeps them
-- or raises `Mixing` (the op combines positions: a convolution, a cumulative op, a
reduction, softmax, sort or a matmul over the sequence, a shift, a concatenation along it)
or `NoRule`. `RULES` (op name -> rule, torch-level and aten names alike; aten ops tagged
pointwise need no entry) and `MODULE_RULES` (leaf module type -> op name) are the one
table; compiler/parallel/cp_locality.py walks the graph with it.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.fx as fx
from torch import nn

from . import cp_rows
from .cp import POSITIONS
from .cp_ops import (Dims, Mixing, NoRule, Op, SeqDims, _dim_list, _joined,
                     _norm, span, widest)


# ------------------------------------------------------------------------- rules
def pointwise(op: Op) -> Dims:
    """Element by element, inputs broadcast against each other (right-aligned)."""
    out = op.out
    if not isinstance(out, torch.Tensor):
        raise NoRule("its output is not a tensor")
    dims, spans = set(), {}
    for a in op.tensor_inputs():
        shift = out.dim() - op.ndim(a)
        for d in op.dims(a):
            if d + shift < 0 or out.shape[d + shift] != op.value(a).shape[d]:
                raise NoRule("its output does not keep the sequence where its inputs have it")
            dims.add(d + shift)
            spans[d + shift] = widest(spans.get(d + shift),
                                      span(op.dims(a), d, out.shape[d + shift]))
    if not any(getattr(op.dims(a), "perm", None) for a in op.tensor_inputs()):
        for a in op.plain_tensor_inputs():  # rows a sort permutes: cp_rows._not_along's
            _not_laid_along(op, a, dims)
    return SeqDims(dims, spans)


def _not_laid_along(op: Op, a: fx.Node, dims) -> None:
    """A tensor without the sequence, broadcast against it, must hold one value along it
    (size 1 there, or made of one fill value): one holding a row per local position that
    no input gives -- a table or buffer cut to the local length, a literal arange -- holds
    rank 0's rows on every cp rank."""
    t, out = op.value(a), op.out
    shift = out.dim() - t.dim()
    for d in dims:
        j = d - shift
        if 0 <= j < t.dim() and t.shape[j] != 1 and not _uniform(a) and not _numbered(a):
            raise Mixing(f"combines the sequence with `{a.name}`, which holds {t.shape[j]} "
                         "rows along it that no input gives (a parameter, buffer or "
                         "numbering cut to the local length): every cp rank would use the "
                         "first positions' rows")


UNIFORM = {"ones", "zeros", "full", "ones_like", "zeros_like", "full_like", "new_ones",
           "new_zeros", "new_full", "scalar_tensor", "fill"}  # one value everywhere
KEEPS_UNIFORM = {"expand", "expand_as", "broadcast_to", "view", "reshape", "_unsafe_view",
                 "unsqueeze", "squeeze", "to", "_to_copy", "type_as", "float", "double",
                 "clone", "contiguous", "detach", "alias", "slice", "select", "permute",
                 "transpose", "t", "getitem"}


def _numbered(node: fx.Node) -> bool:
    """`node` is computed from an arange the runtime renumbers to the rank's positions
    (cp.POSITIONS, a literal length: cp_masks.mark_positions), as rotary tables are."""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        if n.meta.get(POSITIONS):
            return True
        seen.add(n)
        todo.extend(n.all_input_nodes)
    return False


def _uniform(node: fx.Node, seen: Optional[dict] = None) -> bool:
    """`node` is made of one fill value (a factory of one value, then views, casts and
    element-wise ops of such values and scalars)."""
    seen = {} if seen is None else seen
    if node in seen:
        return seen[node]
    target = node.target
    pointwise_tag = isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags
    name = target.__name__.split(".")[0] if isinstance(target, torch._ops.OpOverload) \
        else target if isinstance(target, str) else getattr(target, "__name__", "")
    if node.op not in ("call_function", "call_method"):
        ok = False
    elif name in UNIFORM:
        ok = True
    else:
        ok = (name in KEEPS_UNIFORM or pointwise_tag) and all(
            _uniform(a, seen) for a in node.all_input_nodes)
    seen[node] = ok
    return ok


def view(op: Op) -> Dims:
    """A reshape (row-major): the output dims whose strides cover the input's sequence
    digits, and which of their digits those are (a [batch * seq * k] dim viewed as
    [batch * seq, k] carries the sequence in its first dim only)."""
    x = op.args[0]
    src, out = op.value(x), op.out
    sin, sout = _strides(src.shape), _strides(out.shape)
    dims, spans = set(), {}
    for d in op.dims(x):
        lo, hi = span(op.dims(x), d, src.shape[d])
        glo, ghi = sin[d] * lo, sin[d] * hi
        for j in range(out.dim()):
            if out.shape[j] <= 1:
                continue
            a, b = max(glo, sout[j]), min(ghi, sout[j] * int(out.shape[j]))
            if a < b:
                dims.add(j)
                spans[j] = widest(spans.get(j), (a // sout[j], -(-b // sout[j])))
    return SeqDims(dims, spans)


def _strides(shape) -> list[int]:
    """Row-major strides of a contiguous tensor of `shape`."""
    out = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        out[i] = out[i + 1] * int(shape[i + 1])
    return out


def permute(op: Op) -> Dims:
    x = op.args[0]
    n = op.ndim(x)
    order = op.args[1:] if len(op.args) > 2 or isinstance(op.arg(1, "dims"), int) \
        else op.arg(1, "dims")
    order = [_norm(int(d), n) for d in order]
    return Dims(order.index(d) for d in op.dims(x))


def transpose(op: Op) -> Dims:
    x = op.args[0]
    n = op.ndim(x)
    if op.name == "t":
        a, b = 0, 1
    else:
        a, b = _norm(int(op.arg(1, "dim0")), n), _norm(int(op.arg(2, "dim1")), n)
    swap = {a: b, b: a}
    return Dims(swap.get(d, d) for d in op.dims(x))


def reduction(op: Op) -> Dims:
    x = op.args[0]
    n = op.ndim(x)
    over = _dim_list(op.arg(1, "dim"), n)
    over = list(range(n)) if over is None else over
    hit = sorted(set(over) & op.dims(x))
    if hit:
        raise Mixing(f"reduces over the sequence (dim {hit[0]})")
    keep = bool(op.arg(2, "keepdim", False))
    moved = {d: d if keep else d - sum(o < d for o in over) for d in op.dims(x)}
    dims = SeqDims(moved.values(), {moved[d]: s for d, s in
                                    getattr(op.dims(x), "spans", {}).items()})
    return (dims, dims) if isinstance(op.out, (tuple, list)) else dims


def along(pos: int, name: str = "dim", default=-1, what: str = "runs along the sequence",
          many: bool = False):
    """An op that keeps its input's shape and combines values along one dim."""

    def rule(op: Op) -> Any:
        x = op.args[0]
        n = op.ndim(x)
        d = op.arg(pos, name, default)
        over = _dim_list(d, n) or list(range(n))
        if set(over) & op.dims(x):
            raise Mixing(what)
        dims = _joined(op, [x] + [a for a in op.tensor_inputs() if a is not x])
        return (dims,) * len(op.out) if isinstance(op.out, (tuple, list)) else dims

    return rule


def cat(op: Op) -> Dims:
    tensors = op.arg(0, "tensors")
    n = op.out.dim()
    d = _norm(int(op.arg(1, "dim", 0)), n)
    dims = set().union(*(op.dims(t) for t in tensors))
    if d in dims:
        raise Mixing("concatenates along the sequence")
    return Dims(dims)


def stack(op: Op) -> Dims:
    tensors = op.arg(0, "tensors")
    d = _norm(int(op.arg(1, "dim", 0)), op.out.dim())
    return Dims(s + (s >= d) for t in tensors for s in op.dims(t))


def split(pos: int, default=0, drops: bool = False):
    def rule(op: Op):
        x = op.args[0]
        d = _norm(int(op.arg(pos, "dim", default)), op.ndim(x))
        if d in op.dims(x):
            raise Mixing("splits the sequence into pieces")
        moved = {s: s - (drops and s > d) for s in op.dims(x)}
        dims = SeqDims(moved.values(), {moved[s]: v for s, v in
                                        getattr(op.dims(x), "spans", {}).items()})
        return tuple(dims for _ in op.out)

    return rule


def select(op: Op) -> Dims:
    x = op.args[0]
    d = _norm(int(op.arg(1, "dim")), op.ndim(x))
    if d in op.dims(x):
        raise Mixing("picks one position of the sequence")
    return Dims(s - (s > d) for s in op.dims(x))


def slice_(op: Op) -> Dims:
    x = op.args[0]
    d = _norm(int(op.arg(1, "dim", 0)), op.ndim(x))
    size = op.value(x).shape[d]
    start, end, step = (op.value(op.arg(i, n, d)) for i, n, d in
                        ((2, "start", None), (3, "end", None), (4, "step", 1)))
    if d in op.dims(x) and not _whole(start, end, step, size):
        raise Mixing("takes part of the sequence (a shift or a window)")
    return op.dims(x)


def narrow(op: Op) -> Dims:
    x = op.args[0]
    d = _norm(int(op.arg(1, "dim")), op.ndim(x))
    size = op.value(x).shape[d]
    if d in op.dims(x) and not (op.value(op.arg(2, "start")) == 0
                                and op.value(op.arg(3, "length")) == size):
        raise Mixing("takes part of the sequence (a shift or a window)")
    return op.dims(x)


def _whole(start, end, step, size) -> bool:
    return (start in (None, 0) and (end is None or (isinstance(end, int) and end >= size))
            and step in (None, 1))


def getitem(op: Op):
    x, index = op.args[0], op.args[1]
    got = op._seq.get(x)
    if isinstance(got, tuple):  # an element of a tuple-valued op
        return got[index]
    value = op.value(x)
    if not isinstance(value, torch.Tensor):
        raise NoRule("it indexes a container the rules do not follow")
    if isinstance(index, fx.Node) and isinstance(op.value(index), torch.Tensor):
        return cp_rows.index(op)  # x[idx]: one index tensor on dim 0
    items = list(index) if isinstance(index, tuple) else [index]
    if any(isinstance(i, (fx.Node, torch.Tensor, list)) for i in items):
        raise NoRule("advanced (tensor) indexing")
    n_used = sum(1 for i in items if i is not None and i is not Ellipsis)
    d_in, d_out, mapping = 0, 0, {}
    for i in items:
        if i is Ellipsis:
            skip = value.dim() - n_used
            for _ in range(skip):
                mapping[d_in] = d_out
                d_in, d_out = d_in + 1, d_out + 1
        elif i is None:
            d_out += 1
        elif isinstance(i, int):
            if d_in in op.dims(x):
                raise Mixing("picks one position of the sequence")
            d_in += 1
        elif isinstance(i, slice):
            whole = _whole(op.value(i.start), op.value(i.stop), op.value(i.step),
                           value.shape[d_in])
            if d_in in op.dims(x) and not whole:
                raise Mixing("takes part of the sequence (a shift or a window)")
            mapping[d_in] = d_out
            d_in, d_out = d_in + 1, d_out + 1
        else:
            raise NoRule(f"index {i!r}")
    while d_in < value.dim():
        mapping[d_in] = d_out
        d_in, d_out = d_in + 1, d_out + 1
    return Dims(mapping[d] for d in op.dims(x))


def linear(op: Op) -> Dims:
    x = op.args[0]
    if op.ndim(x) - 1 in op.dims(x):
        raise Mixing("contracts the sequence (a linear layer over positions)")
    return op.dims(x)


def embedding(op: Op) -> Dims:
    """aten.embedding(weight, indices); F.embedding(input, weight); nn.Embedding(input)."""
    ids = op.args[1] if isinstance(op.node.target, torch._ops.OpOverload) else op.args[0]
    return op.dims(ids)


def norm_over_last(count: Callable[[Op], int]):
    def rule(op: Op) -> Dims:
        x = op.args[0]
        n = op.ndim(x)
        if any(d >= n - count(op) for d in op.dims(x)):
            raise Mixing("normalises over the sequence")
        out = op.out
        dims = op.dims(x)
        return (dims,) * len(out) if isinstance(out, (tuple, list)) else dims

    return rule


def _normalized_count(op: Op) -> int:
    if op.module is not None:
        return len(getattr(op.module, "normalized_shape", (1,)))
    shape = op.arg(1, "normalized_shape")
    return len(shape) if isinstance(shape, (list, tuple)) else 1


def convolution(op: Op) -> Dims:
    x = op.args[0]
    weight = op.module.weight if op.module is not None else op.value(op.args[1])
    kernel = tuple(weight.shape[2:])
    if any(d >= 2 for d in op.dims(x)) and any(k > 1 for k in kernel):
        raise Mixing(f"convolves over the sequence (kernel {kernel})")
    if 1 in op.dims(x):
        raise Mixing("contracts the sequence (it is the convolution's channel dim)")
    return op.dims(x)


def matmul(op: Op) -> Dims:
    a, b = op.args[0], op.args[1]
    na, nb, no = op.ndim(a), op.ndim(b), op.out.dim()
    if na - 1 in op.dims(a) or (nb >= 2 and nb - 2 in op.dims(b)) or (nb == 1 and op.dims(b)):
        raise Mixing("contracts the sequence (a matmul over positions)")
    dims, spans = set(), {}
    for x, moved in ((a, lambda d: no - 2 if (na >= 2 and d == na - 2) else d + no - na),
                     (b, lambda d: no - 1 if d == nb - 1 else d + no - nb)):
        for d in op.dims(x):
            j = moved(d)
            dims.add(j)
            spans[j] = widest(spans.get(j), span(op.dims(x), d, op.out.shape[j]))
    return SeqDims(dims, spans)


def addmm(op: Op) -> Dims:
    """addmm/baddbmm(input, a, b): a matmul plus a broadcast input."""
    inner = Op(op.node, op.run, op._seq, "matmul")
    inner.args = op.args[1:3]
    dims = matmul(inner)
    bias = op.args[0]
    return Dims(dims | {d + op.out.dim() - op.ndim(bias) for d in op.dims(bias)})


def attention(op: Op) -> Dims:
    return op.dims(op.args[0])


def same_as_first(op: Op) -> Dims:
    """A per-position module call (the experts call: each token is routed on its own)."""
    return op.dims(op.args[0])


def constant(op: Op) -> Dims:
    return Dims()


POINTWISE = frozenset({
    "add", "sub", "mul", "div", "truediv", "floordiv", "floor_divide", "neg", "pow", "rsqrt",
    "sqrt", "exp", "log", "log1p", "expm1", "silu", "gelu", "relu", "tanh", "sigmoid",
    "softplus", "to", "type", "type_as", "float", "double", "half", "bfloat16", "long", "int",
    "bool", "clone", "contiguous", "detach", "alias", "where", "clamp", "clamp_min",
    "clamp_max", "masked_fill", "dropout", "_to_copy", "abs", "sin", "cos", "eq", "ne", "lt",
    "gt", "le", "ge", "reciprocal", "erf", "mod", "remainder", "sign", "maximum", "minimum",
    "logical_not", "logical_and", "logical_or", "zeros_like", "ones_like", "empty_like",
    "full_like", "rand_like", "randn_like", "lift_fresh_copy", "copy", "fill", "square",
    "iadd", "imul", "isub", "itruediv", "and_", "or_", "invert", "lerp", "addcmul", "addcdiv",
    "nan_to_num", "hardtanh", "leaky_relu", "elu", "mish", "hardswish", "hardsigmoid",
    "gelu_tanh", "tanh_", "requires_grad_", "float_power", "exp2", "round", "floor", "ceil",
    "trunc", "isnan", "isinf", "isfinite", "signbit", "triu_", "native_dropout", "polar",
    "complex", "real", "imag", "conj", "_conj", "resolve_conj",
})
VIEWS = frozenset({"view", "reshape", "_unsafe_view", "flatten", "unflatten", "squeeze",
                   "unsqueeze", "view_as", "reshape_as", "_reshape_alias"})
CONSTANT = frozenset({"zeros", "ones", "full", "empty", "new_zeros", "new_ones", "new_full",
                      "new_empty", "arange", "tensor", "scalar_tensor", "eye", "size", "dim",
                      "numel", "sym_size", "sym_numel", "sym_stride", "stride"})

RULES: dict[str, Callable] = {
    **{k: pointwise for k in POINTWISE}, **{k: view for k in VIEWS},
    **{k: constant for k in CONSTANT},
    "expand": pointwise, "expand_as": pointwise, "broadcast_to": pointwise,
    "permute": permute, "transpose": transpose, "swapaxes": transpose, "t": transpose,
    "sum": reduction, "mean": reduction, "amax": reduction, "amin": reduction,
    "max": reduction, "min": reduction, "prod": reduction, "var": reduction, "std": reduction,
    "norm": reduction, "logsumexp": reduction, "argmax": reduction, "argmin": reduction,
    "any": reduction, "all": reduction, "count_nonzero": reduction, "var_mean": reduction,
    "softmax": along(1, what="takes a softmax over the sequence"),
    "log_softmax": along(1, what="takes a softmax over the sequence"),
    "_softmax": along(1, what="takes a softmax over the sequence"),
    "cumsum": along(1, what="accumulates along the sequence (cumsum)"),
    "cumprod": along(1, what="accumulates along the sequence (cumprod)"),
    "cummax": along(1, what="accumulates along the sequence (cummax)"),
    "logcumsumexp": along(1, what="accumulates along the sequence (logcumsumexp)"),
    "sort": cp_rows.sort, "argsort": cp_rows.sort,
    "repeat_interleave": cp_rows.repeat_interleave, "repeat": cp_rows.repeat, "index": cp_rows.index,
    "index_put": cp_rows.index_put, "index_put_": cp_rows.index_put,
    "index_add": cp_rows.index_add, "index_add_": cp_rows.index_add,
    "histc": cp_rows.counts, "bincount": cp_rows.counts,
    **{k: cp_rows.scatter for k in ("scatter", "scatter_", "scatter_add", "scatter_add_",
                                    "scatter_reduce", "scatter_reduce_")},
    "view_as_complex": cp_rows.last_dim, "view_as_real": cp_rows.last_dim,
    "one_hot": cp_rows.last_dim,
    "topk": along(2, what="picks the top positions of the sequence"),
    "flip": along(1, "dims", what="reverses the sequence"),
    "roll": along(2, "dims", what="shifts the sequence (roll)"),
    "diff": along(2, what="differences neighbouring positions"),
    "gather": along(1, what="gathers positions along the sequence"),
    "index_select": along(1, what="picks positions of the sequence"),
    "cat": cat, "concat": cat, "concatenate": cat, "stack": stack,
    "chunk": split(2), "split": split(2), "split_with_sizes": split(2),
    "tensor_split": split(2), "unbind": split(1, drops=True),
    "select": select, "slice": slice_, "narrow": narrow, "getitem": getitem,
    "linear": linear, "embedding": embedding,
    "layer_norm": norm_over_last(_normalized_count),
    "rms_norm": norm_over_last(_normalized_count),
    "native_layer_norm": norm_over_last(_normalized_count),
    "conv1d": convolution, "conv2d": convolution, "convolution": convolution,
    "matmul": matmul, "bmm": matmul, "mm": matmul, "addmm": addmm, "baddbmm": addmm,
    "scaled_dot_product_attention": attention,
}
MODULE_RULES: dict[type, str] = {
    nn.Linear: "linear", nn.Embedding: "embedding", nn.Conv1d: "conv1d",
    nn.Conv2d: "conv2d", nn.LayerNorm: "layer_norm", nn.RMSNorm: "rms_norm",
    nn.Dropout: "dropout", nn.Identity: "alias", nn.GELU: "gelu", nn.ReLU: "relu",
    nn.SiLU: "silu", nn.Tanh: "tanh", nn.Sigmoid: "sigmoid",
}
