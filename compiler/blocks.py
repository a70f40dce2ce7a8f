"""Module-level blocks: the units a pipeline split may start at.

A model's blocks are its children, with containers (ModuleList, Sequential,
ModuleDict) and wrappers that hold the repeated layers opened up: GPT gives
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
    """The model's block names, in registration order."""
    out: list[str] = []

    def visit(module: torch.nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            path = f"{prefix}{name}"
            if isinstance(child, _CONTAINERS) or _holds_layers(child):
                visit(child, path + ".")
            else:
                out.append(path)

    visit(model, "")
    return out


def _holds_layers(module: torch.nn.Module) -> bool:
    """True for wrappers like `LlamaForCausalLM.model` that hold a stack of layers."""
    return any(isinstance(m, _CONTAINERS) and len(m) >= 2 for m in module.modules())


def module_path(node: fx.Node) -> Optional[str]:
    """The qualified name of the deepest module `node` was traced in (None: the root)."""
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
