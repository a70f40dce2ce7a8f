"""Expert placement: which global expert indices each expert-parallel rank holds.

Experts are stored stacked by global index (dim 0 of the expert weights), so a
rank's shard is a contiguous block of that dim and a checkpoint keeps experts by
global index. Checked against the real model: the plan's MoE patterns must match
modules, and those modules must hold `num_experts` experts.
"""
from __future__ import annotations

import difflib

import torch

from ..dsl.ast import Plan
from ..dsl.errors import PlanError
from .patterns import matches
from .compiled import ExpertPlacement


def moe_modules(plan: Plan, model: torch.nn.Module) -> list[str]:
    """Qualified names of the modules matching plan.experts.modules, in model order."""
    if plan.experts is None:
        return []
    names = [n for n, _ in model.named_modules() if n]
    found = []
    for i, pattern in enumerate(plan.experts.modules):
        hits = [n for n in names if matches(n, pattern)]
        if not hits:
            close = difflib.get_close_matches(pattern, names, n=1)
            raise PlanError.at(plan, f"experts.modules.{i}", f"no module matches {pattern!r}",
                               f"did you mean {close[0]!r}?" if close else
                               "patterns are module paths such as layers.*.moe")
        found.extend(h for h in hits if h not in found)
    return [n for n in names if n in found]


def experts_dispatched(plan: Plan) -> bool:
    """Whether the runtime replaces the MoE layers by its dispatching layer (its expert
    weights then form their own ZeRO shard): with ep > 1, token dropping, or sequence
    parallel. Otherwise the reference layer runs as traced."""
    ex = plan.experts
    return ex is not None and (plan.mesh.ep > 1 or not ex.dropless
                               or (plan.tensor.sequence_parallel and plan.mesh.tp > 1))


def expert_weights(module: torch.nn.Module, num_experts: int) -> list[str]:
    """Names (relative to the MoE module) of the expert weights EP shards: weights stacked by
    expert on dim 0 ([E, d, h]), or everything under a ModuleList of E experts. The router's
    [E, d] matrix is replicated, not sharded."""
    lists = [n for n, c in module.named_modules()
             if isinstance(c, torch.nn.ModuleList) and len(c) == num_experts and n]
    return [n for n, p in module.named_parameters()
            if (p.dim() >= 3 and p.shape[0] == num_experts)
            or any(n.startswith(prefix + ".") for prefix in lists)]


def place_experts(plan: Plan, model: torch.nn.Module) -> tuple[ExpertPlacement, ...]:
    ex = plan.experts
    if ex is None:
        return ()
    ep, n = plan.mesh.ep, ex.num_experts
    if n % ep:
        raise PlanError.at(plan, "experts.num_experts", f"ep = {ep} does not divide "
                           f"num_experts = {n}", "every expert-parallel rank holds as many experts")
    placements = []
    for name in moe_modules(plan, model):
        module = model.get_submodule(name)
        counts = {p.shape[0] for p in module.parameters() if p.dim() >= 2}
        listed = [len(c) for c in module.children() if isinstance(c, torch.nn.ModuleList)]
        if n not in counts and n not in listed:
            have = sorted(counts | set(listed))
            raise PlanError.at(plan, "experts.num_experts", f"{name} does not hold {n} experts "
                               f"(its weights stack {', '.join(map(str, have)) or 'no'} on dim 0)",
                               "num_experts must equal the model's expert count")
        per = n // ep
        placements.append(ExpertPlacement(name, tuple(tuple(range(r * per, (r + 1) * per))
                                                      for r in range(ep))))
    return tuple(placements)
