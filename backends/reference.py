"""The single-process reference: the unmodified model trained on the same global batches.

What every pipelined run must equal. The model is built on CPU under
`torch.manual_seed(plan.train.seed)`; each step consumes the global batch as
the dp*m chunks the pipelined run uses (chunk d*m+i is DP rank d's
microbatch i) and its loss is the mean of the chunk losses. For a dense model
this is the full-batch mean; for a MoE model the aux loss is computed per
chunk (per microbatch, as Megatron does), so the split matters and is the same
on both sides. Under expert parallelism the aux statistics cover one
microbatch of every DP rank of an EP group, so the reference runs those
chunks together as one batch (`chunk_groups`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..dsl.ast import Plan
from . import data
from .model import build_model, model_loss
from .optim import build_lr_scheduler, build_optimizer
from .precision import autocast_for


@dataclass
class ReferenceResult:
    losses: list[float]  # per step
    params: dict[str, torch.Tensor]  # final parameters by qualified name
    grad_norms: list[float]
    grad_max: dict[str, float]  # per parameter, the largest |gradient element| over all steps


def chunk_groups(plan: Plan) -> list[list[int]]:
    """Which chunks the reference runs as one batch: one chunk at a time, except
    under expert parallelism, where the aux loss's statistics cover the same
    microbatch of every DP rank of one EP group (see parallelize.py)."""
    dp, m, ep = plan.mesh.dp, plan.microbatches, plan.mesh.ep
    if ep > 1 and plan.experts is not None:
        from .parallelize import reference_chunk_groups

        return reference_chunk_groups(dp, m, ep)
    return [[c] for c in range(dp * m)]


def train_reference(plan: Plan, steps: int, model: torch.nn.Module | None = None) -> ReferenceResult:
    """Train `model` (default: the plan's model under its seed) for `steps` steps."""
    model = build_model(plan) if model is None else model
    model.train()
    optimizer = build_optimizer(model.parameters(), plan.train)
    scheduler = build_lr_scheduler(optimizer, plan.train)
    groups = chunk_groups(plan)
    autocast = autocast_for(plan.train.precision, torch.device("cpu"))  # bf16: as the stages
    losses, norms = [], []
    named = list(model.named_parameters(remove_duplicate=False))
    grad_max = {n: 0.0 for n, _ in named}
    for step in range(steps):
        total = 0.0
        chunks = data.chunks(data.global_batch(plan, step), plan.mesh.dp * plan.microbatches)
        for group in groups:
            batch = data.concat([chunks[c] for c in group])
            with autocast():
                loss = model_loss(plan, model(**batch.inputs), batch.targets) / len(groups)
            loss.backward()
            total += float(loss.detach())
        for n, p in named:
            if p.grad is not None:
                grad_max[n] = max(grad_max[n], float(p.grad.abs().max()))
        norm = torch.nn.utils.clip_grad_norm_(
            model.parameters(), plan.train.grad_clip if plan.train.grad_clip else float("inf"))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)
        norms.append(float(norm))
    params = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    return ReferenceResult(losses, params, norms, grad_max)
