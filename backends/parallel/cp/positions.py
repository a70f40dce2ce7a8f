"""Positions a context-parallel stage numbers itself: each rank's global positions.

compiler/parallel/cp_locality.py marks (node.meta["pipeplan_cp_positions"]) every
`arange(length)` of the graph whose length is the sequence's (read from an input's shape, or
a literal by the whole-length twin: cp_masks.mark_positions): on a cp rank it would number
the rank's slice 0..S/cp-1; and every slice of a constant to S/cp rows from a start
(node.meta["pipeplan_cp_position_slice"], BERT's `position_ids[:, :seq]`): rank 0's rows.
`renumber_positions` replaces each with the positions (the rows) the rank holds
(`cp_columns`, which the data's slices follow too: a contiguous block under Ulysses, chunks
r and 2cp-1-r under ring attention's load-balanced layout): one `arange(start, stop)` (one
`narrow`) per contiguous run of them, concatenated, keeping the call's own dtype and device
arguments.

`gather_masks` gives each whole-sequence mask of the stage (compiler/parallel/cp_masks.py:
the model's own mask code) its inputs over the whole sequence: each rank's slice gathered
over the cp group and put back in the sequence's order (`gather_sequence`).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.fx as fx

from ....compiler.parallel.cp import POSITION_SLICE, POSITIONS
from ....dsl.ast import Plan


def cp_columns(plan: Plan, cp_rank: int) -> torch.Tensor:
    """The sequence positions context-parallel rank `cp_rank` holds (dsl/checks.py checked
    that they divide evenly): a contiguous block, or chunks r and 2cp-1-r under ring
    attention (backends/runtime/data.py slices tokens, targets and positions by them)."""
    seq, cp = plan.data.seq_len, plan.mesh.cp
    if plan.context is not None and plan.context.method == "ring":
        from .ring import ring_columns
        return ring_columns(seq, cp, cp_rank)
    return torch.arange(cp_rank * seq // cp, (cp_rank + 1) * seq // cp)


def runs(columns: torch.Tensor) -> list[tuple[int, int]]:
    """`columns` (ascending within runs) as contiguous [start, stop) runs, in order."""
    out: list[list[int]] = []
    for c in columns.tolist():
        if out and out[-1][1] == c:
            out[-1][1] = c + 1
        else:
            out.append([c, c + 1])
    return [(a, b) for a, b in out]


def renumber_positions(gm: fx.GraphModule, columns: torch.Tensor) -> int:
    """Replace every marked arange of `gm` by this rank's global positions `columns`, and
    every marked slice of a constant by its rows at `columns` (from the slice's start), in
    place; returns how many."""
    marked = [n for n in gm.graph.nodes if n.meta.get(POSITIONS) or POSITION_SLICE in n.meta]
    for node in marked:
        with gm.graph.inserting_before(node):
            new = _positions(gm.graph, node, runs(columns)) if node.meta.get(POSITIONS) \
                else _rows(gm.graph, node, runs(columns))
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
    if marked:
        gm.recompile()
    return len(marked)


def _positions(graph: fx.Graph, node: fx.Node, spans: list[tuple[int, int]]) -> fx.Node:
    """The arange `node` as this rank's positions: one arange per run, concatenated, with
    the call's own dtype and device."""
    kwargs = {k: v for k, v in node.kwargs.items() if k not in ("start", "end", "step")}
    parts = [graph.call_function(torch.arange, (a, b), kwargs) for a, b in spans]
    return parts[0] if len(parts) == 1 else graph.call_function(torch.cat, (parts,))


def _rows(graph: fx.Graph, node: fx.Node, spans: list[tuple[int, int]]) -> fx.Node:
    """The slice `node` of a constant's rows from `start` along its marked dim as the
    constant's rows at start + this rank's positions: one narrow per run, concatenated
    along that dim."""
    dim, start = node.meta[POSITION_SLICE]
    parts = [graph.call_function(torch.narrow, (node.args[0], dim, start + a, b - a))
             for a, b in spans]
    return parts[0] if len(parts) == 1 else graph.call_function(torch.cat, (parts, dim))


def gather_sequence(t: torch.Tensor, dim: int, group, layout: torch.Tensor) -> torch.Tensor:
    """This rank's slice `t` of a sequence (positions cp_columns(rank) along `dim`) gathered
    over the cp group into the whole sequence, in order. `layout`: every rank's columns,
    concatenated in rank order. Model inputs only (no gradient flows back)."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    order = torch.empty_like(layout)
    order[layout] = torch.arange(len(layout))  # whole position p sits at order[p]
    return torch.cat(parts, dim).index_select(dim, order.to(t.device))


def gather_masks(gm: fx.GraphModule, plan: Plan, group) -> int:
    """Point every WholeSequenceMask of `gm` at `gather_sequence` over `group`; returns how
    many."""
    from ....compiler.parallel.cp_masks import WholeSequenceMask

    layout = torch.cat([cp_columns(plan, r) for r in range(plan.mesh.cp)])
    masks = [m for m in gm.modules() if isinstance(m, WholeSequenceMask)]
    for m in masks:
        m.gather = lambda t, dim: gather_sequence(t, dim, group, layout)
    return len(masks)
