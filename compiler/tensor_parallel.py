"""Tensor-parallel annotations: which Linear/Embedding layers are column-, row- or vocab-parallel.

Megatron's pairing: a column-parallel layer splits its output features (each
rank computes whole attention heads or a slice of the FFN), the row-parallel
layer after it splits its input features and all-reduces its output; the
embedding and LM head split the vocabulary. Every annotation is checked against
the real shapes, so a plan that cannot split evenly fails at its plan line.
"""
from __future__ import annotations

import difflib
from typing import Optional

import torch

from ..dsl.ast import Plan
from ..dsl.errors import PlanError
from .patterns import matches

KINDS = ("column", "row", "vocab")
_HEADS = ("heads", "num_heads", "n_heads", "num_attention_heads", "n_head")
_KV_HEADS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "kv_heads")


def tp_annotations(plan: Plan, model: torch.nn.Module) -> dict[str, str]:
    """qualified module -> "column" | "row" | "vocab", checked against the model's shapes."""
    tp = plan.mesh.tp
    modules = dict(model.named_modules())
    names = [n for n in modules if n]
    out: dict[str, str] = {}
    for kind in KINDS:
        for i, pattern in enumerate(getattr(plan.tensor, kind)):
            key = f"tensor.{kind}.{i}"
            hits = [n for n in names if matches(n, pattern)]
            if not hits:
                close = difflib.get_close_matches(pattern, names, n=1)
                raise PlanError.at(plan, key, f"no module matches {pattern!r}",
                                   f"did you mean {close[0]!r}?" if close else
                                   "patterns are module paths such as layers.*.attn.q")
            for name in hits:
                _check(plan, key, kind, name, modules[name], tp, _head_dim(model, modules, name))
                out[name] = kind
    return out


def _check(plan: Plan, key: str, kind: str, name: str, module: torch.nn.Module, tp: int,
           head_dim: Optional[tuple[int, str]]) -> None:
    if kind == "vocab":
        if isinstance(module, torch.nn.Embedding):
            size = module.num_embeddings
        elif isinstance(module, torch.nn.Linear):
            size = module.out_features
        else:
            raise PlanError.at(plan, key, f"{name} is a {type(module).__name__}; vocab-parallel "
                               "needs an Embedding or the LM head Linear")
        if size % tp:
            raise PlanError.at(plan, key, f"tp = {tp} does not divide the vocabulary of {name} "
                               f"({size})", "pad the vocabulary to a multiple of tp")
        return
    if not isinstance(module, torch.nn.Linear):
        raise PlanError.at(plan, key, f"{name} is a {type(module).__name__}; {kind}-parallel "
                           "needs a Linear", "annotate the Linear layers inside it")
    features = module.out_features if kind == "column" else module.in_features
    what = "output" if kind == "column" else "input"
    if features % tp:
        raise PlanError.at(plan, key, f"tp = {tp} does not divide the {features} {what} "
                           f"features of {name}", "pick tp among the divisors of the layer width")
    if head_dim is not None:
        dim, label = head_dim
        if features % dim == 0 and (features // dim) % tp:
            raise PlanError.at(plan, key, f"tp = {tp} does not divide the {features // dim} "
                               f"{label} of {name}",
                               "each tensor-parallel rank must hold whole attention heads")


def _head_dim(model: torch.nn.Module, modules: dict, name: str) -> Optional[tuple[int, str]]:
    """(head size, "heads"/"KV heads") if `name` sits in an attention module that says so."""
    parent = name.rpartition(".")[0]
    config = getattr(model, "config", None)
    owner = modules.get(parent)
    attention = _attr(owner, _HEADS) or "attention" in type(owner).__name__.lower()
    if not attention:
        return None
    heads = _attr(owner, _HEADS) or _attr(config, _HEADS)
    if not heads:
        return None
    dim = _attr(owner, ("head_dim",)) or _attr(config, ("head_dim",))
    if not dim:
        hidden = _attr(config, ("hidden_size", "d_model", "n_embd"))
        q = next((m for n, m in modules.items() if n.startswith(parent + ".")
                  and isinstance(m, torch.nn.Linear)), None)
        width = hidden or (q.out_features if q is not None else None)
        if not width or width % heads:
            return None
        dim = width // heads
    leaf = name.rpartition(".")[2]
    kv = _attr(owner, _KV_HEADS) or _attr(config, _KV_HEADS)
    label = "KV heads" if kv and kv != heads and leaf.startswith(("k", "v")) else "heads"
    return dim, label


def _attr(obj, names: tuple[str, ...]) -> Optional[int]:
    for n in names:
        v = getattr(obj, n, None)
        if isinstance(v, int) and v > 0:
            return v
    return None
