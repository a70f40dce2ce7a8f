"""Bytes each collective is handed, per named process group and op, counted at the dispatcher.

The runtime's meter behind every "measured equals estimated" check of communication: the
compiler's estimates (compiler/estimate/estimates.py, compiler/estimate/collectives.py) name collectives the
same way, {(group, op): bytes}.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode


# Which argument of each c10d op is the payload this rank hands in, and the collective
# it is (the names the compiler's estimates use: RankEstimate.collectives).
_PAYLOAD_ARG = {
    "allreduce_": 0, "allgather_": 1, "_allgather_base_": 1, "reduce_scatter_": 1,
    "_reduce_scatter_base_": 1, "alltoall_base_": 1, "alltoall_": 1, "broadcast_": 0,
    "send": 0,
}
_COLLECTIVE = {
    "allreduce_": "allreduce", "allgather_": "allgather", "_allgather_base_": "allgather",
    "reduce_scatter_": "reduce_scatter", "_reduce_scatter_base_": "reduce_scatter",
    "alltoall_base_": "alltoall", "alltoall_": "alltoall", "broadcast_": "broadcast",
    "send": "send",  # point-to-point: what this rank sends (receives are not counted)
}


# torch's functional collectives (what DTensor issues): payload = the input, args[0]
_FUNCTIONAL = {"all_reduce": "allreduce", "all_reduce_": "allreduce",
               "all_gather_into_tensor": "allgather", "reduce_scatter_tensor": "reduce_scatter",
               "all_to_all_single": "alltoall", "broadcast": "broadcast"}


def _nbytes(x) -> int:
    if torch.is_tensor(x):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(y) for y in x)
    return 0


class CommMeter(TorchDispatchMode):
    """Counts the bytes each collective is handed, per named group and op, at the dispatcher.

    `with CommMeter({"tp": groups.tp, "ep": groups.ep}) as meter: ...` sees every
    c10d collective issued on this thread (forward and backward), so what is
    counted is exactly what ran. Payload = the bytes of the tensor(s) this
    rank passes in (all-reduce: the tensor; all-gather: its shard;
    reduce-scatter / all-to-all: its whole input). Keys: (group name, collective)
    with collective in allreduce, allgather, reduce_scatter, alltoall,
    broadcast (the list and base forms alike), or send (point-to-point).
    Unnamed groups count as "other".
    """

    def __init__(self, groups: dict[str, Optional[dist.ProcessGroup]]):
        super().__init__()
        self._names = {g.group_name: n for n, g in groups.items() if g is not None}
        self.bytes: dict[tuple[str, str], int] = {}
        self.calls: dict[tuple[str, str], int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            # let DTensor run the op with this mode still active, so the collectives it
            # issues inside (redistributions, loss_parallel's all-reduces) are counted
            return NotImplemented
        op = func._opname
        if func.namespace == "_c10d_functional" and op in _FUNCTIONAL:  # DTensor's collectives
            name = next(a for a in reversed(args) if isinstance(a, str))
            key = (self._names.get(name, "other"), _FUNCTIONAL[op])
            self.bytes[key] = self.bytes.get(key, 0) + _nbytes(args[0])
            self.calls[key] = self.calls.get(key, 0) + 1
        elif func.namespace == "c10d" and op in _PAYLOAD_ARG:
            pg = next((a for a in args if isinstance(a, torch.ScriptObject)
                       and "ProcessGroup" in str(a._type())), None)
            name = dist.ProcessGroup.unbox(pg).group_name if pg is not None else ""
            key = (self._names.get(name, "other"), _COLLECTIVE[op])
            self.bytes[key] = self.bytes.get(key, 0) + _nbytes(args[_PAYLOAD_ARG[op]])
            self.calls[key] = self.calls.get(key, 0) + 1
        return func(*args, **(kwargs or {}))

    def total(self, group: str) -> int:
        return sum(b for (g, _), b in self.bytes.items() if g == group)
