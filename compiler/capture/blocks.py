"""Module-level blocks: the units a pipeline split may start at.

A model's blocks are its children, with the layer stacks (containers) and the
wrappers that hold them opened up: GPT gives
`tok_emb, pos_emb, layers.0 .. layers.N, ln_f, lm_head`; a transformers
`LlamaForCausalLM` gives `model.embed_tokens, model.rotary_emb, model.layers.0 ..,
model.norm, lm_head`. Every graph node belongs to the block of the deepest
module it was traced in (nodes outside any block are glue: they go with the
block before them).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.fx as fx

_CONTAINERS = (torch.nn.ModuleList, torch.nn.Sequential, torch.nn.ModuleDict)


def blocks_of(model: torch.nn.Module) -> list[str]:
    """The model's block names, in registration order.

    The layer stacks are the outermost containers (ModuleList, Sequential, ModuleDict with
    two or more entries; a container inside a stack's layer, e.g. a MoE's expert list, is
    part of that layer). Every module on the way down to a stack is opened; the stack's
    entries and everything else along the way are blocks.
    """
    stacks = _outermost_containers(model)
    opened = {p.rpartition(".")[0] if "." in p else "" for p in stacks}
    for path in list(opened):  # the ancestors of the stacks are opened too
        while path:
            path = path.rpartition(".")[0]
            opened.add(path)
    opened |= set(stacks)
    out: list[str] = []

    def visit(module: torch.nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            path = f"{prefix}{name}"
            if path in opened:
                visit(child, path + ".")
            else:
                out.append(path)

    visit(model, "")
    return out


def _outermost_containers(model: torch.nn.Module) -> list[str]:
    found: list[str] = []

    def visit(module: torch.nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            path = f"{prefix}{name}"
            if isinstance(child, _CONTAINERS) and len(child) >= 2:
                found.append(path)  # do not look inside: inner containers belong to its layers
            else:
                visit(child, path + ".")

    visit(model, "")
    return found


# node.meta keys a runtime rewrite sets on the nodes it inserts (backends' parallel/tp):
TRACED_IN = "pipeplan_traced_in"  # the module path of the node it serves (module_path)
COLLECTIVE = "pipeplan_collective"  # it communicates: only `full` recompute reruns it
ATTENTION = "pipeplan_attention"  # it is the model's attention op, on local heads


def module_path(node: fx.Node) -> Optional[str]:
    """The qualified name of the deepest module `node` was traced in (None: the root)."""
    if TRACED_IN in node.meta:
        return node.meta[TRACED_IN]
    if node.op == "call_module":
        return node.target
    if node.op == "get_attr":
        return node.target.rpartition(".")[0] or None
    stack = node.meta.get("nn_module_stack")
    if stack:
        path = next(reversed(stack.values()))[0]
        return path or None
    return None


def block_of(path: Optional[str], blocks: set[str]) -> Optional[str]:
    """The block containing module `path`, or None for root-level glue."""
    while path:
        if path in blocks:
            return path
        path = path.rpartition(".")[0]
    return None


def within(path: Optional[str], module: str) -> bool:
    """Whether module `path` is `module` or inside it."""
    return path is not None and (path == module or path.startswith(module + "."))
