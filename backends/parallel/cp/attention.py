"""What Ulysses and ring attention share: each SDPA call of a context-parallel stage graph
is swapped for a module (`wrap_attention`) whose `local(q, k, v, ...)` is the method.

Inside a tensor-parallel stage (backends/tp, applied after the context pass) q, k, v
reach the wrapper as DTensors over the tp mesh: split on heads (Shard(1), from column-
parallel projections) -- each tp rank then runs the method on its H/tp local heads over
its own cp group, so attention holds H/(tp*cp) heads -- or replicated (attention not
split by tp: every tp rank runs the same). The output goes back with q's placement.
The cp group of a rank holds the same tp coordinate, so the local head blocks it
exchanges are the same heads on every member. `ContextAttention` is that mechanism,
shared with ring attention (backends/parallel/cp/ring.py), which runs its ring on the
tp-local heads the same way; `wrap_attention` swaps the SDPA calls for either.
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from ....compiler.parallel.cp import attention_nodes
from ....errors import PipeplanError


class ContextAttention(nn.Module):
    """One SDPA call of a context-parallel stage: `local(q, k, v, ...)` on plain tensors
    (the method: Ulysses, ring), run on the tp-local heads where tensor parallelism hands
    q, k, v over as DTensors, and the output handed back with q's placement."""

    def __init__(self, group):
        super().__init__()
        self.group = group

    def local(self, q, k, v, *args, **kwargs) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, q, k, v, *args, **kwargs):
        if not isinstance(q, DTensor):
            return self.local(q, k, v, *args, **kwargs)
        placements = {t.placements if isinstance(t, DTensor) else None for t in (q, k, v)}
        if len(placements) != 1 or q.placements not in ((Shard(1),), (Replicate(),)):
            raise PipeplanError(f"context parallel: attention got q, k, v placed "
                                f"{[getattr(t, 'placements', None) for t in (q, k, v)]} by "
                                f"tensor parallelism; {type(self).__name__} runs on heads "
                                "split by tp (Shard(1)) or whole (Replicate)")
        out = self.local(q.to_local(), k.to_local(), v.to_local(), *args, **kwargs)
        return DTensor.from_local(out, q.device_mesh, q.placements, run_check=False)


def wrap_attention(gm: fx.GraphModule, wrap, prefix: str) -> int:
    """Swap every SDPA call of `gm` for the module `wrap(op)` (named prefix_i) in place,
    with the call's arguments unchanged; returns how many."""
    nodes = attention_nodes(gm.graph)
    for i, node in enumerate(nodes):
        name = f"{prefix}_{i}"
        gm.add_submodule(name, wrap(node.target))
        node.op, node.target = "call_module", name
    gm.recompile()
    return len(nodes)
