"""ZeRO stages 0-3 over a data-parallel group, for one pipeline stage's parameters.

Each `FlatShard` lays a group of parameters end to end in one flat fp32
buffer (padded to a multiple of the group size) and makes every parameter a
view of it. Rank r owns the slice [r * S, (r+1) * S) of the buffer, S =
padded / dp; the optimizer only ever sees that slice (a 1-D Parameter), so it
keeps states for 1/dp of the elements. AdamW and SGD are elementwise, so
stepping slices gives exactly the unsharded update.

    stage 0  full params, full grads all-reduced, optimizer on the whole buffer
    stage 1  full params, full grads all-reduced, optimizer states sharded
    stage 2  full params, grads reduce-scattered (only the owned slice kept)
    stage 3  params sharded too: `gather()` before a stage's F/B/W, `release()`
             after; the full buffer's storage is freed, not the tensors, so
             autograd's saved weights become valid again on the next gather

After every stage's backwards of one step: `reduce_gradients()`, then `step()`
(the inner optimizer on the owned slices, then stages 0-2 all-gather the
updated slices back into the full buffer). The runtime scales each rank's loss
by 1 / (microbatches * dp), so gradients are summed here, not averaged.

Gradients accumulate full-sized across a step's microbatches and are reduced
once at its end: reduce-scattering each microbatch would multiply DP traffic
by the microbatch count (DeepSpeed refuses ZeRO-2 with pipelining for this
reason). So stages 2 and 3 save gradient memory between steps, not inside one.

Why not torch's FSDP2 (`fully_shard`) for stage 3: see docs/parallelism.md.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ....compiler.parallel.zero import FlatLayout, MemoryBytes
from ....errors import PipeplanError
from ...state.materialize import FlatTarget, slice_of
from .window import PrefetchWindow  # noqa: F401 (re-exported: one import for ZeRO)

ZERO_STAGES = (0, 1, 2, 3)


def _group_size(group) -> int:
    return dist.get_world_size(group) if group is not None else 1


def _group_rank(group) -> int:
    return dist.get_rank(group) if group is not None else 0


class FlatShard:
    """One group's parameters as views of a flat buffer sharded over `group` (None: alone)."""

    def __init__(self, named: Sequence[tuple[str, nn.Parameter]], group, stage: int,
                 spread_group=None, device: Optional[torch.device] = None):
        if stage not in ZERO_STAGES:
            raise PipeplanError(f"zero stage {stage} does not exist (choose 0, 1, 2 or 3)")
        named = [(n, p) for n, p in named if p.requires_grad]
        self.params = [p for _, p in named]
        self.group, self.stage = group, stage
        # Ranks holding *other* parameters of the same kind (experts: the EP group);
        # only the global gradient norm needs it.
        self.spread_group = spread_group
        self.world, self.rank = _group_size(group), _group_rank(group)
        self.layout = FlatLayout.of(named, self.world if stage > 0 else 1)
        dtype = self.params[0].dtype if self.params else torch.float32
        deferred = any(p.device.type == "meta" for p in self.params)
        self.device = torch.device(device) if device is not None else \
            self.params[0].device if self.params and not deferred else torch.device("cpu")
        self.present = True  # the full buffer holds current values
        self._pending = None  # an all-gather in flight (a stage-3 prefetch)
        self.flat_grad = None  # stages 0-1: the reduced full gradient buffer
        self.targets: dict[str, list[FlatTarget]] = {}  # deferred: what still needs a value
        start, stop = self.layout.shard_range(self.rank if stage > 0 else 0)
        if deferred:
            self._defer(start, stop)
            return
        self.full = torch.zeros(self.layout.padded, dtype=dtype, device=self.device)
        for p, off in zip(self.params, self.layout.offsets):
            self.full[off:off + p.numel()].copy_(p.detach().reshape(-1))
        self._point_params_at_full()
        if stage == 3:
            self.shard = nn.Parameter(self.full[start:stop].clone())
            self.release()
        else:  # the owned slice of the full buffer itself: the optimizer writes in place
            self.shard = nn.Parameter(self.full[start:stop])

    def _defer(self, start: int, stop: int) -> None:
        """Meta parameters (the runtime's owned-only start-up, docs/runtime.md): allocate only
        what this rank holds -- stage 3 its shard, stages 0-2 the full buffer -- point the
        parameters at views of the full buffer (stage 3: released at once, so never
        resident), and list in `targets` which part of each parameter's (TP / EP sliced)
        value fills the held buffer; `materialize.fill` then copies those parts there."""
        numel, padded_len = self.layout.numel, self.layout.padded
        dtype = self.params[0].dtype
        self.full = torch.empty(padded_len, dtype=dtype, device=self.device)
        parts = [slice_of(p) for p in self.params]  # read before the swap moves __dict__
        for p in self.params:  # same objects (ids stay valid); each keeps its own version
            # counter (`.data`), so a gather writing the buffer is not an in-place change of
            # a weight autograd saved
            torch.utils.swap_tensors(p, nn.Parameter(torch.empty(0, dtype=dtype),
                                                     requires_grad=p.requires_grad))
        self._point_params_at_full()
        if self.stage == 3:
            self.shard = nn.Parameter(torch.empty(stop - start, dtype=dtype, device=self.device))
            held, origin = self.shard.detach(), start
            self.release()
        else:
            self.shard = nn.Parameter(self.full[start:stop])
            held, origin, start, stop = self.full, 0, 0, padded_len
        held[max(numel, start) - origin:].zero_()  # the padding
        for name, part, off, p in zip(self.layout.names, parts, self.layout.offsets,
                                      self.params):  # (the parameters are views by now)
            lo, hi = max(off, start), min(off + p.numel(), stop)
            if lo < hi:
                self.targets.setdefault(name, []).append(
                    FlatTarget(part, lo - off, hi - off, held[lo - origin:hi - origin]))

    def _point_params_at_full(self) -> None:
        for p, off, shape in zip(self.params, self.layout.offsets, self.layout.shapes):
            p.data = self.full[off:off + math.prod(shape)].view(shape)

    # -- stage 3: parameters present only around use
    def gather(self, async_op: bool = False) -> None:
        """Stage 3: rebuild the full buffer from every rank's shard (no-op otherwise).

        `async_op`: start the all-gather and return (a prefetch); a later
        `gather()` waits for it. A buffer already present is not gathered again.
        """
        if self.stage != 3:
            return
        if self._pending is not None:
            if not async_op:
                self._pending.wait()
                self._pending = None
            return
        if self.present:
            return
        storage = self.full.untyped_storage()
        if storage.size() == 0:
            storage.resize_(self.layout.padded * self.full.element_size())
        self.present = True
        if self.world == 1:
            self.full.copy_(self.shard.detach())
            return
        work = dist.all_gather_single(self.full, self.shard.detach(), group=self.group,
                                      async_op=async_op)
        self._pending = work if async_op else None

    def release(self) -> None:
        """Stage 3: free the full buffer's memory; the parameters keep their (empty) views."""
        if self.stage != 3:
            return
        if self._pending is not None:
            self._pending.wait()
            self._pending = None
        self.full.untyped_storage().resize_(0)
        self.present = False

    # -- one step
    def _flat_grad(self) -> torch.Tensor:
        """The accumulated gradients in one flat buffer; each parameter's own `.grad` is
        dropped once copied (never the gradients twice: at most one parameter's extra)."""
        flat = torch.zeros(self.layout.padded, dtype=self.shard.dtype, device=self.device)
        for p, off in zip(self.params, self.layout.offsets):
            if p.grad is not None:
                flat[off:off + p.numel()].copy_(p.grad.reshape(-1))
                p.grad = None
        return flat

    def reduce_gradients(self) -> None:
        """Sum gradients over the group; give the owned slice to the optimizer."""
        flat = self._flat_grad()
        if self.stage <= 1:
            if self.world > 1:
                dist.all_reduce(flat, group=self.group)
            self.flat_grad = flat
            for p, off, shape in zip(self.params, self.layout.offsets, self.layout.shapes):
                p.grad = flat[off:off + p.numel()].view(shape)
            start, stop = self.layout.shard_range(self.rank if self.stage > 0 else 0)
            self.shard.grad = flat[start:stop]
            return
        if self.world == 1:
            shard_grad = flat
        else:
            shard_grad = flat.new_empty(self.layout.shard)
            dist.reduce_scatter_single(shard_grad, flat, group=self.group)
        for p in self.params:
            p.grad = None
        self.shard.grad = shard_grad

    def owned_grad_sq(self, skip: frozenset = frozenset()) -> torch.Tensor:
        """Squared sum of the owned gradient slice, without the parameters in `skip`."""
        g = self.shard.grad
        if g is None:
            return torch.zeros((), dtype=torch.float64, device=self.device)
        g = g.detach().double()
        start, stop = self.layout.shard_range(self.rank if self.stage > 0 else 0)
        if skip:
            g = g.clone()
            for p, off in zip(self.params, self.layout.offsets):
                if id(p) in skip:
                    lo, hi = max(off, start), min(off + p.numel(), stop)
                    if lo < hi:
                        g[lo - start:hi - start] = 0.0
        return g.pow(2).sum()

    def after_step(self) -> None:
        """Every rank's updated slice back into everyone's full buffer (stage 3: if present)."""
        if self.stage in (1, 2) and self.world > 1:
            dist.all_gather_single(self.full, self.shard.detach().clone(), group=self.group)
        if self.stage == 3 and self.present:
            self.release()
            self.gather()

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        self.shard.grad = None
        self.flat_grad = None

    def memory(self) -> tuple[int, int]:
        """(parameter bytes, gradient bytes) this rank holds now.

        Parameters: the full buffer while allocated (stages 0-2 always; their
        optimizer slice is a view of it), plus stage 3's own shard. Gradients:
        the reduced full buffer (stages 0-1) or the owned slice (2-3) after
        `reduce_gradients`; before it, the accumulated per-parameter gradients.
        """
        size = self.full.element_size()
        params = self.full.untyped_storage().nbytes()
        if self.stage == 3:
            params += self.shard.numel() * size
        if self.flat_grad is not None:
            grads = self.flat_grad.numel() * size
        elif self.shard.grad is not None:
            grads = self.shard.grad.numel() * size
        else:
            grads = sum(p.grad.numel() * p.grad.element_size()
                        for p in self.params if p.grad is not None)
        return params, grads


class ZeroOptimizer:
    """An elementwise torch optimizer stepping only this rank's slices of each FlatShard.

    `shards` may use different groups (dense parameters over the DP group,
    experts over the expert-data-parallel group).
    """

    def __init__(self, shards: Sequence[FlatShard],
                 make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer]):
        self.shards = list(shards)
        self.optimizer = make_optimizer([s.shard for s in self.shards])

    def gather(self) -> None:
        for s in self.shards:
            s.gather()

    def release(self) -> None:
        for s in self.shards:
            s.release()

    def reduce_gradients(self) -> None:
        for s in self.shards:
            s.reduce_gradients()

    def grad_sq_norm(self, skip: frozenset = frozenset()) -> torch.Tensor:
        """Squared L2 norm of this rank's share of the gradient, summed over each shard's
        group (and its spread group); parameters whose id is in `skip` are left out."""
        device = self.shards[0].device if self.shards else torch.device("cpu")
        total = torch.zeros((), dtype=torch.float64, device=device)
        for s in self.shards:
            local = s.owned_grad_sq(skip)
            if s.stage > 0 and s.world > 1:
                dist.all_reduce(local, group=s.group)
            if s.spread_group is not None:
                dist.all_reduce(local, group=s.spread_group)
            total = total + local
        return total

    def clip_grad_norm_(self, max_norm: float, pp_group=None,
                        skip: frozenset = frozenset()) -> float:
        """Clip by the global L2 norm (after reduce_gradients); returns the norm.

        `pp_group`: the other pipeline ranks (each holds other stages); `skip`:
        ids of parameters another rank already counts (a tied copy).
        """
        total = self.grad_sq_norm(skip)
        if pp_group is not None:
            dist.all_reduce(total, group=pp_group)
        norm = float(total.sqrt())
        scale = min(1.0, max_norm / (norm + 1e-6))
        for s in self.shards:
            if s.shard.grad is not None and scale < 1.0:
                s.shard.grad.mul_(scale)
        return norm

    def step(self) -> None:
        self.optimizer.step()
        for s in self.shards:
            s.after_step()

    def zero_grad(self) -> None:
        for s in self.shards:
            s.zero_grad()

    def memory(self) -> MemoryBytes:
        params = grads = 0
        for s in self.shards:
            p, g = s.memory()
            params, grads = params + p, grads + g
        opt = sum(t.numel() * t.element_size() for state in self.optimizer.state.values()
                  for t in state.values() if torch.is_tensor(t))
        return MemoryBytes(params, grads, opt)


@dataclass
class StageZero:
    """The ZeRO optimizer of one rank, with gather/release per stage."""

    optimizer: ZeroOptimizer
    uses: dict[int, list[FlatShard]]

    def fill_targets(self) -> dict[str, list[FlatTarget]]:
        """name -> the parts of it this rank's flat buffers hold (built on meta parameters:
        `FlatShard._defer`), for `materialize.fill(..., flat=...)`."""
        out: dict[str, list[FlatTarget]] = {}
        for s in self.optimizer.shards:
            for name, targets in s.targets.items():
                out.setdefault(name, []).extend(targets)
        return out

    def param_bytes(self) -> int:
        """Parameter bytes the flat buffers hold now (ZeRO-3 outside gather: the shards)."""
        return self.optimizer.memory().params

    def gather(self, stage: int) -> None:
        """Stage 3: the stage's full parameters, now (waiting for a prefetch if one runs)."""
        for s in self.uses[stage]:
            s.gather()

    def prefetch(self, stage: int) -> None:
        """Stage 3: start gathering the stage's parameters without waiting."""
        for s in self.uses[stage]:
            s.gather(async_op=True)

    def release(self, stage: int, keep: Optional[int] = None) -> None:
        """Stage 3: free the stage's full parameters, except those stage `keep` reads."""
        kept = self.uses.get(keep, []) if keep is not None else []
        for s in self.uses[stage]:
            if all(s is not k for k in kept):
                s.release()

    def reduce_gradients(self) -> None:
        self.optimizer.reduce_gradients()

    def step(self) -> None:
        self.optimizer.step()

    def grad_sq_norm(self, skip: frozenset = frozenset()) -> torch.Tensor:
        """This pipeline rank's squared gradient norm, complete over dp, tp and ep."""
        return self.optimizer.grad_sq_norm(skip)

    def clip_grad_norm_(self, max_norm: float, pp_group=None,
                        skip: frozenset = frozenset()) -> float:
        return self.optimizer.clip_grad_norm_(max_norm, pp_group, skip)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

