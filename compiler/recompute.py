"""Recompute regions: which consecutive nodes of a stage graph a `recompute` rule covers,
and the compile-time refusal of a region that writes into its inputs in place
(backends/runtime/recompute.py runs the regions)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch.fx as fx

from ..dsl.ast import RecomputeRule
from ..errors import PipeplanError
from .capture.blocks import module_path
from .patterns import outermost_match


def draws_random(node: fx.Node) -> bool:
    """Nodes that draw random numbers (dropout), so a recompute must replay the RNG in order."""
    name = str(node.target).lower() if node.op != "call_module" else ""
    return "dropout" in name or "bernoulli" in name or "rand" in name or \
        node.op == "call_module" and "dropout" in type(
            node.graph.owning_module.get_submodule(node.target)).__name__.lower()


@dataclass
class Region:
    """Consecutive nodes traced inside one module matched by a recompute rule."""

    module: str
    mode: str  # full | selective
    nodes: list[fx.Node] = field(default_factory=list)


def find_regions(graph: fx.Graph, rules: Sequence[RecomputeRule]) -> list[Region]:
    """Maximal runs of nodes in one matched module (the last matching rule wins, as in
    compiler/estimate/costs.py)."""
    regions: list[Region] = []
    for node in graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        mode, module = "none", None
        path = module_path(node)
        for rule in rules:
            hit = outermost_match(path, rule.pattern)
            if hit is not None:
                mode, module = rule.mode, hit
        if mode == "none":
            continue
        prev = regions[-1] if regions else None
        if prev is not None and prev.module == module and prev.mode == mode \
                and prev.nodes[-1].next is node:
            prev.nodes.append(node)
        else:
            regions.append(Region(module, mode, [node]))
    return regions


def check_no_inplace_on_inputs(region: Region) -> None:
    """A recompute reruns the region on its kept inputs: an op writing into one of them
    in place would be applied twice."""
    inside = set(region.nodes)
    for n in region.nodes:
        inplace = (n.op == "call_method" and n.target.endswith("_") and not n.target.endswith("__")
                   or n.kwargs.get("inplace") is True)
        target = n.args[0] if n.args else None
        if inplace and isinstance(target, fx.Node) and target not in inside:
            raise PipeplanError(
                f"cannot recompute module {region.module}: `{n.format_node()}` modifies its "
                f"input {target.name} in place, which a recompute would do twice; make the op "
                "out of place or drop the recompute rule for this module")
