"""Token rows under context parallel: flattened tokens, repeated rows, and rows a sort
permutes and puts back (MoE dispatch), proven per position from the graph.

An MoE layer flattens [batch, seq] into token rows, repeats each row once per chosen
expert (transformers' batched_mm experts) or sorts the (token, expert) slots by expert id
and runs each expert on its contiguous group (grouped_mm, a hand-written dispatch), then
puts the rows back in token order and sums each token's slots. Sorting is a mixing op in
general (which rows end up where depends on every other row); what makes the layer per
position is that the sorted order is used only to permute rows and is then inverted:

* `sort`/`argsort` of a 1-D tensor along its sequence dim gives `Perm` (the permutation
  P): the sorted values are rows permuted by P (`SeqDims.perm`, `keys`), the indices are
  `Rank(P)` -- usable only to gather rows (`x[P]`, `x[P // k]` for the token of slot P
  when x's rows are the slots' tokens), to build the inverse (`inv[P] = arange(n)`:
  `Inverse(P)`, then `y[inv]` is back in position order), or to add rows back into
  their positions (`index_add(0, P // k, y)`);
* ops on rows permuted by one P that treat rows independently (the cp_rules rule of the
  op proves it) keep them permuted by P; combining them with a tensor laid out along the
  rows, or with rows in position order, is refused;
* `histc`/`bincount` of the sorted keys (and their `cumsum`) are `Groups(P)`: only a
  grouped matmul may take them as its group offsets, which makes row i use the group of
  its own key -- a per-row op. Any other use (a rank within the group, a capacity cut)
  depends on the other rows and is refused as mixing.

`scatter` along a non-sequence dim (a router's mask over experts) and view_as_complex /
view_as_real / one_hot (only the last dim changes) are rules on rows too.

`repeat_interleave` with an int count repeats rows: the sequence digit's stride grows by
the count (`SeqDims.spans`), so viewing [tokens * k] as [tokens, k] and summing over k is
per position (cp_rules.view). Parameter rows gathered by per-position ids (`w[ids]`, the
experts' weights per slot) are per position.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .cp import ARANGE, SORTED_ROWS
from .cp_ops import Dims, Mixing, NoRule, Op, SeqDims, _joined, _norm, span


class Perm:
    """One sort of positions: its node, its row count and the sorted tensor's sequence
    digits (SeqDims.spans) -- what the inverse restores."""

    def __init__(self, node: fx.Node, n: int, lo_hi: tuple[int, int]):
        self.node, self.n, self.span = node, n, lo_hi


class Tag:
    """A value derived from a sort's order (not rows of data): Rank, Inverse, Blank, Groups."""

    def __init__(self, perm: Perm, div: int = 1, cumulative: bool = False):
        self.perm, self.div, self.cumulative = perm, div, cumulative


class Rank(Tag):
    """The sort's indices (divided by `div`): the position each sorted row came from."""


class Inverse(Tag):
    """inv with inv[P] = arange(n): gathering permuted rows by it restores position order."""


class Blank(Tag):
    """empty_like(P): where the inverse is written."""


class Groups(Tag):
    """Counts of the sorted keys per key value (cumulative: their running sum, the group
    offsets of a grouped matmul)."""


def sorted_by(got):
    """The Perm of a value derived from a sort (None: in position order or no sequence)."""
    if isinstance(got, Tag):
        return got.perm
    if isinstance(got, SeqDims) and got.perm is not None:
        return got.perm
    return None


def _mixing(op: Op, perm: Perm) -> Mixing:
    return Mixing(f"uses the order `{perm.node.name}` sorts the positions in (which depends "
                  "on the other positions) other than to permute rows and put them back")


# ---------------------------------------------------------------- rules (cp_rules.RULES)
def sort(op: Op):
    """sort/argsort: along another dim, per position; a 1-D sort of positions, a Perm."""
    x = op.args[0]
    dims, n = op.dims(x), op.ndim(x)
    d = _norm(int(op.arg(1, "dim", -1)), n)
    if d not in dims:
        got = SeqDims(dims, getattr(dims, "spans", {}))
        return got if op.name == "argsort" else (got, got)
    if n != 1 or sorted_by(op._seq.get(x)) is not None:
        raise Mixing("sorts along the sequence")
    size = int(op.value(x).shape[0])
    perm = Perm(op.node, size, span(dims, 0, size))
    descending = bool(op.arg(2, "descending", False))
    if op.name == "argsort":
        return Rank(perm)
    return SeqDims({0}, perm=perm, keys=not descending), Rank(perm)


def repeat_interleave(op: Op) -> Dims:
    """repeat_interleave(x, k: int, dim): row i of the output is row i // k of x."""
    x, k = op.args[0], op.arg(1, "repeats")
    dims = op.dims(x)
    if not isinstance(k, int):
        raise NoRule("repeats given as a tensor")
    d = op.arg(2, "dim")
    if d is None:
        raise NoRule("repeat_interleave without a dim flattens the tensor")
    d = _norm(int(d), op.ndim(x))
    spans = dict(getattr(dims, "spans", {}))
    if d in dims:
        lo, hi = span(dims, d, op.value(x).shape[d])
        spans[d] = (lo * k, hi * k)
    return SeqDims(dims, spans)


def repeat(op: Op) -> Dims:
    """x.repeat(*sizes): tiles; the sequence digits keep their strides (a tiled dim's
    copies are an outer digit), leading new dims shift the others."""
    x = op.args[0]
    sizes = op.args[1:] if len(op.args) > 2 or isinstance(op.args[1], int) else op.args[1]
    shift = len(sizes) - op.ndim(x)
    dims = op.dims(x)
    return SeqDims({d + shift for d in dims},
                   {d + shift: v for d, v in getattr(dims, "spans", {}).items()})


def index(op: Op):
    """x[i] with one index tensor on dim 0 (aten index, a tensor getitem)."""
    x = op.args[0]
    i = op.args[1]
    if isinstance(i, (list, tuple)):
        if len(i) != 1:
            raise NoRule("indexing with several index tensors")
        i = i[0]
    if not isinstance(i, fx.Node):
        raise NoRule("index that is not one tensor")
    gx, gi = op._seq.get(x), op._seq.get(i)
    perm = sorted_by(gx) or sorted_by(gi)
    if isinstance(gx, Tag):  # reading the sort's order or counts at some rows
        raise _mixing(op, perm)
    if perm is None:
        if op.dims(x):
            raise Mixing("gathers positions along the sequence")
        if op.value(i).dtype == torch.bool:
            raise Mixing("selects positions by a mask")
        return SeqDims(op.dims(i), getattr(op.dims(i), "spans", {}))  # w[ids]: per id
    if isinstance(gi, Rank) and sorted_by(gx) is None and op.dims(x) == {0}:
        k, size = gi.div, int(op.value(x).shape[0])
        lo, hi = perm.span
        if size * k == perm.n and lo % k == 0 and span(op.dims(x), 0, size) == (lo // k,
                                                                                 hi // k):
            return SeqDims({0}, perm=perm)  # row i: x's row for sorted row i's position
    if isinstance(gi, SeqDims) and not op.dims(x):
        return SeqDims(gi, perm=perm)  # w[sorted keys]: each sorted row's own weights
    if isinstance(gi, Inverse) and isinstance(gx, SeqDims) and gx.perm is perm and gx == {0}:
        return SeqDims({0}, {0: perm.span})  # back in position order
    raise _mixing(op, perm)


def index_put(op: Op):
    """inv[P] = arange(n) on empty_like(P): the inverse permutation."""
    base, indices, values = op.args[0], op.args[1], op.arg(2, "values")
    gb = op._seq.get(base)
    gi = op._seq.get(indices[0]) if len(indices) == 1 else None
    perm = sorted_by(gb) or sorted_by(gi)
    if perm is None:
        raise NoRule("writes rows of a sequence tensor")
    if isinstance(gb, Blank) and isinstance(gi, Rank) and gi.div == 1 and gb.perm is perm \
            and gi.perm is perm and _counts_up(op, values, perm.n):
        return Inverse(perm)
    raise _mixing(op, perm)


def _counts_up(op: Op, values, n: int) -> bool:
    """`values` is arange(n): 0, 1, ..., n-1 (start 0, step 1)."""
    if not isinstance(values, fx.Node) or values.target not in ARANGE:
        return False
    args = values.args
    start, end = (args[0], args[1]) if len(args) >= 2 else (0, args[0] if args else None)
    step = args[2] if len(args) > 2 else values.kwargs.get("step", 1)
    if op.value(start) == 0 and op.value(step) == 1 and op.value(end) == n:
        values.meta[SORTED_ROWS] = True  # numbers this rank's rows: not positions (cp.py)
        return True
    return False


def index_add(op: Op):
    """out.index_add(0, P // k, rows permuted by P): each row added to its position."""
    base, dim, idx, src = op.args[0], op.args[1], op.args[2], op.args[3]
    gi, gs = op._seq.get(idx), op._seq.get(src)
    perm = sorted_by(gi) or sorted_by(gs)
    if perm is None:
        if op.dims(src) or op.dims(idx) or _norm(int(dim), op.ndim(base)) in op.dims(base):
            raise Mixing("adds rows into positions the index names")
        return op.dims(base)
    size = int(op.value(base).shape[0])
    lo, hi = perm.span
    k = gi.div if isinstance(gi, Rank) else 0
    back = (k and _norm(int(dim), op.ndim(base)) == 0 and isinstance(gs, SeqDims)
            and gs.perm is perm and gs == {0} and size * k == perm.n and lo % k == 0
            and op.dims(base) in (set(), {0})
            and (not op.dims(base) or span(op.dims(base), 0, size) == (lo // k, hi // k)))
    if back:
        return SeqDims({0}, {0: (lo // k, hi // k)})
    raise _mixing(op, perm)


def counts(op: Op):
    """histc/bincount: counts over every element -- over the sequence, if it has one."""
    if op.dims(op.args[0]):
        raise Mixing("counts values over the sequence")
    return Dims()


GROUPED = ("_grouped_mm", "_grouped_mm_fallback", "grouped_mm", "grouped_mm_fallback")
CASTS = frozenset({"to", "_to_copy", "float", "int", "long", "double", "type", "clone",
                   "contiguous", "alias", "detach"})


def on_sorted(op: Op, perm: Perm, rule):
    """An op taking a value derived from `perm` (rows permuted by it or its tags);
    `rule`: the op's cp_rules rule (None: none)."""
    name = op.name
    got = [op._seq.get(a) for a in op.tensor_nodes()]
    tags = [g for g in got if isinstance(g, Tag)]
    if any(sorted_by(g) not in (None, perm) for g in got):
        raise Mixing("combines rows of two different sorts")
    if rule in (sort, index, index_put, index_add):
        return rule(op)
    if name == "getitem" and isinstance(op.args[1], fx.Node) and \
            isinstance(op.value(op.args[1]), torch.Tensor):
        return index(op)  # x[idx]
    if name in GROUPED:
        offs = op._seq.get(op.arg(2, "offs"))
        if isinstance(offs, Groups) and offs.cumulative and not op.dims(op.args[1]):
            return SeqDims({0}, perm=perm)  # row i runs its own key's group: per row
        raise _mixing(op, perm)
    if tags:
        return _on_tag(op, perm, name, tags)
    if name in ("histc", "bincount"):
        keys = op._seq.get(op.args[0])
        bins, lo, hi = op.arg(1, "bins", 100), op.arg(2, "min", 0), op.arg(3, "max", 0)
        if keys.keys and (name == "bincount" or (lo == 0 and hi == bins - 1)):
            return Groups(perm)
        raise _mixing(op, perm)
    if rule is None:
        raise NoRule("no rule for it")
    return _lift(op, perm, rule, got)


def _on_tag(op: Op, perm: Perm, name: str, tags: list):
    tag = tags[0]
    if len(tags) == 1 and name in ("floor_divide", "floordiv", "div") and \
            isinstance(tag, Rank) and isinstance(op.args[1], int) and op.args[1] > 0 and \
            (name != "div" or op.kwargs.get("rounding_mode") == "floor"):
        return Rank(perm, tag.div * op.args[1])
    if len(tags) == 1 and name in ("empty_like", "zeros_like") and isinstance(tag, Rank):
        return Blank(perm)
    if len(tags) == 1 and name in CASTS:
        return tag
    if len(tags) == 1 and name == "cumsum" and isinstance(tag, Groups) and \
            not tag.cumulative and _norm(int(op.arg(1, "dim")), 1) == 0:
        return Groups(perm, cumulative=True)
    raise _mixing(op, perm)


def _lift(op: Op, perm: Perm, rule, got):
    """The op's own rule on rows permuted alike: per row there, per row here -- unless a
    tensor laid out along the rows (in position order, or numbering them) joins in."""
    if any(isinstance(g, frozenset) and g and getattr(g, "perm", None) is None for g in got):
        raise Mixing("combines rows sorted by `{}` with rows in position order".format(
            perm.node.name))
    keys = all(getattr(g, "keys", False) for g in got if g) and op.name in CASTS
    out = rule(op)
    outs = out if isinstance(out, tuple) else (out,)
    value = op.out
    values = value if isinstance(value, (tuple, list)) else (value,)
    for dims, v in zip(outs, values):
        if len(dims) > 1:
            raise NoRule("it spreads sorted rows over several dims")
        for a in op.plain_tensor_inputs():
            _not_along(op, a, dims, v)
    wrap = [SeqDims(d, perm=perm, keys=keys) if d else d for d in outs]
    return tuple(wrap) if isinstance(out, tuple) else wrap[0]


def _not_along(op: Op, a: fx.Node, dims, out) -> None:
    """A tensor without the sequence joining permuted rows: it must not vary along them
    (a weight of a linear or a 2-D matmul operand does not line up with the rows)."""
    t = op.value(a)
    if op.name in ("linear", "mm", "matmul", "bmm", "grouped_mm") and t.dim() <= 2:
        return
    shift = out.dim() - t.dim()
    for d in dims:
        j = d - shift
        if 0 <= j < t.dim() and t.shape[j] != 1:
            raise Mixing("combines sorted rows with a tensor laid out along them (it "
                         "would number or weight rows by their sorted place)")


# ------------------------------------------- rows written by index, complex pairs
def scatter(op: Op) -> Dims:
    """scatter(self, dim, index, src | value) and scatter_add/scatter_reduce: row p of the
    output is row p of self with row p of index/src written into it along `dim` -- per
    position when `dim` is not the sequence and self, index (and src) all carry the
    sequence in the same dims at the same length (a router's mask over experts)."""
    x, d, idx = op.args[0], op.arg(1, "dim"), op.arg(2, "index")
    n = op.ndim(x)
    src = op.args[3] if len(op.args) > 3 else op.kwargs.get("src", op.kwargs.get("value"))
    tensors = [a for a in (x, idx, src) if isinstance(a, fx.Node)]
    seq = set().union(*(op.dims(a) for a in tensors))
    if _norm(int(d), n) in seq:
        raise Mixing("scatters along the sequence")
    for a in tensors:
        if set(op.dims(a)) != seq or any(op.value(a).shape[s] != op.out.shape[s] for s in seq):
            raise Mixing("writes rows by an index or source not laid out along the sequence")
    return _joined(op, tensors)


def last_dim(op: Op) -> Dims:
    """An op that changes only the last dim: view_as_complex ([..., 2] real pairs ->
    [...] complex; the pair dim must not be the sequence), view_as_real (the reverse),
    one_hot (a new last dim of classes). The other dims stay where they are."""
    x = op.args[0]
    if op.name == "view_as_complex" and op.ndim(x) - 1 in op.dims(x):
        raise Mixing("pairs up neighbouring positions of the sequence as complex numbers")
    return SeqDims(op.dims(x), getattr(op.dims(x), "spans", {}))
