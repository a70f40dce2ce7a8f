"""The vocabulary of the context-parallel locality rules: what a rule sees and returns.

`Op` is one graph node as a rule sees it; a rule returns the dims of the node's output
that carry the sequence (`Dims`, or `SeqDims` where more is known: which part of a
flattened dim is the sequence, or that the rows are a sort's permutation of positions),
or raises `Mixing` / `NoRule`. The rules themselves are in cp_rules.py (the table) and
cp_rows.py (sorted rows and flattened token rows).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

Dims = frozenset  # the dims of one tensor value that carry the sequence


class SeqDims(frozenset):
    """Sequence dims with more known. `spans[d] = (lo, hi)`: of dim d's index, the
    sequence is the digit with strides lo up to hi (index = outer * hi + position * lo +
    inner, hi = lo * positions) -- a flattened [batch * seq] dim, or token rows each
    repeated k times; a dim without an entry is the sequence throughout (lo 1, hi its
    size), which is what every rule may assume. `perm`: the rows along the one dim are a
    sort's permutation of positions (cp_rows.Perm), `keys`: they are the sorted keys."""

    def __new__(cls, dims=(), spans=None, perm=None, keys: bool = False):
        self = super().__new__(cls, dims)
        self.spans = {d: s for d, s in (spans or {}).items() if d in self}
        self.perm, self.keys = perm, keys
        return self


def span(dims, d: int, size: int) -> tuple[int, int]:
    """The stride range of dim `d` (of `size`) that holds the sequence (see SeqDims)."""
    known = dims.spans.get(d) if isinstance(dims, SeqDims) else None
    return known or (1, int(size))


def widest(a: Optional[tuple[int, int]], b: tuple[int, int]) -> tuple[int, int]:
    """Two claims on one dim's sequence digits: the union (fewer ops pass over it)."""
    return b if a is None else (min(a[0], b[0]), max(a[1], b[1]))


class Mixing(Exception):
    """The op combines positions along the sequence (message: how)."""


class NoRule(Exception):
    """No rule says how the op treats the sequence."""


class Op:
    """One graph node as the rules see it: its arguments (self first for methods and
    modules), the meta values of its tensors and the sequence dims of its inputs."""

    def __init__(self, node: fx.Node, run, seq: dict, name: str,
                 module: Optional[nn.Module] = None):
        self.node, self.run, self._seq, self.name, self.module = node, run, seq, name, module
        self.args, self.kwargs = node.args, node.kwargs

    def arg(self, i: int, name: str, default=None):
        if len(self.args) > i:
            return self.args[i]
        return self.kwargs.get(name, default)

    def value(self, a):
        return self.run.value(a) if isinstance(a, fx.Node) else a

    def dims(self, a) -> Dims:
        got = self._seq.get(a) if isinstance(a, fx.Node) else None
        return got if isinstance(got, frozenset) else Dims()

    def ndim(self, a) -> int:
        return self.value(a).dim()

    @property
    def out(self):
        return self.run.value(self.node)

    def tensor_nodes(self) -> list[fx.Node]:
        """The arguments that carry the sequence (rows, or a sort's order: cp_rows)."""
        return [a for a in pytree.tree_leaves((self.args, self.kwargs))
                if isinstance(a, fx.Node) and self._seq.get(a) is not None
                and not (isinstance(self._seq[a], frozenset) and not self._seq[a])]

    def plain_tensor_inputs(self) -> list[fx.Node]:
        """The tensor arguments without the sequence."""
        return [a for a in pytree.tree_leaves((self.args, self.kwargs))
                if isinstance(a, fx.Node) and a not in self.tensor_nodes()
                and isinstance(self.value(a), torch.Tensor)]

    def tensor_inputs(self) -> list[fx.Node]:
        return [a for a in pytree.tree_leaves((self.args, self.kwargs))
                if isinstance(a, fx.Node) and isinstance(self._seq.get(a), frozenset)
                and self._seq[a]]


def _norm(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def _dim_list(d, ndim: int) -> Optional[list[int]]:
    """A dim argument as a list of non-negative dims; None: all dims."""
    if d is None or (isinstance(d, (list, tuple)) and len(d) == 0):
        return None
    if isinstance(d, (list, tuple)):
        return [_norm(int(x), ndim) for x in d]
    return [_norm(int(d), ndim)]


def _joined(op: Op, tensors) -> Dims:
    """The sequence dims of same-shaped inputs kept in place: their union, each dim's
    sequence digits the widest any input claims (SeqDims.spans)."""
    spans: dict = {}
    for a in tensors:
        for d in op.dims(a):
            spans[d] = widest(spans.get(d), span(op.dims(a), d, op.value(a).shape[d]))
    return SeqDims(spans, spans)
