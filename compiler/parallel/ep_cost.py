"""What one call of an experts module costs when its tokens are really routed.

The capture keeps the experts call opaque (experts_call.py), so the meta run
sees one `call_module` node. Its FLOPs are measured on the module's own ops
(traced with make_fx on meta tensors, so a grouped matmul is costed as
analysis.py does), twice: with the call's k slots per token and with 2k. An
implementation that computes per routed slot (transformers' grouped_mm /
batched_mm, a token dispatch) doubles; one that runs every expert on every
token and mixes by the weights (the dense reference formulation of
examples/models/moe_gpt.py) does not, and dispatched for real it costs
top_k / num_experts of what it measured.
"""
from __future__ import annotations

import copy
from typing import Optional

import torch
import torch.fx as fx
from torch.func import functional_call
from torch.fx.experimental.proxy_tensor import make_fx

from ..capture.analysis import MetaRun


class _Call(torch.nn.Module):
    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.inner = module

    def forward(self, *xs):
        return self.inner(*xs)


def _graph(module: torch.nn.Module, args: tuple) -> fx.GraphModule:
    """The module's ops on meta: make_fx, or torch.export when a kernel cannot run on meta
    (transformers then picks its grouped-matmul custom op, which can)."""
    state = {n: torch.empty_like(t, device="meta") for n, t in
             (*module.named_parameters(), *module.named_buffers())}
    try:
        return make_fx(lambda *xs: functional_call(module, state, xs))(*args)
    except RuntimeError:
        meta = copy.copy(module)
        meta._parameters = {n: torch.nn.Parameter(state[n]) for n in module._parameters}
        return torch.export.export(_Call(meta), args, strict=False).module()


def _flops(module: torch.nn.Module, args: tuple) -> Optional[float]:
    key = (type(module), tuple((n, tuple(p.shape)) for n, p in module.named_parameters()),
           tuple((tuple(a.shape), a.dtype) for a in args))
    if key not in _CACHE:
        try:
            gm = _graph(module, args)
            run = MetaRun(gm)
            names = [n for n in gm.graph.nodes if n.op == "placeholder"]
            run.run([n for n in gm.graph.nodes if n.op != "output"],
                    {n.target: a for n, a in zip(names, args)})
            _CACHE[key] = sum(c.flops for c in run.costs.values())
        except Exception:
            _CACHE[key] = None  # not traceable on meta (a data-dependent loop)
    return _CACHE[key]


_CACHE: dict = {}


def routed_experts_flops(module: torch.nn.Module, hidden: torch.Tensor, index: torch.Tensor,
                         weights: torch.Tensor, num_experts: int) -> Optional[float]:
    """Forward FLOPs of the call under real routing (None: could not be measured)."""
    meta = [torch.empty_like(t, device="meta") for t in (hidden, index, weights)]
    once = _flops(module, tuple(meta))
    twice = _flops(module, (meta[0], torch.cat([meta[1]] * 2, -1), torch.cat([meta[2]] * 2, -1)))
    if once is None or twice is None:
        return None
    if twice > 1.5 * once:
        return once  # follows the routed slots already
    return once * min(1.0, index.shape[-1] / num_experts)


def experts_call_flops(node: fx.Node, run: MetaRun, num_experts: int) -> Optional[float]:
    hidden, index, weights = (run.values.get(a) for a in node.args[:3])
    if not all(isinstance(t, torch.Tensor) for t in (hidden, index, weights)):
        return None
    return routed_experts_flops(run.gm.get_submodule(node.target), hidden, index, weights,
                                num_experts)
