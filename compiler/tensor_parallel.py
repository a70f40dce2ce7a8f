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
import torch.fx as fx

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


def check_pairing(plan: Plan, graph: fx.Graph, model: torch.nn.Module, kinds: dict[str, str],
                  is_tensor) -> None:
    """Megatron pairing on the traced graph: what a column-parallel layer computes (split
    features) must reach a row-parallel layer before any other Linear or the loss, and a
    row-parallel layer must read what a column-parallel layer computed. Only tensor values
    carry features (`is_tensor(node)`); sizes read off a tensor do not."""
    if not kinds:
        return
    linear = _linear_calls(graph, model)
    for node, name in linear.items():
        kind = kinds.get(name)
        if kind == "column":
            for hit in _first_linears(node, linear, True, is_tensor):
                if hit is None or kinds.get(linear[hit]) != "row":
                    what = "the loss" if hit is None else \
                        f"{linear[hit]}, which is not row-parallel"
                    raise PlanError.at(plan, _key_of(plan, "column", name),
                                       f"column-parallel {name} feeds {what}",
                                       "Megatron pairing: each column-parallel layer's output goes "
                                       "(through elementwise ops or attention) into a row-parallel "
                                       "layer; annotate that layer as row")
        elif kind == "row":
            for hit in _first_linears(node, linear, False, is_tensor):
                if hit is None or kinds.get(linear[hit]) != "column":
                    what = "the model input" if hit is None else \
                        f"{linear[hit]}, which is not column-parallel"
                    raise PlanError.at(plan, _key_of(plan, "row", name),
                                       f"row-parallel {name} reads {what}",
                                       "Megatron pairing: a row-parallel layer reads the split "
                                       "features a column-parallel layer computed")


def _linear_calls(graph: fx.Graph, model: torch.nn.Module) -> dict[fx.Node, str]:
    """Graph nodes that apply a Linear module -> its qualified name (fx and export graphs)."""
    modules = dict(model.named_modules())
    out = {}
    for n in graph.nodes:
        if n.op == "call_module" and isinstance(modules.get(n.target), torch.nn.Linear):
            out[n] = n.target
        elif n.op == "call_function" and n.target in _LINEAR_FUNCTIONS and len(n.args) > 1 \
                and isinstance(n.args[1], fx.Node) and n.args[1].op == "get_attr":
            owner = n.args[1].target.rpartition(".")[0]
            if isinstance(modules.get(owner), torch.nn.Linear):
                out[n] = owner
    return out


_LINEAR_FUNCTIONS = (torch.nn.functional.linear, torch.ops.aten.linear.default)


def _first_linears(start: fx.Node, linear: dict[fx.Node, str], forward: bool, is_tensor):
    """The first Linear calls reached from `start` along tensor values (None: the graph's
    end, or the model's inputs)."""
    seen, frontier = {start}, list(_next(start, forward, is_tensor))
    while frontier:
        n = frontier.pop()
        if n in seen:
            continue
        seen.add(n)
        if n in linear:
            yield n
        elif n.op in ("output", "placeholder"):
            yield None
        elif n.op != "get_attr":  # parameters are not activations
            following = list(_next(n, forward, is_tensor))
            if forward and not following:
                yield None
            frontier.extend(following)


def _next(n: fx.Node, forward: bool, is_tensor):
    nodes = n.users if forward else n.all_input_nodes
    return [m for m in nodes if m.op in ("output", "placeholder") or is_tensor(m)]


def _key_of(plan: Plan, kind: str, name: str) -> str:
    for i, pattern in enumerate(getattr(plan.tensor, kind)):
        if matches(name, pattern):
            return f"tensor.{kind}.{i}"
    return f"tensor.{kind}"
