"""This rank's shards of the tensor-parallel parameters, and the full tensors back.

A parameter the plan splits is replaced by a plain `nn.Parameter` holding this
rank's contiguous slice (its tp rank's 1/tp of the split dim; on a meta parameter
a meta slice that backends/state/materialize.py fills later),
under its own name: optimizers, ZeRO's flat shards, gradient clipping and
checkpoints see ordinary tensors; only the graph wraps them as DTensors
(dtensor.py). `gm._tp_shard_dims` records name -> split dim for every name of a
sharded parameter (tied names alike).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from ...state.materialize import part_parameter, sliced_parameter
from .fused import SEGMENTS, pieces, ungroup

SHARD_DIMS = "_tp_shard_dims"


class ParameterSlicer:
    """Slices full parameters once per (parameter, dim), so tied weights stay tied.

    Share one slicer between all stage modules of a rank: a weight tied across
    two of its stages (embedding and LM head in a V schedule) then stays one
    Parameter, as it was before the rewrite.
    """

    def __init__(self, group):
        self.group = group
        # (id(full), dim) -> (full, shard); holding `full` keeps its id from being reused
        self._memo: dict[tuple[int, int], tuple[nn.Parameter, nn.Parameter]] = {}

    def shards(self) -> list[nn.Parameter]:
        return [shard for _, shard in self._memo.values()]

    def __call__(self, p: nn.Parameter, dim: int, segments=None) -> nn.Parameter:
        """`segments` (a fused Linear's, fused.py): this rank's 1/tp of each, stacked."""
        key = (id(p), dim, segments)
        if key not in self._memo:
            size, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
            length = p.shape[dim] // size  # tp divides it (checked at compile time)
            shard = part_parameter(p, pieces(segments, dim, rank, size)) if segments else \
                sliced_parameter(p, dim, rank * length, length)
            self._memo[key] = (p, shard)
        return self._memo[key][1]


def shard_offset(full: int, group) -> int:
    """Where this rank's slice starts along the split dim of length `full` (torch.chunk's
    rule, as `ParameterSlicer` cuts it)."""
    return dist.get_rank(group) * -(-full // dist.get_world_size(group))


def set_parameter(root: nn.Module, name: str, value: nn.Parameter) -> None:
    owner, _, leaf = name.rpartition(".")
    module = root.get_submodule(owner) if owner else root
    module._parameters[leaf] = value


def tp_shard_dims(module: nn.Module) -> dict[str, int]:
    """Qualified parameter name -> the dim it is split on, for every TP-sharded parameter."""
    return dict(getattr(module, SHARD_DIMS, {}))


def _all_gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def gather_full(tensor: torch.Tensor, dim: Optional[int], group) -> torch.Tensor:
    """The full tensor of a TP shard split on `dim` (None: replicated, returned as a copy)."""
    return tensor.detach().clone() if dim is None else _all_gather(tensor.detach(), dim, group)


def gather_full_state(module: nn.Module, group) -> dict[str, torch.Tensor]:
    """state_dict with every TP-sharded tensor all-gathered to its full (reference) shape."""
    dims, fused = tp_shard_dims(module), getattr(module, SEGMENTS, {})
    full = {key: gather_full(value, dims.get(key), group)
            for key, value in module.state_dict().items()}
    size = dist.get_world_size(group)
    return {key: ungroup(value, fused[key], size, dims[key]) if key in fused else value
            for key, value in full.items()}


def sync_partial_grads(params, group) -> None:
    """Sum the partial gradients of replicated parameters used on sequence shards."""
    for p in params:
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)
