"""Recompute regions: which consecutive nodes of a stage graph a `recompute` rule covers,
which of their nodes drop what they save and rerun, and the compile-time refusal of a
region that writes into its inputs in place (backends/runtime/recompute.py runs the
regions; compiler/estimate/activations.py counts what they keep, by the same rules)."""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Sequence

import torch
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
    torch's FlopCounterMode) and attention, except an op writing in place (kept: rerun,
    it would write its kept input again). A collective the TP rewrite inserted reruns
    under `full` only (as Megatron-LM's full recompute: the region keeps its inputs alone,
    a sequence-parallel layer's input as its shard, and backward communicates again);
    under `selective` its output is kept (no communication in backward)."""
    if node.meta.get(COLLECTIVE):
        return region.mode == "full"
    if region.mode == "selective" and written(node):  # (it would write its kept input
        return False  # again: Falcon's `mlp_output += attention_output`)
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


def written(node: fx.Node) -> list[fx.Node]:
    """The values `node` writes into in place: the arguments an ATen op's schema marks
    written (export graphs: `aten.add_`, `aten.masked_fill_` ...), the object of a
    `Tensor.op_` method, the target of `x += y`, an `inplace=True` call's input."""
    t = node.target
    if node.op == "call_function" and isinstance(t, torch._ops.OpOverload):
        hits = [a for a, spec in zip(node.args, t._schema.arguments)
                if spec.alias_info is not None and spec.alias_info.is_write]
        hits += [node.kwargs[spec.name] for spec in t._schema.arguments
                 if spec.alias_info is not None and spec.alias_info.is_write
                 and spec.name in node.kwargs]
    elif node.op == "call_method" and t.endswith("_") and not t.endswith("__") \
            or node.op == "call_function" and t in _AUGMENTED \
            or node.op != "output" and node.kwargs.get("inplace") is True:
        hits = node.args[:1]
    else:
        hits = []
    return [a for a in hits if isinstance(a, fx.Node)]


_AUGMENTED = (operator.iadd, operator.isub, operator.imul, operator.itruediv)


def check_no_inplace_on_inputs(region: Region) -> None:
    """A recompute reruns the region on its kept inputs: an op writing into one of them
    in place would be applied twice. Under `selective` such an op in the region is kept
    (`dropped`), so what it writes must be read by nothing else in the region (a rerun
    reader would see the written value, or a rerun writer's input the unwritten one)."""
    inside = set(region.nodes)
    for n in region.nodes:
        for target in written(n):
            if target not in inside:
                raise PipeplanError(
                    f"cannot recompute module {region.module}: `{n.format_node()}` modifies "
                    f"its input {target.name} in place, which a recompute would do twice; "
                    "make the op out of place or drop the recompute rule for this module")
            others = [u for u in target.users if u is not n and u in inside]
            if region.mode == "selective" and others:
                raise PipeplanError(
                    f"cannot recompute module {region.module} selectively: `{n.format_node()}` "
                    f"overwrites {target.name} in place, which {others[0].name} also reads, "
                    "and a rerun of that read could see the other value; use full recompute "
                    "or make the op out of place")
