"""Recompute regions: which consecutive nodes of a stage graph a `recompute` rule covers,
which of their nodes drop what they save and rerun, and the compile-time refusal of a
region that writes into its inputs in place (backends/runtime/recompute.py runs the
regions; compiler/estimate/activations.py counts what they keep, by the same rules)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch.fx as fx

from ..dsl.ast import RecomputeRule
from ..errors import PipeplanError
from .capture.analysis import SDPA
from .capture.blocks import ATTENTION, COLLECTIVE, module_path
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


def recompute_mode(rules: Sequence[RecomputeRule], path) -> tuple[str, object]:
    """The last matching rule wins; returns (mode, the matched module)."""
    mode, module = "none", None
    for rule in rules:
        hit = outermost_match(path, rule.pattern)
        if hit is not None:
            mode, module = rule.mode, hit
    return mode, module


def is_attention(node: fx.Node) -> bool:
    """The model's attention op (or the TP rewrite's call of it on local heads)."""
    return node.op == "call_function" and node.target in SDPA or bool(node.meta.get(ATTENTION))


def dropped(region: Region, node: fx.Node, flops: float) -> bool:
    """Whether a region's node drops what it saves and reruns in backward: under `full`
    every node, under `selective` those without matmul work (`flops`, forward, counted by
    torch's FlopCounterMode) and attention. A collective the TP rewrite inserted reruns
    under `full` only (as Megatron-LM's full recompute: the region keeps its inputs alone,
    a sequence-parallel layer's input as its shard, and backward communicates again);
    under `selective` its output is kept (no communication in backward)."""
    if node.meta.get(COLLECTIVE):
        return region.mode == "full"
    return region.mode == "full" or is_attention(node) or flops == 0


def find_regions(graph: fx.Graph, rules: Sequence[RecomputeRule]) -> list[Region]:
    """Maximal runs of nodes in one matched module."""
    regions: list[Region] = []
    for node in graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        mode, module = recompute_mode(rules, module_path(node))
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
