"""ZeRO's flat-shard layout from sizes alone: one set of rules for the runtime and the estimates.

The runtime (backends/parallel/zero/sharding.py, `parallelize.build_zero_optimizer`) lays each
rank's parameters into flat shards and measures the bytes it holds; the
compiler (estimates.py) predicts those bytes from the plan. Both call the pure
functions here, so the prediction cannot drift from what runs:

* `group_shards`: which parameters share one flat shard. Per stage of the
  rank, in stage order, one shard per kind (replicated, tensor-parallel
  slices, experts); a parameter two stages of the rank hold (a tied weight in
  a V schedule) lives in the first stage's shard, and every stage reading it
  `uses` that shard (ZeRO-3 gathers it around that stage's actions).
* `shard_memory`: the bytes one rank holds of one shard after a step: the
  buffer padded to a multiple of the group size, 1/group of it for what ZeRO
  shards at the plan's stage, and one optimizer step counter per tensor the
  optimizer steps.
* `buckets` (ZeRO 0): the all-reduces the runtime's gradient sync
  (backends/runtime/grads.py) makes of one stage's gradients in one group: buckets
  filled in parameter order, each closed once it holds `DP_BUCKET_BYTES`.

No torch.distributed here: the compiler imports this at compile time.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Hashable, Optional, Sequence

from ...errors import PipeplanError

if TYPE_CHECKING:
    import torch

# The kinds of parameters ZeRO keeps in separate shards (each sums its gradient over
# its own group and its norm over its own spread group), in the runtime's order.
REPLICATED, TENSOR_PARALLEL, EXPERT = "replicated", "tensor_parallel", "expert"
KINDS = (REPLICATED, TENSOR_PARALLEL, EXPERT)

DP_BUCKET_BYTES = 25 * 2**20  # ZeRO 0: a gradient bucket is all-reduced once this full


def buckets(sizes: Sequence[int], limit: Optional[int] = None) -> list[range]:
    """ZeRO 0's gradient buckets over gradients of these byte sizes, in order, as index
    ranges: a bucket closes as soon as it holds `limit` (default DP_BUCKET_BYTES, read at
    call time), the rest make one. The runtime all-reduces each (backends/runtime/
    grads.py); the estimate counts them."""
    limit = DP_BUCKET_BYTES if limit is None else limit
    out, start, size = [], 0, 0
    for i, n in enumerate(sizes):
        size += n
        if size >= limit:
            out.append(range(start, i + 1))
            start, size = i + 1, 0
    if start < len(sizes):
        out.append(range(start, len(sizes)))
    return out


@dataclass(frozen=True)
class MemoryBytes:
    """Bytes a rank holds: parameters, gradients, optimizer states."""

    params: int
    grads: int
    optimizer: int


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter element of each state, and per optimizer tensor (a step counter)."""

    param: int = 4
    grad: int = 4
    optimizer: int = 8  # AdamW: two fp32 moments
    counter: int = 4  # AdamW: one float32 `step` per tensor it steps

    @staticmethod
    def of(optimizer: str, momentum: bool = False) -> "StateBytes":
        """fp32 parameters and gradients; AdamW's two moments and step counter, SGD's momentum.
        bf16 runs keep these too (autocast computes in bf16 over fp32 master weights)."""
        if optimizer == "adamw":
            return StateBytes(4, 4, 8, 4)
        if optimizer == "sgd":
            return StateBytes(4, 4, 4 if momentum else 0, 0)
        raise ValueError(f"no memory model for optimizer {optimizer!r}")


def padded(numel: int, world: int) -> int:
    """A flat buffer's length: `numel` rounded up to a multiple of the group size."""
    return -(-numel // world) * world


def shard_memory(numel: int, world: int, stage: int, per: StateBytes = StateBytes(),
                 tensors: int = 1) -> MemoryBytes:
    """Bytes one rank of a `world`-rank group holds of `numel` parameters after a step.

    stage 0: everything full, no padding; 1: optimizer states 1/world; 2: also
    gradients (reduce-scattered); 3: also parameters (outside gather/release).
    `tensors`: how many tensors the optimizer steps (one per flat shard; with
    stage 0 and a plain optimizer, one per parameter), each with a step counter.
    """
    full = padded(numel, world) if stage > 0 else numel
    shard = full // world if stage > 0 else full
    params = shard if stage == 3 else full
    grads = full if stage <= 1 else shard
    return MemoryBytes(params * per.param, grads * per.grad,
                       shard * per.optimizer + tensors * per.counter)


@dataclass(frozen=True)
class ShardGroup:
    """The parameters of one flat shard: the stage owning it, their kind, their keys."""

    stage: int
    kind: str
    keys: tuple[Hashable, ...]


def group_shards(stages: Sequence[tuple[int, Sequence[tuple[Hashable, str]]]]
                 ) -> tuple[list[ShardGroup], dict[int, list[int]]]:
    """(shards, uses) of one rank. `stages`: (stage index, [(parameter key, kind)]) with
    each stage's parameters in module order. `uses[stage]`: indices into shards of every
    shard holding a parameter the stage reads."""
    owner: dict[Hashable, int] = {}
    shards: list[ShardGroup] = []
    uses: dict[int, list[int]] = {}
    for index, params in sorted(stages, key=lambda s: s[0]):
        for kind in KINDS:
            keys = []
            for key, k in params:
                if k == kind and key not in owner and key not in keys:
                    keys.append(key)
            if keys:
                owner.update((key, len(shards)) for key in keys)
                shards.append(ShardGroup(index, kind, tuple(keys)))
        used = uses.setdefault(index, [])
        for key, _ in params:
            if owner.get(key) is not None and owner[key] not in used:
                used.append(owner[key])
    return shards, uses


@dataclass(frozen=True)
class FlatLayout:
    """Where each parameter sits in the flat buffer, and the per-rank shard size."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]
    numel: int  # real elements
    padded: int  # buffer length, a multiple of the group size
    shard: int  # elements per rank

    @staticmethod
    def of(named: Sequence[tuple[str, torch.Tensor]], world: int) -> "FlatLayout":
        shapes = tuple(tuple(p.shape) for _, p in named)
        sizes = [p.numel() for _, p in named]
        offsets = tuple(sum(sizes[:i]) for i in range(len(sizes)))
        numel = sum(sizes)
        full = padded(numel, world)
        return FlatLayout(tuple(n for n, _ in named), shapes, offsets, numel, full,
                          full // world)

    def shard_range(self, rank: int) -> tuple[int, int]:
        return rank * self.shard, (rank + 1) * self.shard


def expected_memory(numel: int, dp: int, stage: int, optimizer: str = "adamw",
                    momentum: bool = False, element_size: int = 4) -> MemoryBytes:
    """What `ZeroOptimizer.memory()` measures of one FlatShard after a step, from sizes alone.

    `numel` parameters in one flat shard group of `dp` ranks. AdamW keeps two
    moments per element plus a float32 step counter; SGD keeps a momentum
    buffer when momentum is on, else nothing. The rule itself is
    compiler/parallel/zero.py's `shard_memory`, which the compiler's estimates use.
    """
    if optimizer not in ("adamw", "sgd"):
        raise PipeplanError(f"no memory model for optimizer {optimizer!r}")
    per = StateBytes.of(optimizer, momentum)
    scaled = StateBytes(element_size, element_size, per.optimizer * element_size // 4,
                        per.counter)
    return shard_memory(numel, dp, stage, scaled)
