"""The single-process reference: the unmodified model trained on the same global batches.

What every pipelined run must equal. The model is built on CPU under
`torch.manual_seed(plan.train.seed)`; each step consumes the global batch as
the dp*m chunks the pipelined run uses (chunk d*m+i is DP rank d's
microbatch i) and its loss is the mean of the chunk losses. Random ops draw as the
stages do: the generator reseeded by (seed, step, chunk, k) where a stage that draws
begins (backends/runtime/draws.py). For a dense model
this is the full-batch mean; for a MoE model the aux loss is computed per
chunk (per microbatch, as Megatron does), so the split matters and is the same
on both sides; under `experts.balance = step` the model runs the whole global
batch in one call, so its own aux loss covers the step's tokens. Under expert parallelism the aux statistics cover one
microbatch of every DP rank of an EP group, so the reference runs those
chunks together as one batch (`chunk_groups`).

Besides losses and final parameters it records what the judge (compare.py)
needs: the gradients of step 1 as the optimizer sees them (after clipping),
every name of a shared parameter (`aliases`), and for the float32 rule each
step's gradient scale and the optimizer's per-element reach.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...compiler.estimate.precision import kernel_notes, to_precision
from ...dsl.ast import Plan
from ..runtime import data
from ..runtime.draws import ReferenceDraws, reference_starts
from .compare import alias_map
from ..state.model import build_model, model_loss
from ..runtime.optim import build_lr_scheduler, build_optimizer
from ..runtime.precision import autocast_for


@dataclass
class ReferenceResult:
    losses: list[float]  # per step
    params: dict[str, torch.Tensor]  # final parameters by qualified name
    grad_norms: list[float]
    grads: dict[str, torch.Tensor] = field(default_factory=dict)  # after step 1's clipping
    aliases: dict[str, str] = field(default_factory=dict)  # every name -> canonical name
    grad_scale: float = 0.0  # max |gradient element| of step 1 (after clipping)
    reach: dict[str, torch.Tensor] = field(default_factory=dict)  # canonical name -> A_i
    notes: list[str] = field(default_factory=list)  # kernels switched for the precision
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)  # the ones training wrote

    def fp32_rule(self):
        """The judge's float32 rule for this run (compare.py)."""
        from .compare import fp32_rule

        return fp32_rule(self.grad_scale, self.reach)

    def fp64_rule(self):
        """The judge's float64 rule with the optimizer's reach on parameters (compare.py)."""
        from .compare import fp64_adam_rule

        return fp64_adam_rule(self.reach)

    def island_rule(self, nodes):
        """The float32 rule set by the model's own float32 `nodes` (compare.island_rule)."""
        from .compare import island_rule

        return island_rule(self.fp32_rule(), nodes)


def float_islands(plan: Plan) -> list[str]:
    """Where the plan's model, in float64, computes in a lower precision on purpose: its
    captured graph's narrowing casts ("node (module, dtype)"); [] unless fp64."""
    if plan.train.precision != "fp64":
        return []
    from ...compiler.capture.loading import load_model
    from ...compiler.capture.traced import trace_with_loss
    from ...compiler.estimate.precision import narrowing_casts

    model = to_precision(load_model(plan, "meta"), "fp64")
    traced = trace_with_loss(plan, model)
    return [f"{name} ({module or 'the root'}, {str(dtype).removeprefix('torch.')})"
            for name, module, dtype in narrowing_casts(traced.module.graph, traced.run)]


def chunk_groups(plan: Plan) -> list[list[int]]:
    """Which chunks the reference runs as one batch: one chunk (one microbatch of one dp
    rank) at a time, whatever ep -- the model's aux losses are its own, computed over the
    tokens of one call, and expert parallelism only moves tokens -- except under
    `experts.balance = step`, where the statistics cover the whole global batch."""
    dp, m = plan.mesh.dp, plan.microbatches
    if plan.experts is not None and plan.experts.balance == "step":
        return [list(range(dp * m))]  # the whole global batch in one call of the model
    return [[c] for c in range(dp * m)]


def train_reference(plan: Plan, steps: int, model: torch.nn.Module | None = None) -> ReferenceResult:
    """Train `model` (default: the plan's model under its seed) for `steps` steps."""
    model = build_model(plan) if model is None else model
    to_precision(model, plan.train.precision)  # fp64: as compile_plan converts the stages' model
    model.train()
    optimizer = build_optimizer(model.parameters(), plan.train)
    scheduler = build_lr_scheduler(optimizer, plan.train)
    groups = chunk_groups(plan)
    autocast = autocast_for(plan.train.precision, torch.device("cpu"))  # bf16: as the stages
    losses, norms = [], []
    named = list(model.named_parameters(remove_duplicate=False))
    aliases = alias_map(model)
    reach = _Reach(optimizer, plan.train, dict(model.named_parameters()))
    initial = {n: b.detach().clone() for n, b in model.named_buffers(remove_duplicate=False)}
    first_grads: dict[str, torch.Tensor] = {}
    grad_scale = 0.0
    first = data.concat([data.chunks(data.global_batch(plan, 0), plan.mesh.dp
                                     * plan.microbatches)[c] for c in groups[0]])
    with autocast():
        starts = reference_starts(plan, model, lambda: model(**first.inputs))
    with torch.no_grad():  # that forward counted draws; the state it wrote is undone
        for n, b in model.named_buffers(remove_duplicate=False):
            b.copy_(initial[n])
    for step in range(steps):
        total = 0.0
        chunks = data.chunks(data.global_batch(plan, step), plan.mesh.dp * plan.microbatches)
        for group in groups:
            batch = data.concat([chunks[c] for c in group])
            with autocast(), torch.random.fork_rng(devices=[]), \
                    ReferenceDraws((plan.train.seed, step, group[0]), starts):  # as the stages
                loss = model_loss(plan, model(**batch.inputs), batch.targets) / len(groups)
            loss.backward()
            total += float(loss.detach())
        norm = torch.nn.utils.clip_grad_norm_(
            model.parameters(), plan.train.grad_clip if plan.train.grad_clip else float("inf"))
        if step == 0:
            first_grads = {n: p.grad.detach().clone() if p.grad is not None
                           else torch.zeros_like(p.detach()) for n, p in named}
            grad_scale = max((float(g.abs().max()) for g in first_grads.values() if g.numel()),
                             default=0.0)
        lr = optimizer.param_groups[0]["lr"]
        optimizer.step()
        reach.after_step(lr)
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)
        norms.append(float(norm))
    params = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    written = {n: b.detach().clone() for n, b in model.named_buffers(remove_duplicate=False)
               if not torch.equal(b, initial[n])}  # state the forward keeps (running stats)
    return ReferenceResult(losses, params, norms, first_grads, aliases, grad_scale,
                           reach.total, kernel_notes(model), written)


class _Reach:
    """A_i of the float32 rule (compare.py): how far the optimizer's steps so far move each
    element per unit of gradient error, summed over steps, from this optimizer's own state."""

    def __init__(self, optimizer: torch.optim.Optimizer, train, params: dict):
        self.optimizer, self.spec, self.params = optimizer, train.optimizer, params
        self.total = {n: torch.zeros_like(p.detach(), dtype=torch.float64)
                      for n, p in params.items()}
        self.gmax = 0.0  # running max |g| (the step's G, Adam's m and v average all steps)
        self.momentum = {n: 0.0 for n in params}

    def after_step(self, lr: float) -> None:
        grads = [p.grad for p in self.params.values() if p.grad is not None and p.numel()]
        g_step = max((float(g.abs().max()) for g in grads), default=0.0)
        self.gmax = max(self.gmax, g_step)
        for n, p in self.params.items():
            if self.spec.name == "adamw":
                state = self.optimizer.state.get(p)
                if not state:
                    continue
                beta2 = self.spec.betas[1]
                correction = 1 - beta2 ** float(state["step"])
                denom = (state["exp_avg_sq"].double() / correction).sqrt() + self.spec.eps
                self.total[n] += 2 * lr * self.gmax / denom
            else:  # SGD: the momentum buffer carries every past gradient error
                self.momentum[n] = self.spec.momentum * self.momentum[n] + g_step
                self.total[n] += lr * self.momentum[n]
