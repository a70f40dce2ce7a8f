"""What the tensor- and expert-parallel collectives carry, read off the traced graph.

A TP layer's collective moves one activation-sized tensor per microbatch (its
output for row-parallel layers and vocab-parallel embeddings, in forward; its
input grad for column-parallel layers and a vocab-parallel head, in backward).
A MoE layer's all-to-all moves its input tokens (top_k copies, see estimates).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.fx as fx

from .analysis import MetaRun
from .blocks import module_path, within
from .compiled import ExpertPlacement
from .partition import Split, compute_nodes


@dataclass(frozen=True)
class Traffic:
    """What one module's collective carries per microbatch, before the collective's factor."""

    module: str
    stage: int
    nbytes: int


@dataclass(frozen=True)
class ModuleCall:
    """One module's call in the graph: its stage and the bytes going in and out per microbatch."""

    stage: int
    in_bytes: int
    out_bytes: int
    input_node: Optional[str] = None  # the value it reads (layers sharing it: one collective)


def collective_traffic(model: torch.nn.Module, graph: fx.Graph, run: MetaRun, split: Split,
                       tp_kinds: dict[str, str], experts: tuple[ExpertPlacement, ...]
                       ) -> tuple[list[Traffic], list[Traffic]]:
    """(tensor-parallel traffic, MoE token traffic)."""
    calls = module_calls(graph, run, split, set(tp_kinds) | {e.module for e in experts})
    moe = [Traffic(e.module, calls[e.module].stage, calls[e.module].in_bytes)
           for e in experts if e.module in calls]
    return tensor_parallel_traffic(model, tp_kinds, calls), moe


def tensor_parallel_traffic(model: torch.nn.Module, kinds: dict[str, str],
                            calls: dict[str, ModuleCall]) -> list[Traffic]:
    """One all-reduce per row-parallel output, and one per distinct input of column-parallel
    layers (q, k and v read the same input: Megatron fuses them into one collective)."""
    out, seen_inputs = [], set()
    for name, kind in kinds.items():
        call = calls.get(name)
        if call is None:
            continue
        if _all_reduces_output(model, name, kind):
            out.append(Traffic(name, call.stage, call.out_bytes))
        elif call.input_node not in seen_inputs:
            seen_inputs.add(call.input_node)
            out.append(Traffic(name, call.stage, call.in_bytes))
    return out


def module_calls(graph: fx.Graph, run: MetaRun, split: Split, names: set[str]
                 ) -> dict[str, ModuleCall]:
    """For each named module: the stage of its first node, its first tensor input's bytes
    (from outside the module) and its last node's output bytes."""
    first: dict[str, tuple[int, fx.Node]] = {}
    last: dict[str, fx.Node] = {}
    for i, node in enumerate(compute_nodes(graph)):
        path = module_path(node)
        while path:
            if path in names:
                first.setdefault(path, (i, node))
                last[path] = node
            path = path.rpartition(".")[0]
    out = {}
    for name, (i, node) in first.items():
        inputs = [a for a in node.all_input_nodes if a.op != "get_attr" and run.is_tensor(a)
                  and not within(module_path(a), name)]
        out[name] = ModuleCall(split.stage_of(i), _nbytes(run.value(inputs[0])) if inputs else 0,
                               _nbytes(run.value(last[name])) if run.is_tensor(last[name]) else 0,
                               inputs[0].name if inputs else None)
    return out


def _all_reduces_output(model: torch.nn.Module, name: str, kind: str) -> bool:
    return kind == "row" or (kind == "vocab" and
                             isinstance(model.get_submodule(name), torch.nn.Embedding))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
