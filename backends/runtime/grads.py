"""Gradient synchronisation after the schedule: data parallel, tied parameters, clipping.

* Data parallel: each stage's gradients are summed over its DP group (the
  loss is already scaled by 1/(microbatches*dp), so the sum is the mean over
  the global batch). The all-reduce is launched, bucketed and asynchronous,
  as soon as the stage's last W/BW of the step is done, and waited before
  the optimizer step, so it overlaps the rest of the schedule.
  Under DiLoCo (backends/parallel/diloco/sync.py) nothing is summed across islands: only an
  island's own expert replicas (ep below tp) are, over their edp group.
* Tied parameters (one Parameter held by stages on different pipeline ranks,
  e.g. the embedding and the LM head) have their gradients summed between the
  holding ranks; two holders on one rank already share one tensor. Without a
  DP reduction of that parameter the all-reduce starts, asynchronous, as soon
  as its stage's gradients are final (in the tied sets' order on every rank);
  with one, it follows the DP sum at the end of the step, as always.
* Clipping by the global L2 norm over every rank: each distinct parameter is
  counted once (tied copies only at their first holder, DP replicas only once
  since the norm is summed over the pipeline group only). Without clipping the
  norm is not computed (the trainer asks for it only to name a failure).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ...compiler.compiled import TiedParam
from ...compiler.parallel import zero as zero_layout
from .stage import StageRunner
from ..parallel.layout import StageLayout
from .topology import Topology, global_rank, new_groups


@dataclass
class TiedGroup:
    """One tied parameter set as this rank sees it."""

    param: torch.nn.Parameter  # this rank's copy
    group: Optional[dist.ProcessGroup]  # the holding ranks (None: all holders on this rank)
    counts_in_norm: bool  # this rank holds the first holder stage


def build_tied_groups(tied: Sequence[TiedParam], runners: dict[int, StageRunner],
                      stage_to_rank: Sequence[int], topo: Topology) -> list[TiedGroup]:
    """Create one process group per tied set and (dp, tp) coordinate.

    Every rank must call this (new_group is collective), in the same order.
    """
    mesh, out = topo.mesh, []
    for t in tied:
        holders = sorted({stage_to_rank[s] for s in t.stages})
        lists = [[global_rank(mesh, pp, dp, tp, cp) for pp in holders]
                 for dp in range(mesh.dp) for cp in range(mesh.cp) for tp in range(mesh.tp)]
        _, mine = new_groups(lists, singletons=False)
        local = [(s, n) for s, n in zip(t.stages, t.names) if s in runners]
        if not local:
            continue
        stage, name = local[0]
        param = runners[stage].module.get_parameter(name)
        first_holder = stage_to_rank[t.stages[0]] == topo.coords.pp
        out.append(TiedGroup(param, mine, first_holder))
    return out


class _Bucket:
    """Some gradients of one stage, copied into one flat buffer and all-reduced there. The
    parameters' own `.grad`s are dropped once copied and come back as views of the reduced
    buffer: a rank never holds its gradients twice (the whole copy would double them
    while the all-reduces run)."""

    def __init__(self, params: list[torch.nn.Parameter], group):
        self.params = params
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        self.flat = torch.cat([g.reshape(-1) for g in grads])
        del grads
        for p in params:
            p.grad = None  # the values are in `flat` until finish()
        n = dist.get_world_size(group)  # bytes this rank sends through a ring all-reduce
        self.sent = int(2 * (n - 1) / n * self.flat.numel() * self.flat.element_size())
        self.work = dist.all_reduce(self.flat, group=group, async_op=True)

    def finish(self) -> None:
        self.work.wait()
        offset = 0
        for p in self.params:
            n = p.numel()
            p.grad = self.flat[offset:offset + n].view_as(p)
            offset += n


def sum_tied(tied: Sequence[TiedGroup], async_op: bool = False) -> list:
    """Sum each tied parameter's gradient over the pipeline ranks holding it (`async_op`:
    start the all-reduces and return their works)."""
    works = []
    for t in tied:
        if t.group is not None:
            if t.param.grad is None:
                t.param.grad = torch.zeros_like(t.param)
            works.append(dist.all_reduce(t.param.grad, group=t.group, async_op=async_op))
    return [w for w in works if w is not None]


def global_norm(terms: Sequence[tuple[torch.Tensor, tuple]], topo: Topology,
                device: torch.device) -> float:
    """sqrt of the sum of squared-norm terms; each term is summed over its groups (the
    groups sharding it on this pipeline rank), then everything over the pipeline. Terms
    with the same groups are added here first, so each group takes one all-reduce (in the
    order the terms first name it: the same on every member, which holds the same
    parameters), not one per parameter."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    by_groups: dict[tuple, list] = {}
    for sq, groups in terms:
        mine = [g for g in groups if g is not None]
        part = by_groups.setdefault(tuple(map(id, mine)), [
            torch.zeros((), dtype=torch.float64, device=device), mine])
        part[0] += sq.detach().to(device=device, dtype=torch.float64)
    for sq, groups in by_groups.values():
        for g in groups:
            dist.all_reduce(sq, group=g)
        total += sq
    if topo.pp_group is not None and topo.mesh.pp > 1:
        dist.all_reduce(total, group=topo.pp_group)
    return float(total.sqrt())


def clip_coefficient(norm: float, max_norm: Optional[float]) -> float:
    """torch.nn.utils.clip_grad_norm_'s factor: max_norm / (norm + 1e-6), at most 1."""
    return 1.0 if max_norm is None else min(1.0, max_norm / (norm + 1e-6))


class GradSync:
    """Per step: `stage_done(s)` as stages finish, then `finish()` and (clipping) `clip()`."""

    def __init__(self, runners: dict[int, StageRunner], layout: StageLayout,
                 tied: Sequence[TiedGroup], stage_order: Sequence[int]):
        self.topo = layout.topo
        self.layout = layout
        self.device = layout.device
        self.tied = list(tied)
        # A parameter is ready once every local stage holding it is done; it goes
        # with the stage finishing last (stage_order: stages by their last W/BW).
        owner: dict[int, int] = {}
        rank_in_order = {s: i for i, s in enumerate(stage_order)}
        self._params: dict[int, torch.nn.Parameter] = {}
        for s, r in runners.items():
            for p in r.params:
                self._params[id(p)] = p
                if id(p) not in owner or rank_in_order[s] > rank_in_order[owner[id(p)]]:
                    owner[id(p)] = s
        self._by_stage: dict[int, list[torch.nn.Parameter]] = {s: [] for s in runners}
        for pid, s in owner.items():
            self._by_stage[s].append(self._params[pid])
        self._buckets: list[_Bucket] = []
        # Tied sets whose sum can start when their stage is done (no DP sum to follow);
        # started in list order, so every holder issues them in one order.
        self._tied_stage = [owner[id(t.param)] if layout.reduce_group(owner[id(t.param)], t.param)
                            is None else None for t in self.tied]
        self._done: set[int] = set()
        self._tied_started = 0
        self._tied_works: list = []
        self.bytes_sent = 0  # by the gradient all-reduces so far (benchmarks)

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return list(self._params.values())

    def stage_done(self, stage: int) -> None:
        """Launch the stage's gradient all-reduces (bucketed, asynchronous)."""
        self.layout.after_backward(stage)
        by_group: dict[int, tuple] = {}
        for p in self._by_stage.get(stage, []):
            group = self.layout.reduce_group(stage, p)  # DiLoCo: inside the island only
            if group is not None:
                by_group.setdefault(id(group), (group, []))[1].append(p)
        for group, params in by_group.values():
            for b in zero_layout.buckets([p.numel() * p.element_size() for p in params]):
                self._buckets.append(_Bucket([params[i] for i in b], group))
        self._done.add(stage)
        while self._tied_started < len(self.tied) and \
                self._tied_stage[self._tied_started] in self._done:
            self._tied_works += sum_tied([self.tied[self._tied_started]], async_op=True)
            self._tied_started += 1

    def finish(self) -> None:
        """Wait for the DP all-reduces, then sum the remaining tied gradients between their
        holders, and wait for those started early."""
        for b in self._buckets:
            b.finish()
            self.bytes_sent += b.sent
        self._buckets.clear()
        sum_tied(self.tied[self._tied_started:])
        for w in self._tied_works:
            w.wait()
        self._tied_works.clear()
        self._done.clear()
        self._tied_started = 0

    def norm(self) -> float:
        """The global gradient norm (collective over the pipeline and the norm groups)."""
        skip = {id(t.param) for t in self.tied if not t.counts_in_norm}
        terms = [(p.grad.pow(2).sum(), (self.layout.norm_group(p),))
                 for p in self.params if p.grad is not None and id(p) not in skip]
        return global_norm(terms, self.topo, self.device)

    def clip(self, max_norm: float) -> float:
        """Clip by the global norm (as torch.nn.utils.clip_grad_norm_); returns the norm."""
        norm = self.norm()
        coef = clip_coefficient(norm, max_norm)
        if coef < 1.0:
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(coef)
        return norm


class ZeroSync:
    """The same duties under ZeRO: gradients are reduced by the ZeRO shards at step end.

    Tied gradients are summed first (on full per-parameter gradients), then
    `reduce_gradients()` reduces over DP and hands each rank its slice. The
    global norm is the shards' own (`grad_sq_norm`: each owned slice summed over
    its shard group, TP shards over tp, experts over ep), leaving out tied
    copies another pipeline rank counts, then summed over the pipeline.
    """

    def __init__(self, zero, layout: StageLayout, tied: Sequence[TiedGroup]):
        self.zero = zero  # parallelize.StageZero
        self.layout = layout
        self.topo = layout.topo
        self.device = layout.device
        self.tied = list(tied)
        self._skip = frozenset(id(t.param) for t in self.tied if not t.counts_in_norm)

    def stage_done(self, stage: int) -> None:
        self.layout.after_backward(stage)

    def finish(self) -> None:
        sum_tied(self.tied)
        self.zero.reduce_gradients()

    def norm(self) -> float:
        return global_norm([(self.zero.grad_sq_norm(self._skip), ())], self.topo, self.device)

    def clip(self, max_norm: float) -> float:
        norm = self.norm()
        coef = clip_coefficient(norm, max_norm)
        if coef < 1.0:
            for s in self.zero.optimizer.shards:
                if s.shard.grad is not None:
                    s.shard.grad.mul_(coef)
        return norm
