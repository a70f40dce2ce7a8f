"""Where a column-parallel output's split dim goes: followed through the graph's views,
transposes and cuts, as DTensor's sharding propagation carries it (backends' tp rewrite).

A column layer's output is split on its features (its last dim); the runtime runs the
ops after it on DTensors, which keep that split only while each op can: a view that
unflattens the features into [..., heads, head_dim] moves it to the heads when tp divides
them (else DTensor gathers the whole output on every rank), a transpose or an unsqueeze
moves it, a cut of another dim keeps it, and a cut *of the split dim itself* gathers it
(each rank's shard would not hold whole parts) -- except the cuts of the Linear's own
output that tp_fused.py turns into segments. A gather there is no error in the maths
(`verify` stays EQUAL), but the attention then runs whole on every rank: neither its time
nor its memory is divided, while every estimate divides them. So such a split is refused
at its plan line (a written pattern), or left whole (`plan = auto`).

Multi-query attention is the case in the field: Falcon views its fused query_key_value as
[..., heads + 2, head_dim] and splits off the one key and one value head on that dim;
GPTBigCode splits its c_attn output [..., embed + 2 * head_dim] after an unsqueeze. Their
key/value head is one, which no tp > 1 divides (Megatron replicates it; pipeplan keeps
the projection whole).

The walk follows shape-only ops (views, transposes, unsqueeze / squeeze, casts, copies)
and cuts; it stops, the split taken as kept, at any op that computes (a matmul, the
attention, a cat, an elementwise op of several inputs) and at a flatten that makes the
split dim a non-leading part of a merged dim (DTensor's strided shard: BLOOM's [batch *
heads, ...]).
"""
from __future__ import annotations

import operator
from typing import Iterator, Optional

import torch
import torch.fx as fx

from .tp_fused import cut_of

VIEWS = {"view", "reshape", "unflatten", "flatten"}
VIEW_FNS = (torch.ops.aten.view.default, torch.ops.aten.reshape.default,
            torch.ops.aten._unsafe_view.default, torch.reshape, torch.flatten,
            torch.ops.aten.flatten.using_ints, torch.ops.aten.unflatten.int)
_SAME = {"contiguous", "clone", "detach", "to", "float", "half", "bfloat16", "double",
         "type_as", "alias"}
_SAME_FNS = (torch.ops.aten.clone.default, torch.ops.aten.contiguous.default,
             torch.ops.aten.alias.default, torch.ops.aten.detach.default,
             torch.ops.aten._to_copy.default, torch.ops.aten.to.dtype,
             torch.ops.aten.to.dtype_layout, torch.ops.aten.lift_fresh_copy.default)
_CUT_NAMES = {"slice", "narrow", "select", "split", "split_with_sizes", "chunk", "unbind",
              "tensor_split", "index_select"}
_CUT = ("the graph cuts {{name}}'s output on the dim tp splits (at {at}), so no rank's shard "
        "holds whole parts: DTensor would gather it whole on every rank")
_LIMIT = 256  # nodes followed from one output (the ops between a Linear and its row partner)


def is_view(n: fx.Node) -> bool:
    return n.op == "call_method" and n.target in VIEWS or \
        n.op == "call_function" and n.target in VIEW_FNS


def gathered_at(out: fx.Node, run, tp: int, name: str = "the Linear") -> Optional[str]:
    """Why the ops after column output `out` (module `name`'s, split on its last dim)
    would make DTensor gather it (None: the split is kept to the ops computing with it)."""
    value = run.value(out)
    todo, seen = [(out, value.dim() - 1, True)], 0
    while todo and seen < _LIMIT:
        node, dim, start = todo.pop()
        seen += 1
        for user in node.users:
            if not run.is_tensor(user) and not _returns_parts(user):
                continue
            found = _step(node, user, dim, start, run, tp)
            if isinstance(found, str):
                return found.format(name=name)
            todo += [(n, d, False) for n, d in found]
    return None


def _step(node: fx.Node, user: fx.Node, dim: int, start: bool, run, tp: int):
    """The values `user` carries the split to ([(node, dim)]; [] where the walk stops), or
    why it gathers."""
    before = tuple(run.value(node).shape)
    name = _op_name(user)
    if is_view(user):
        return _through_view(before, tuple(run.value(user).shape), dim, user, tp)
    if name in ("transpose", "swapaxes", "swapdims", "t", "permute", "movedim",
                "unsqueeze", "squeeze", "expand"):
        moved = _moved(user, before, dim, run)
        return [] if moved is None else [(user, moved)]
    if name in _SAME or user.op == "call_function" and user.target in _SAME_FNS:
        return [(user, dim)]
    if start and cut_of(user, before[-1], len(before)) is not None:
        return [(p, dim) for p in _parts(user)]  # a segment cut (tp_fused.py)
    if name in _CUT_NAMES or user.target is operator.getitem:
        return _through_cut(user, before, dim, run)
    return []


def _op_name(n: fx.Node) -> str:
    if n.op == "call_method":
        return n.target
    if n.op != "call_function":
        return ""
    packet = getattr(n.target, "_overloadpacket", None)
    return getattr(packet or n.target, "__name__", "")


def _arg(node: fx.Node, i: int, key: str, default):
    return node.args[i] if len(node.args) > i else node.kwargs.get(key, default)


def _norm(d, ndim: int) -> Optional[int]:
    return d % ndim if isinstance(d, int) and ndim else None


# --------------------------------------------------------------------------- views
def _groups(a: tuple, b: tuple) -> Iterator[tuple[list[int], list[int]]]:
    """The dims of shape `a` and of shape `b` (same numel) that a view maps onto each
    other, group by group (size-1 dims belong to none)."""
    i = j = 0
    while i < len(a) and j < len(b):
        if a[i] == 1:
            i += 1
            continue
        if b[j] == 1:
            j += 1
            continue
        ins, outs, pa, pb = [i], [j], a[i], b[j]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb:
                ins.append(i)
                pa *= a[i]
                i += 1
            else:
                outs.append(j)
                pb *= b[j]
                j += 1
        yield ins, outs


def _through_view(before: tuple, after: tuple, dim: int, user: fx.Node, tp: int):
    for ins, outs in _groups(before, after):
        if dim not in ins:
            continue
        if dim != ins[0]:
            return []  # a non-leading part of a merged dim: DTensor's strided shard
        if after[outs[0]] % tp:
            return (f"tp = {tp} does not divide the {after[outs[0]]} heads of {{name}} (the "
                    f"graph views its output as {list(after)} at {user.name})")
        return [(user, outs[0])]
    return []


def _moved(user: fx.Node, before: tuple, dim: int, run) -> Optional[int]:
    """Where a transpose / permute / unsqueeze / squeeze / expand puts dim `dim`."""
    name, ndim = _op_name(user), len(before)
    after = tuple(run.value(user).shape)
    if name in ("transpose", "swapaxes", "swapdims"):
        a, b = _norm(_arg(user, 1, "dim0", None), ndim), _norm(_arg(user, 2, "dim1", None), ndim)
        return None if a is None or b is None else b if dim == a else a if dim == b else dim
    if name == "t":
        return 1 - dim if ndim == 2 else dim
    if name == "permute":
        order = user.args[1:] if len(user.args) > 2 else _arg(user, 1, "dims", None)
        order = [_norm(d, ndim) for d in order or ()]
        return order.index(dim) if dim in order else None
    if name in ("unsqueeze", "squeeze", "expand", "movedim"):
        # the split dim keeps its size and order among the dims of size > 1
        big = [d for d in range(ndim) if before[d] > 1]
        if name == "movedim" or dim not in big:
            return None
        rank = big.index(dim)
        after_big = [d for d in range(len(after)) if after[d] > 1]
        if name == "expand":
            after_big = [d for d in after_big if d >= len(after) - ndim
                         and before[d - (len(after) - ndim)] > 1]
        return after_big[rank] if rank < len(after_big) else None
    return None


# ---------------------------------------------------------------------------- cuts
def _returns_parts(n: fx.Node) -> bool:
    return _op_name(n) in ("split", "split_with_sizes", "chunk", "unbind", "tensor_split")


def _parts(user: fx.Node) -> list[fx.Node]:
    if _returns_parts(user):
        return [g for g in user.users if g.op == "call_function" and g.target is operator.getitem]
    return [user]


def _through_cut(user: fx.Node, before: tuple, dim: int, run):
    """A cut of the split dim gathers; a cut of another dim carries it to its parts."""
    ndim = len(before)
    if user.target is operator.getitem:
        return _through_index(user, before, dim)
    name = _op_name(user)
    default = 0 if name != "index_select" else None
    at = _norm(_arg(user, 1 if name in ("slice", "narrow", "select", "unbind",
                                        "index_select") else 2, "dim", default), ndim)
    if at is None:
        return []
    if at == dim:
        return _CUT.format(at=user.name)
    out = dim - 1 if name in ("select", "unbind") and at < dim else dim
    return [(p, out) for p in _parts(user)]


def _through_index(user: fx.Node, before: tuple, dim: int):
    index = user.args[1]
    index = index if isinstance(index, tuple) else (index,)
    if any(isinstance(i, fx.Node) or not isinstance(i, (int, slice, type(None), type(...)))
           for i in index):
        return []  # advanced indexing: not followed
    used = sum(1 for i in index if i is not None and i is not Ellipsis)
    full, at, out = [], 0, 0
    for i in index:
        if i is Ellipsis:
            full += [slice(None)] * (len(before) - used)
        else:
            full.append(i)
    for i in full:
        if i is None:
            out += 1
            continue
        if at == dim:
            if isinstance(i, int) or i != slice(None) and \
                    slice(i.start, i.stop, i.step).indices(before[at]) != (0, before[at], 1):
                return _CUT.format(at=user.name)
            return [(user, out)]
        at, out = at + 1, out + (0 if isinstance(i, int) else 1)
    return [(user, out + dim - at)]


# ------------------------------------------------------- the split through computation
# reductions by name (over `dim`, else every dim): tp_auto asks whether one mixes the split
# A convolution reads a weight over every channel (Inkling's depthwise short convolution of
# k and v after their projections): tp splits no such weight, so a split cannot pass
# through one (it crashed in the first forward after `check` passed).
_CONVOLUTIONS = {"convolution", "_convolution", "conv1d", "conv2d", "conv3d",
                 "conv_transpose1d", "conv_transpose2d", "conv_transpose3d"}


def is_convolution(n: fx.Node) -> bool:
    if n.op == "call_module":
        return isinstance(n.graph.owning_module.get_submodule(n.target),
                          torch.nn.modules.conv._ConvNd)
    return n.op in ("call_function", "call_method") and _op_name(n) in _CONVOLUTIONS


def between(column: fx.Node, linear: dict, is_tensor) -> Iterator[fx.Node]:
    """The ops on the way from a column layer's output to the Linears it reaches first
    (tensor values only; the Linears and the graph's output not included)."""
    seen, frontier = {column}, [u for u in column.users if is_tensor(u)]
    while frontier:
        n = frontier.pop()
        if n in seen or n in linear or n.op == "output":
            continue
        seen.add(n)
        yield n
        frontier.extend(u for u in n.users if is_tensor(u))


def convolution_between(column: fx.Node, linear: dict, is_tensor) -> Optional[fx.Node]:
    """A convolution on the way from a column layer's output to its row layers, or None."""
    return next((n for n in between(column, linear, is_tensor) if is_convolution(n)), None)


REDUCTIONS = {"mean", "sum", "var", "std", "var_mean", "std_mean", "amax", "amin", "max",
              "min", "norm", "linalg_vector_norm", "logsumexp", "prod", "all", "any"}


def split_dims(out: fx.Node, run, tp: int, stop) -> dict[fx.Node, int]:
    """Each value reached from column output `out` (split on its last dim) without passing
    a node `stop(node)` names, and the dim that carries the split in it: through the walk
    above's views, transposes and cuts, elementwise ops (broadcast right-aligned: the
    split dim keeps its size) and reductions over other dims. A value reached otherwise,
    or where the split's place is unclear, is left out (callers take the worst there)."""
    dims = {out: run.value(out).dim() - 1}
    todo = [out]
    while todo:
        node = todo.pop()
        for user in node.users:
            if user in dims or stop(user) or not run.is_tensor(user):
                continue
            found = _carried(node, user, dims[node], run, tp)
            if found is not None:
                dims[user] = found
                todo.append(user)
    return dims


def _carried(node: fx.Node, user: fx.Node, dim: int, run, tp: int) -> Optional[int]:
    before, after = run.value(node), run.value(user)
    if not isinstance(after, torch.Tensor):
        return None
    name = _op_name(user)
    if name in REDUCTIONS:
        at = reduced_dims(user, before.dim())
        if at is None or dim in at:
            return None
        keep = bool(_arg(user, _dim_at(user) + 1, "keepdim", False))
        return dim if keep else dim - sum(1 for a in at if a < dim)
    if _pointwise(user):
        moved = dim + after.dim() - before.dim()
        return moved if 0 <= moved < after.dim() and after.shape[moved] == before.shape[dim] \
            else None
    found = _step(node, user, dim, False, run, tp)
    return found[0][1] if isinstance(found, list) and len(found) == 1 and \
        found[0][0] is user else None


def reduced_dims(n: fx.Node, ndim: int) -> Optional[set]:
    """The dims a reduction call reduces over (normalized); None: every dim, or unknown."""
    dims = _arg(n, _dim_at(n), "dim", None)
    if dims is None or isinstance(dims, (list, tuple)) and not dims:
        return None
    dims = dims if isinstance(dims, (list, tuple)) else (dims,)
    out = {_norm(d, ndim) for d in dims}
    return None if None in out else out


def _dim_at(n: fx.Node) -> int:
    """The position of a reduction's `dim` argument (a norm's order comes first)."""
    return 2 if _op_name(n) in ("norm", "linalg_vector_norm") else 1


def _pointwise(n: fx.Node) -> bool:
    if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload):
        return torch.Tag.pointwise in n.target.tags
    return n.op in ("call_function", "call_method") and _op_name(n) in _ELEMENTWISE


_ELEMENTWISE = {"add", "sub", "mul", "div", "truediv", "pow", "rsqrt", "sqrt", "exp", "tanh",
                "sigmoid", "neg", "abs", "silu", "gelu", "relu", "where", "clamp"}
