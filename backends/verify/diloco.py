"""`pipeplan verify` of a DiLoCo plan: the island-by-island single-process reference.

A DiLoCo run (backends/parallel/diloco/) is not one process training on the global batch:
each dp replica (an island) takes inner steps on its own rows, and every H steps (per
fragment, staggered under streaming DiLoCo) the islands' pseudo-gradients are averaged
and an outer SGD / Nesterov step moves the global copy every island restarts from.
`train_islands` computes that with one process: the plan's model under its seed, copied
once per island, each island trained in turn on its microbatches (chunk d*m+i of the
global batch is island d's microbatch i, the data's own chunking) with the plan's inner
optimizer, and after each step the outer step written out here (torch.optim.SGD's
momentum and Nesterov rule on the mean of `global - island`), per fragment when due.

Fragments follow the plan's definition (compiler/parallel/diloco.py): stage s of S
belongs to fragment s*K//S; a parameter held by several stages (a tied embedding and
head) to its first stage's. The stage of each parameter comes from the compiled plan
(meta), so the reference needs no names.

`judge_islands` judges each rank against its own island (its dp coordinate): losses,
step-1 gradients and final parameters by the fp64 rule.
"""
from __future__ import annotations

import copy
from typing import Sequence

import torch

from ...compiler.estimate.precision import to_precision
from ...compiler.parallel.diloco import fragment_of_stage, syncs_after
from ...dsl.ast import Plan
from ..runtime import data
from ..runtime.optim import build_lr_scheduler, build_optimizer
from ..state.model import build_model, model_loss
from .compare import FP64, alias_map, compare
from .reference import ReferenceResult


def fragments_by_name(plan: Plan, model: torch.nn.Module) -> dict[str, int]:
    """Canonical parameter name -> its DiLoCo fragment (see the module docstring)."""
    aliases = alias_map(model)
    if plan.sync.fragments == 1:
        return {aliases.get(n, n): 0 for n, _ in model.named_parameters()}
    from ...compiler import compile_plan

    compiled = compile_plan(plan)
    stages = plan.mesh.pp * plan.pipeline.virtual
    first: dict[str, int] = {}
    for s in sorted(compiled.stages, key=lambda s: s.index):
        for name in s.param_names:
            first.setdefault(aliases.get(name, name), s.index)
    return {n: fragment_of_stage(s, stages, plan.sync.fragments) for n, s in first.items()}


def train_islands(plan: Plan, steps: int) -> list[ReferenceResult]:
    """Each island's losses, step-1 gradients and final parameters (one ReferenceResult
    per dp coordinate), trained as the module docstring says."""
    spec, dp, m = plan.sync, plan.mesh.dp, plan.microbatches
    base = to_precision(build_model(plan), plan.train.precision)
    islands = [copy.deepcopy(base) for _ in range(dp)]
    inner = [build_optimizer(i.parameters(), plan.train) for i in islands]
    schedules = [build_lr_scheduler(o, plan.train) for o in inner]
    fragment = fragments_by_name(plan, base)
    glob = {n: p.detach().clone() for n, p in base.named_parameters()}
    momentum: dict[str, torch.Tensor] = {}
    losses: list[list[float]] = [[] for _ in range(dp)]
    first: list[dict] = [{} for _ in range(dp)]
    for step in range(steps):
        chunks = data.chunks(data.global_batch(plan, step), dp * m)
        for d, model in enumerate(islands):
            losses[d].append(_inner_step(plan, model, inner[d], chunks[d * m:(d + 1) * m]))
            if step == 0:
                first[d] = {n: p.grad.detach().clone() if p.grad is not None else
                            torch.zeros_like(p.detach())
                            for n, p in model.named_parameters(remove_duplicate=False)}
            inner[d].step()
            schedules[d].step()
            inner[d].zero_grad(set_to_none=True)
        due = {f for f in range(spec.fragments) if syncs_after(step + 1, f, spec)}
        if due:
            _outer_step(spec.outer_optimizer, islands, glob, momentum,
                        [n for n in glob if fragment[n] in due])
    return [ReferenceResult(losses[d], {n: p.detach().clone() for n, p in
                                        i.named_parameters(remove_duplicate=False)},
                            [], first[d], alias_map(i)) for d, i in enumerate(islands)]


def _inner_step(plan: Plan, model: torch.nn.Module, optimizer, chunks) -> float:
    """Gradients of one island's step (its microbatches' mean loss), clipped; the loss."""
    total = 0.0
    for chunk in chunks:
        loss = model_loss(plan, model(**chunk.inputs), chunk.targets) / len(chunks)
        loss.backward()
        total += float(loss.detach())
    if plan.train.grad_clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), plan.train.grad_clip)
    return total


@torch.no_grad()
def _outer_step(outer, islands, glob: dict, momentum: dict, names: list[str]) -> None:
    """torch.optim.SGD's rule on the pseudo-gradient delta = mean(global - island):
    buf = delta at the first sync, then mu*buf + delta; the step is delta + mu*buf under
    Nesterov, buf under heavy ball, delta without momentum. Every island restarts there."""
    for name in names:
        params = [dict(i.named_parameters())[name] for i in islands]
        delta = sum(glob[name] - p for p in params) / len(islands)
        mu = outer.momentum
        if mu:
            momentum[name] = delta.clone() if name not in momentum else \
                mu * momentum[name] + delta
            delta = delta + mu * momentum[name] if outer.name == "nesterov" else momentum[name]
        glob[name] = glob[name] - outer.lr * delta
        for p in params:
            p.copy_(glob[name])


def judge_islands(plan: Plan, refs: Sequence[ReferenceResult], results: list[dict]):
    """The verdict of every rank against its own island (fp64 rule); the worst island's
    Comparison, its render prefixed by the island."""
    from ...dsl.layout import mesh_layout

    island = {c.rank: c.dp for c in mesh_layout(plan.mesh)}
    verdicts = []
    for d, ref in enumerate(refs):
        mine = [r for r in results if island[r["rank"]] == d]
        verdicts.append(compare(ref.losses, ref.params, [r["losses"] for r in mine],
                                [r["params"] for r in mine], rule=FP64, aliases=ref.aliases,
                                ref_grads=ref.grads,
                                grads_per_rank=[r["grads"] for r in mine]))
    return verdicts
