"""Expert parallelism around the model's own experts module.

`ExpertParallelExperts` takes the place of a MoE layer's experts module (the
MoE interface, compiler/parallel/ep.py) in a stage graph: the graph still computes
the router, top-k weights, shared expert and everything else with the model's
own code and calls this module with (hidden [T, d], top_k_index [T, k],
top_k_weights [T, k]). Each EP rank holds a contiguous block of experts:

    ep rank r holds global experts [r * E/ep, (r+1) * E/ep)
    local param[i] == global param[r * E/ep + i]    (every stacked parameter)

The parameter names stay the model's (`gate_up_proj`, `down_proj`, ...; a
rank's state_dict keys equal the reference model's), only dim 0 is the local
slice; `gather_experts` rebuilds the full stacked tensors by global index.

Forward, per rank (each rank holds different tokens):
  1. list the slots sorted by expert, dropping those over capacity if asked
     (compiler/parallel/ep_dispatch.py, as steps 2-4);
  2. exchange per-expert counts, then the slots' hidden rows and weights
     (differentiable all-to-all) with the ranks owning the experts;
  3. run the MODEL'S OWN experts module on the received rows, one slot per row
     (top_k_index [n, 1] re-indexed to the local block, top_k_weights [n, 1]);
     by the interface a token's output is the sum of its slots' terms, so this
     computes each term exactly as the model does (its activation, weighting);
  4. send the terms back (inverse all-to-all) and sum them per token.

With `static=True` (compile.mode = graphs | inductor: the stage must be one
graph of fixed shapes, and the split sizes above are read on the host) the
all-to-alls have equal splits: every rank sends each of its T*k slots to every
EP rank (`static_dispatch`), each rank computes the terms of the slots whose
expert it holds and zero (weight 0) for the others, and the terms come back by
the inverse all-to-all, summed over the EP ranks (one non-zero block per slot, so
the sum adds exact zeros). Functional collectives, traced into the joint graph
with their autograd; traffic and expert rows are ep times the routed ones.

The local copy of the experts module shares the model's code; its stacked
parameters are the local slices, and an int attribute holding the expert
count (transformers' `num_experts`: it sizes the grouped-matmul offsets) is
the local count (found by value: an int equal to num_experts).
"""
from __future__ import annotations

import copy
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from ....compiler.parallel.ep import ExpertShard
from ....errors import PipeplanError
from ...state.materialize import sliced_parameter
from ....compiler.parallel.ep_dispatch import routed_call, static_call


def expert_shard(num_experts: int, ep_size: int, ep_rank: int) -> ExpertShard:
    if ep_size < 1 or num_experts % ep_size:
        raise PipeplanError(
            f"expert parallel size {ep_size} does not divide the {num_experts} experts "
            f"(choose mesh.ep among the divisors of {num_experts})")
    return ExpertShard(num_experts, ep_size, ep_rank)


def local_experts(experts: nn.Module, shard: ExpertShard) -> nn.Module:
    """A copy of the model's experts module holding only `shard`'s experts (same code); on
    meta parameters, meta slices that materialize.fill gives storage later."""
    local = copy.copy(experts)
    local._parameters = {n: sliced_parameter(p, 0, shard.first, shard.local)
                         for n, p in experts._parameters.items()}
    for key, value in list(vars(local).items()):
        if type(value) is int and value == shard.num_experts and not key.startswith("_"):
            setattr(local, key, shard.local)
    return local


class ExpertParallelExperts(nn.Module):
    """One EP rank's experts of a MoE layer; called as the model's experts module."""

    def __init__(self, experts: nn.Module, num_experts: int, group=None,
                 capacity_factor: Optional[float] = None, drop_policy: str = "probs",
                 indices: Optional[tuple[int, ...]] = None, static: bool = False):
        """`indices`: this rank's experts as the compiled plan placed them (ExpertPlacement);
        they must be the contiguous block the all-to-all's layout assumes."""
        super().__init__()
        ep_size = dist.get_world_size(group) if group is not None else 1
        ep_rank = dist.get_rank(group) if group is not None else 0
        self.shard = expert_shard(num_experts, ep_size, ep_rank)
        if indices is not None and tuple(indices) != self.shard.indices:
            raise PipeplanError(f"the compiled plan places experts {list(indices)} on expert-"
                                f"parallel rank {ep_rank}; this runtime holds contiguous blocks "
                                f"({list(self.shard.indices)} there)")
        self.group = group if ep_size > 1 else None
        self.capacity_factor, self.drop_policy = capacity_factor, drop_policy
        if static and capacity_factor is not None:
            raise PipeplanError("the static dispatch (compiled stages) is dropless only")
        self.static = static
        local = local_experts(experts, self.shard)
        object.__setattr__(self, "local", local)  # not a child: its names are ours
        self._parameters = local._parameters  # the model's names, the local slices
        self.kind = type(experts).__name__

    def extra_repr(self) -> str:
        s = self.shard
        return f"{self.kind} experts [{s.first}, {s.stop}) of {s.num_experts}"

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        if self.static and self.group is not None:
            return static_call(self.local, self.shard, self.group, hidden, top_k_index,
                               top_k_weights)
        return routed_call(self.local, self.shard, self.group, hidden, top_k_index,
                           top_k_weights, self.capacity_factor, self.drop_policy)


def gather_experts(layer: ExpertParallelExperts) -> dict[str, torch.Tensor]:
    """The full stacked expert tensors by global index (on every rank), for checks/checkpoints."""
    full = {}
    for name, param in layer.named_parameters():
        local = param.detach().contiguous()
        if layer.group is None:
            full[name] = local.clone()
            continue
        out = local.new_empty((layer.shard.num_experts,) + tuple(local.shape[1:]))
        dist.all_gather_into_tensor(out, local, group=layer.group)
        full[name] = out
    return full
