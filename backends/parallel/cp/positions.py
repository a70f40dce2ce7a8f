"""Positions a context-parallel stage numbers itself: each rank's global positions.

compiler/parallel/cp_locality.py marks (node.meta["pipeplan_cp_positions"]) every
`arange(length)` of the graph whose length is the sequence's (read from an input's shape):
on a cp rank it would number the rank's slice 0..S/cp-1. `renumber_positions` replaces
each with the positions the rank holds (`cp_columns`, which the data's slices follow too: a
contiguous block under Ulysses, chunks r and 2cp-1-r under ring attention's load-balanced
layout): one `arange(start, stop)` per contiguous run of them, concatenated, keeping the
call's own dtype and device arguments.

`gather_masks` gives each whole-sequence mask of the stage (compiler/parallel/cp_masks.py:
the model's own mask code) its inputs over the whole sequence: each rank's slice gathered
over the cp group and put back in the sequence's order (`gather_sequence`).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.fx as fx

from ....compiler.parallel.cp import POSITIONS
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
    """Replace every marked arange of `gm` by this rank's global positions `columns`, in
    place; returns how many."""
    marked = [n for n in gm.graph.nodes if n.meta.get(POSITIONS)]
    for node in marked:
        kwargs = {k: v for k, v in node.kwargs.items() if k not in ("start", "end", "step")}
        with gm.graph.inserting_before(node):
            parts = [gm.graph.call_function(torch.arange, (a, b), kwargs)
                     for a, b in runs(columns)]
            new = parts[0] if len(parts) == 1 else gm.graph.call_function(torch.cat, (parts,))
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
    if marked:
        gm.recompile()
    return len(marked)


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
