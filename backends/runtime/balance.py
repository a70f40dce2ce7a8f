"""`experts.balance = step` at run time: the routing pre-pass, then the step.

The compiler wrapped each load-balancing statistic of the model's graph in
`step_statistic` (compiler/parallel/ep_balance.py). Each step, `RoutingPrepass.run`:

1. runs a no-grad forward of every microbatch through the pipeline -- this
   rank's F actions of the verified schedule, in their order, with their
   sends and receives (a sub-order of a deadlock-free order is one: forwards
   wait only on forwards) -- collecting every statistic of its stages;
2. sums them over the microbatches and all-reduces the sums over the dp group
   (which holds every ep rank: EP re-divides dp), divided by microbatches x dp:
   the mean over the step's global tokens;
3. returns a context under which the step's schedule runs with the averaged
   statistics in place of each microbatch's own.

Why a pre-pass under every schedule, GPipe included: the aux loss *value* of
microbatch 0 is computed in its forward (on the stage of each MoE layer, or at
the end for transformers' models), before later microbatches' forwards have run
on that stage, so even GPipe cannot use the step's statistic there without
running the routing first. Its cost -- one more forward per microbatch and
stage, without saved activations, and its activations' p2p -- is in the
estimates (`pipeplan check`: "routing pre-pass").
"""
from __future__ import annotations

import contextlib
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ...compiler.parallel.ep_balance import StepStatistics
from .comm import PlannedAction, op_name
from .data import Batch
from .executor import Executor
from .stage import StageRunner


class RoutingPrepass:
    def __init__(self, planned: Sequence[PlannedAction], runners: dict[int, StageRunner],
                 specs, microbatches: int, peer_rank, device: torch.device,
                 dp_group: Optional[dist.ProcessGroup], dp: int):
        forwards = [p for p in planned if op_name(p.action) == "F"]
        self.executor = Executor(forwards, runners, specs, microbatches, peer_rank, device)
        self.group = dp_group
        self.count = microbatches * dp  # calls per statistic over the step
        self.stats = StepStatistics()

    def run(self, batches: Sequence[Batch]) -> contextlib.AbstractContextManager:
        """The pre-pass (collective over the pipeline and dp group); returns the context the
        step's schedule runs under."""
        self.stats.sums.clear()
        with self.stats.active("collect"), torch.no_grad():
            self.executor.run_step(batches)
        keys = sorted(self.stats.sums)
        if keys:
            flat = torch.cat([self.stats.sums[k].reshape(-1) for k in keys])
            if self.group is not None and dist.get_world_size(self.group) > 1:
                dist.all_reduce(flat, group=self.group)
            flat = flat / self.count
            values, at = {}, 0
            for k in keys:
                n = self.stats.sums[k].numel()
                values[k] = flat[at:at + n].reshape(self.stats.sums[k].shape)
                at += n
            self.stats.values = values
        return self.stats.active("apply")
