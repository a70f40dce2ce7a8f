"""Fused projections split part by part: the weight's rows regrouped, the graph's cuts redone.

compiler/parallel/tp_fused.py found, on a column Linear whose output the graph
cuts (Phi-3's q/k/v slices, gate/up chunk), the *segments* of its output
features. Here:

* rank r's shard of the weight (and bias) is its 1/tp of every segment, stacked:
  [q_r; k_r; v_r] (`pieces`), so the DTensor this rank holds as Shard(0) is the
  *regrouped* weight W' = [q_0; k_0; v_0; q_1; k_1; v_1 ...] (stacked on dim 1, held
  as Shard(1), for a weight stored [in, out]: GPT-2's Conv1D);
* the Linear's output is then in W''s order, and each cut of it is redone on
  that order (`take_part`): viewed as [..., tp, features / tp], a part [a, b) is
  [..., a / tp : b / tp] of the last dim, flattened back -- exactly the model's
  part, each rank holding its 1/tp of it (DTensor keeps the split through the
  view, the slice and the flatten);
* `ungroup` turns the all-gathered W' back into the model's own layout (verify,
  checkpoints of full tensors).
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ....compiler.capture.blocks import TRACED_IN, module_path
from ....compiler.parallel.tp_fused import CUTS, FUSED, ROWS_RESTORED
from ...state.materialize import Pieces, Slice

SEGMENTS = "_tp_fused_segments"  # on a rewritten stage: parameter name -> its segments


def fused_parameters(uses: dict) -> dict[str, tuple]:
    """Parameter (get_attr) name -> segments, for the weight and bias of every cut Linear
    (`uses`: the stage's tp.linear_uses)."""
    out = {}
    for n, use in uses.items():
        if n.meta.get(FUSED):
            for p in (use.weight, use.bias):
                if isinstance(p, fx.Node) and p.op == "get_attr":
                    out[p.target] = n.meta[FUSED]
    return out


def pieces(segments, dim: int, rank: int, tp: int) -> Pieces:
    """Rank `rank`'s 1/tp of every segment, along `dim`."""
    return Pieces(tuple(Slice(dim, start + rank * (length // tp), length // tp)
                        for start, length in segments))


def take_part(out: torch.Tensor, tp: int, start: int, end: int) -> torch.Tensor:
    """Features [start, end) of the model's output from the regrouped one."""
    grouped = out.unflatten(-1, (tp, out.shape[-1] // tp))
    return grouped[..., start // tp:end // tp].flatten(-2)


def take_parts(out: torch.Tensor, tp: int, ranges) -> list[torch.Tensor]:
    return [take_part(out, tp, a, b) for a, b in ranges]


def recut(gm: fx.GraphModule, node: fx.Node, tp: int) -> None:
    """Redo every cut of cut Linear `node`'s output on the regrouped order (cut after the
    view back from its token rows, where there is one: ROWS_RESTORED)."""
    g = gm.graph
    back = [u for u in node.users if u.meta.get(ROWS_RESTORED)]
    node = back[0] if back else node
    for user in list(node.users):
        ranges = user.meta[CUTS]
        single = user.target in (torch.ops.aten.slice.Tensor, operator.getitem)
        with g.inserting_before(user):
            new = g.call_function(take_part, (node, tp) + ranges[0]) if single else \
                g.call_function(take_parts, (node, tp, ranges))
        new.meta = dict(user.meta)
        new.meta[TRACED_IN] = module_path(user)
        user.replace_all_uses_with(new)
        g.erase_node(user)


def ungroup(full: torch.Tensor, segments, tp: int, dim: int = 0) -> torch.Tensor:
    """The model's layout of an all-gathered regrouped tensor (split on `dim`)."""
    ranks = full.chunk(tp, dim=dim)
    parts, at = [], 0
    for _, length in segments:
        parts += [r.narrow(dim, at, length // tp) for r in ranks]
        at += length // tp
    return torch.cat(parts, dim=dim)
