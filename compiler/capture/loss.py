"""The training loss, appended to the captured graph so the last stage returns it.

One function, `combine_loss`, defines the loss for both uses: called on real
tensors it is the single-process reference; called on fx Proxies it records the
same ops into the graph. The two therefore agree bit for bit.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.fx.proxy import GraphAppendingTracer, Proxy

LOSS_KINDS = ("cross_entropy", "mse", "model")
TARGETS = "targets"


def split_outputs(outputs: Any) -> tuple[Any, list]:
    """(first output, the outputs after it): the model's prediction and its extra values."""
    if isinstance(outputs, (tuple, list)):
        return outputs[0], list(outputs[1:])
    if isinstance(outputs, Mapping):  # dict, transformers ModelOutput
        values = [v for v in outputs.values() if v is not None]
        return values[0], values[1:]
    return outputs, []


def combine_loss(kind: str, first: Any, aux: Sequence[Any], targets: Any) -> Any:
    """Loss of one microbatch: mean over its tokens, plus the model's scalar aux losses.
    With kind "model" the model's first output is its whole loss, as the model defines it
    (transformers' MoE models given labels: cross-entropy + router_aux_loss_coef * their
    aux_loss, which they also return unweighted): nothing is added to it."""
    if kind == "cross_entropy":
        loss = F.cross_entropy(first.flatten(0, -2), targets.flatten())
    elif kind == "mse":
        loss = F.mse_loss(first, targets)
    elif kind == "model":
        return first
    else:
        raise ValueError(f"unknown loss kind {kind!r}")
    for a in aux:
        loss = loss + a
    return loss


def reference_loss(kind: str, outputs: Any, targets: Any = None) -> torch.Tensor:
    """The loss of the unmodified model's `outputs`, exactly as the compiled graph computes it."""
    first, rest = split_outputs(outputs)
    return combine_loss(kind, first, [a for a in rest if _is_scalar(a)], targets)


def append_loss(graph: fx.Graph, kind: str, outputs: Any, is_scalar) -> fx.Node:
    """Make the graph return the loss of the model's `outputs` (a structure of nodes).

    Returns the loss node (named "loss"). `is_scalar(node)` tells which of the
    extra outputs are scalar aux losses to add. For kinds needing targets, a
    `targets` placeholder is added after the inputs.
    """
    first, rest = split_outputs(outputs)
    targets = None
    if kind != "model":
        last_placeholder = [n for n in graph.nodes if n.op == "placeholder"][-1]
        with graph.inserting_after(last_placeholder):
            targets = graph.placeholder(TARGETS)
    tracer = GraphAppendingTracer(graph)
    aux = [Proxy(a, tracer) for a in rest if isinstance(a, fx.Node) and is_scalar(a)]
    loss = combine_loss(kind, Proxy(first, tracer), aux,
                        Proxy(targets, tracer) if targets is not None else None).node
    loss._rename("loss")
    graph.output((loss,))
    graph.eliminate_dead_code()
    return loss


def _is_scalar(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.dim() == 0
