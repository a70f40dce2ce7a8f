"""The plan's optimizer (AdamW or SGD) and LR schedule (constant, cosine with warm-up).

Both the pipelined run and the reference build them here, so the update rule
is one piece of code: each rank's optimizer holds only the parameters of its
own stages, and since AdamW and SGD are element-wise, equal gradients give
equal parameters.
"""
from __future__ import annotations

import math
from typing import Iterable

import torch

from ...dsl.ast import LRScheduleSpec, TrainSpec
from ...errors import PipeplanError


def lr_factor(spec: LRScheduleSpec, step: int, total_steps: int, base_lr: float) -> float:
    """Multiplier of the base LR at optimizer step `step` (0-based)."""
    if step < spec.warmup:
        return (step + 1) / spec.warmup
    if spec.kind == "constant":
        return 1.0
    if spec.kind == "cosine":
        decay_steps = max(1, total_steps - spec.warmup)
        progress = min(1.0, (step - spec.warmup) / decay_steps)
        floor = spec.min_lr / base_lr if base_lr else 0.0
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise PipeplanError(f"unknown LR schedule {spec.kind!r} (expected constant or cosine)")


def build_optimizer(params: Iterable[torch.nn.Parameter], train: TrainSpec) -> torch.optim.Optimizer:
    spec = train.optimizer
    params = list(params)
    if spec.name == "adamw":
        return torch.optim.AdamW(params, lr=spec.lr, betas=tuple(spec.betas), eps=spec.eps,
                                 weight_decay=spec.weight_decay, foreach=False)
    if spec.name == "sgd":
        return torch.optim.SGD(params, lr=spec.lr, momentum=spec.momentum,
                               weight_decay=spec.weight_decay, foreach=False)
    raise PipeplanError(f"unknown optimizer {spec.name!r} (expected adamw or sgd)")


def build_lr_scheduler(optimizer: torch.optim.Optimizer, train: TrainSpec):
    base = train.optimizer.lr
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(train.lr_schedule, step, train.steps, base))
