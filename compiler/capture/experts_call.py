"""Keep each experts module one opaque call in the captured graph, under fx and export alike.

Expert parallelism distributes exactly one call: `experts(hidden, top_k_index,
top_k_weights)` (docs/parallelism.md, "The MoE interface"). The capture must
therefore leave that call in the graph as a `call_module` node targeting the
model's own experts module, whatever the front end:

* fx: the experts modules are leaf modules of the tracer (capture.py).
* export: `torch.export` inlines every module and has no leaf modules. While it
  traces, each experts module is swapped for `_OpaqueExperts`, whose forward is
  the custom op `pipeplan::experts_call` (a fake kernel gives its output shape:
  the shape of `hidden`). After export, `restore_experts_calls` turns every such
  op node back into `call_module(<the experts module's name>)`, so the stage
  GraphModule calls the model's own module there, with its own autograd, and its
  parameters keep their original names. The op never runs for real.
"""
from __future__ import annotations

import contextlib
import inspect
from typing import Iterator

import torch
import torch.fx as fx

__all__ = ["opaque_experts", "restore_experts_calls", "EXPERTS_OP"]


@torch.library.custom_op("pipeplan::experts_call", mutates_args=())
def _experts_call(hidden: torch.Tensor, top_k_index: torch.Tensor,
                  top_k_weights: torch.Tensor, name: str) -> torch.Tensor:
    raise RuntimeError(f"pipeplan::experts_call({name}) is a capture placeholder; the "
                       f"captured graph calls the experts module itself")


@_experts_call.register_fake
def _(hidden, top_k_index, top_k_weights, name):
    return torch.empty_like(hidden)


EXPERTS_OP = torch.ops.pipeplan.experts_call.default


class _OpaqueExperts(torch.nn.Module):
    """Stands in for an experts module while export traces: one op call, same arguments."""

    def __init__(self, name: str, signature: inspect.Signature):
        super().__init__()
        self.qualified_name, self.signature = name, signature

    def forward(self, *args, **kwargs):
        bound = self.signature.bind(*args, **kwargs)
        hidden, index, weights = list(bound.arguments.values())[:3]
        return _experts_call(hidden, index, weights, self.qualified_name)


@contextlib.contextmanager
def opaque_experts(model: torch.nn.Module, names: tuple[str, ...]) -> Iterator[None]:
    """Within the block, the experts modules `names` are swapped for one op call each."""
    swapped = []
    try:
        for name in names:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            module = parent.get_submodule(child)
            parent.register_module(child, _OpaqueExperts(name, inspect.signature(module.forward)))
            swapped.append((parent, child, module))
        yield
    finally:
        for parent, child, module in reversed(swapped):
            parent.register_module(child, module)


def restore_experts_calls(graph: fx.Graph) -> set[str]:
    """Replace each `pipeplan::experts_call` node by a call of the module it stands for;
    returns the module names called."""
    called = set()
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is EXPERTS_OP:
            hidden, index, weights, name = node.args
            with graph.inserting_before(node):
                call = graph.call_module(name, (hidden, index, weights))
            call.meta = dict(node.meta)
            node.replace_all_uses_with(call)
            graph.erase_node(node)
            call._rename(node.name)
            called.add(name)
    return called



def captured_value(node: fx.Node):
    """A meta stand-in for an experts call's output, from the value export recorded for the
    placeholder op (for the meta run when the module's kernels cannot run on meta: torch's
    grouped_mm demands bf16 there, so transformers' default experts fail). None: no record."""
    val = node.meta.get("val")
    if node.op != "call_module" or not isinstance(val, torch.Tensor):
        return None
    return torch.empty(val.shape, dtype=val.dtype, device="meta").requires_grad_(
        val.is_floating_point())
