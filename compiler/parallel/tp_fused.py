"""Fused projections under tensor parallelism: one column Linear whose output the graph cuts.

Phi-3's `qkv_proj` is one Linear whose output features the forward slices into
q, k and v (`qkv[..., :q]`, ...); its `gate_up_proj` output is chunked into gate
and up. A plain column split hands rank 0 the first half of the rows (all of q
and part of k). What the graph's cuts reveal decides the split instead: the
features are divided into *segments* at every boundary a cut names, and each
rank holds its 1/tp of every segment (backends/parallel/tp/fused.py permutes
the weight's rows so: rank r's shard is [q_r; k_r; v_r]), so each part is
column-split on its own and stays whole heads per rank.

Recognised cuts of the Linear's output, on its last dim only:

    slice      aten.slice(out, -1, start, end) / out[..., start:end] / out[:, :, start:end]
    split      aten.split / split_with_sizes / torch.split / Tensor.split
    chunk      aten.chunk / torch.chunk / Tensor.chunk

A column output that is cut and also used whole (or cut on another dim) is
refused at its plan line, as is a segment tp does not divide. A per-head
interleaved layout (GPT-NeoX: the output viewed as [..., heads, 3 * head_dim],
then chunked) needs nothing: the view puts whole heads on each rank.

This module records what it found on the graph's nodes (`FUSED` on the Linear:
its segments; `CUTS` on each cut: the (start, end) ranges it takes), which the
runtime rewrite reads; the parameter itself is found through the graph's use,
never by its name.
"""
from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.fx as fx

from ...dsl.ast import Plan
from ...dsl.errors import PlanError

FUSED = "pipeplan_fused_segments"  # on a column Linear: ((start, length), ...) of its features
ROWS_RESTORED = "pipeplan_rows_restored"  # on the view back from a Linear use's token rows
CUTS = "pipeplan_fused_cuts"  # on a cut of it: ((start, end), ...), one per part it returns

_SLICES = (torch.ops.aten.slice.Tensor,)
_SPLITS = (torch.ops.aten.split.Tensor, torch.ops.aten.split_with_sizes.default, torch.split)
_CHUNKS = (torch.ops.aten.chunk.default, torch.chunk)


def _arg(node: fx.Node, i: int, key: str, default):
    return node.args[i] if len(node.args) > i else node.kwargs.get(key, default)


def _ranges(sizes, features: int) -> tuple[tuple[int, int], ...]:
    out, at = [], 0
    for s in sizes:
        out.append((at, min(at + s, features)))
        at += s
    return tuple(r for r in out if r[0] < r[1])


def cut_of(user: fx.Node, features: int, ndim: int) -> Optional[tuple[tuple[int, int], ...]]:
    """The feature ranges `user` takes from a [..., features] value (None: not a cut of the
    last dim)."""
    def last(dim) -> bool:
        return isinstance(dim, int) and dim % ndim == ndim - 1

    op, target = user.op, user.target
    if op == "call_function" and target in _SLICES:
        dim, start, end = _arg(user, 1, "dim", 0), _arg(user, 2, "start", None), \
            _arg(user, 3, "end", None)
        if not last(dim) or _arg(user, 4, "step", 1) != 1:
            return None
        return _slice_range(start, end, features)
    if op == "call_function" and target is operator.getitem and len(user.args) == 2:
        index = user.args[1]
        leading = index[:-1] if isinstance(index, tuple) and index else None
        last_only = leading == (Ellipsis,) or leading is not None and len(index) == ndim \
            and all(i == slice(None) for i in leading)
        if last_only and isinstance(index[-1], slice) and index[-1].step in (None, 1):
            return _slice_range(index[-1].start, index[-1].stop, features)
        return None
    split = op == "call_function" and target in _SPLITS or op == "call_method" and \
        target == "split"
    chunk = op == "call_function" and target in _CHUNKS or op == "call_method" and \
        target == "chunk"
    if not (split or chunk):
        return None
    if not last(_arg(user, 2, "dim", 0)):
        return None
    size = _arg(user, 1, "split_size_or_sections" if split else "chunks", None)
    if chunk and isinstance(size, int):
        return _ranges([-(-features // size)] * size, features)
    if isinstance(size, int):
        return _ranges([size] * -(-features // size), features)
    if isinstance(size, (list, tuple)) and all(isinstance(s, int) for s in size):
        return _ranges(size, features)
    return None


def _slice_range(start, end, features: int) -> Optional[tuple[tuple[int, int], ...]]:
    if not all(v is None or isinstance(v, int) for v in (start, end)):
        return None
    s, e, _ = slice(start, end).indices(features)
    return ((s, e),) if s < e else None


def find_segments(plan: Plan, key: str, name: str, node: fx.Node, run,
                  out: Optional[fx.Node] = None) -> tuple:
    """The segments of column Linear `node`'s output features its cuts reveal (recorded on
    the nodes; () when nothing cuts it), refused at `key` where they cannot be split.
    `out`: where its output has the model's leading dims (tp.features_out), the value cut."""
    out = node if out is None else out
    value = run.value(out)
    features, ndim = value.shape[-1], value.dim()
    cuts = {u: cut_of(u, features, ndim) for u in out.users}
    if not any(c is not None for c in cuts.values()):
        return ()
    whole = [u for u, c in cuts.items() if c is None]
    if whole:
        cut = next(u for u, c in cuts.items() if c is not None)
        raise PlanError.at(plan, key, f"column-parallel {name}'s output is cut into parts "
                           f"(at {cut.name}) and also used otherwise (at {whole[0].name}), so "
                           "no split of its rows holds whole parts on each rank",
                           "split the fused Linear into one Linear per part, or leave it "
                           "out of the column patterns")
    bounds = sorted({0, features} | {b for c in cuts.values() for r in c for b in r})
    segments = tuple((a, b - a) for a, b in zip(bounds, bounds[1:]))
    tp = plan.mesh.tp
    for start, length in segments:
        if length % tp:
            raise PlanError.at(plan, key, f"tp = {tp} does not divide the part "
                               f"[{start}, {start + length}) of {name}'s {features} output "
                               "features the graph cuts out (a fused projection is split "
                               "part by part)", "pick tp among the divisors of every part")
    node.meta[FUSED] = segments
    for u, c in cuts.items():
        u.meta[CUTS] = c
    return segments

