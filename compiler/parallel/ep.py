"""The MoE interface expert parallelism distributes, and where each expert lives.

The interface (docs/parallelism.md, "The MoE interface"): each MoE layer the
plan names (`experts.modules`) holds, as itself or as its shallowest submodule
offering it, an *experts module* such that

* every parameter of it is stacked by expert: its dim 0 is `num_experts`, at
  least one is at least 3-D (`gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`),
  and its submodules hold no parameters;
* its forward is `forward(hidden [T, d], top_k_index [T, k], top_k_weights [T, k])
  -> [T, d]`, and a token's output is the sum over its k slots of a term that
  depends only on (hidden[t], top_k_index[t, j], top_k_weights[t, j]).

This is transformers 5's seam (Mixtral, Qwen2-MoE, OLMoE, ...: the router, the
shared expert and the normalisation of the top-k weights are the layer's own
code around `self.experts(h, top_k_index, top_k_weights)`). Detection is
structural (shapes and the call signature), never by attribute names. The
capture keeps that call opaque (experts_call.py); expert parallelism runs the
model's own experts module on each rank's slice of experts (backends/
expert_parallel.py). A layer without it is refused at `experts.modules` when the
plan distributes experts (ep > 1 or a capacity); otherwise it runs as written.

Experts are stored stacked by global index (dim 0), so a rank's shard is a
contiguous block of that dim and a checkpoint keeps experts by global index.
"""
from __future__ import annotations

import difflib
import inspect
from dataclasses import dataclass
from typing import Optional

import torch

from ...dsl.ast import Plan
from ...dsl.errors import Diagnostic, PlanError
from ..patterns import matches
from ..compiled import ExpertPlacement

INTERFACE = ("an experts module whose parameters are all stacked by expert (dim 0 = "
             "num_experts, one at least 3-D) and whose forward(hidden [T, d], top_k_index [T, k], "
             "top_k_weights [T, k]) returns [T, d], as transformers' MixtralExperts "
             "(docs/parallelism.md, 'The MoE interface')")


def moe_modules(plan: Plan, model: torch.nn.Module) -> list[str]:
    """Qualified names of the modules matching plan.experts.modules, in model order."""
    return [n for n, _ in _moe_modules(plan, model)]


def _moe_modules(plan: Plan, model: torch.nn.Module) -> list[tuple[str, int]]:
    """(name, index of the first pattern matching it), in model order."""
    if plan.experts is None:
        return []
    names = [n for n, _ in model.named_modules() if n]
    first: dict[str, int] = {}
    for i, pattern in enumerate(plan.experts.modules):
        hits = [n for n in names if matches(n, pattern)]
        if not hits:
            close = difflib.get_close_matches(pattern, names, n=1)
            raise PlanError.at(plan, f"experts.modules.{i}", f"no module matches {pattern!r}",
                               f"did you mean {close[0]!r}?" if close else
                               "patterns are module paths such as layers.*.moe")
        for h in hits:
            first.setdefault(h, i)
    return [(n, first[n]) for n in names if n in first]


def offers_interface(module: torch.nn.Module, num_experts: int) -> bool:
    """Whether `module` is an experts module of the MoE interface (structure only)."""
    params = list(module.parameters(recurse=False))
    if not params or any(p.dim() < 2 or p.shape[0] != num_experts for p in params):
        return False
    if not any(p.dim() >= 3 for p in params):
        return False
    if any(True for c in module.children() for _ in c.parameters()):
        return False
    try:
        sig = inspect.signature(module.forward)
    except (TypeError, ValueError):
        return False
    positional = [p for p in sig.parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 3 and all(p.default is not p.empty for p in positional[3:])


def _positional(module: torch.nn.Module) -> int:
    try:
        sig = inspect.signature(module.forward)
    except (TypeError, ValueError):
        return 0
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
               for p in sig.parameters.values())


def why_not(layer: torch.nn.Module, num_experts: int) -> tuple[str, str]:
    """What keeps `layer` from the interface, read off its submodules (structure only), and
    what to do: (reason appended to the refusal, hint)."""
    for rel, m in layer.named_modules():
        where = f"`{rel}` ({type(m).__name__})" if rel else type(m).__name__
        own = list(m.parameters(recurse=False))
        stacked = own and all(p.dim() >= 2 and p.shape[0] == num_experts for p in own) \
            and any(p.dim() >= 3 for p in own)
        if stacked and _positional(m) < 3:
            return (f"; its {where} stacks the experts by expert but its forward takes "
                    f"{_positional(m)} input(s), not the routing: the layer runs every expert "
                    "on every token (weighted by its router's scores), a dense call with "
                    "nothing to route to ranks",
                    "train this layer with ep = 1 and no capacity (it runs as written under "
                    "dp, pp, tp), or give its experts a routed forward(hidden, top_k_index, "
                    "top_k_weights) over the same stacked weights (e.g. transformers' "
                    "batched_mm experts function) and list that layer")
        held = [(n, tuple(p.shape)) for n, p in m.named_parameters() if "." in n]
        if m is not layer and _positional(m) >= 3 and held:
            names = ", ".join(f"`{n}` {list(s)}" for n, s in held[:3])
            return (f"; its {where} takes (hidden, top_k_index, top_k_weights) but its "
                    f"weights ({names}) are held by a submodule, not stacked by expert on "
                    "dim 0 of its own parameters",
                    f"give {where} its weights as [num_experts, ...] parameters of its own "
                    "(a [num_experts * F, H] matrix viewed as [num_experts, F, H]) and call "
                    "them once with the routing; or train with ep = 1 and no capacity, where "
                    "the layer's own code captures")
    return "", ("stack the experts' weights by expert and call them once with the routing "
                "(e.g. a loop over hit experts with nonzero/index_add does not qualify)")


def find_experts(module: torch.nn.Module, num_experts: int) -> Optional[str]:
    """The relative name ("" for itself) of the shallowest experts module in `module`."""
    found = [n for n, m in module.named_modules() if offers_interface(m, num_experts)]
    return min(found, key=lambda n: (n.count(".") + bool(n), n)) if found else None


def experts_modules(plan: Plan, model: torch.nn.Module) -> dict[str, str]:
    """MoE layer name -> qualified name of its experts module. Layers without one are
    refused at `experts.modules` when the plan distributes the experts (ep > 1 or a
    capacity), and left out otherwise (they then run as the model's code, whole)."""
    if plan.experts is None:
        return {}
    out, problems = {}, []
    for name, i in _moe_modules(plan, model):
        found = find_experts(model.get_submodule(name), plan.experts.num_experts)
        if found is not None:
            out[name] = f"{name}.{found}" if found else name
        elif experts_dispatched(plan):
            kind = type(model.get_submodule(name)).__name__
            why, hint = why_not(model.get_submodule(name), plan.experts.num_experts)
            problems.append(Diagnostic(
                f"{name} ({kind}) offers no experts module to distribute: expert parallelism "
                f"needs {INTERFACE}{why}", plan.span_of(f"experts.modules.{i}"), hint))
    if problems:
        raise PlanError(problems, plan.source_text or None, plan.sources)
    return out


def experts_dispatched(plan: Plan, ep: Optional[int] = None) -> bool:
    """Whether the runtime dispatches the experts' tokens itself (experts sharded over ep,
    or slots over capacity dropped), at the plan's ep or `ep` (a candidate's). Otherwise the
    experts module runs as captured."""
    ex = plan.experts
    return ex is not None and ((plan.mesh.ep if ep is None else ep) > 1 or not ex.dropless)


def expert_weights(module: torch.nn.Module, num_experts: int) -> list[str]:
    """Names (relative to the MoE module) of the expert weights EP shards: the parameters of
    its experts module. The router is replicated, not sharded."""
    found = find_experts(module, num_experts)
    if found is None:
        return []
    prefix = f"{found}." if found else ""
    return [prefix + n for n, _ in module.get_submodule(found).named_parameters()]


def place_experts(plan: Plan, model: torch.nn.Module) -> tuple[ExpertPlacement, ...]:
    """Per MoE layer: each EP rank's experts (ExpertShard's contiguous blocks) and the experts
    module they are sliced from; the runtime shards exactly this (backends/parallel/__init__.py)."""
    ex = plan.experts
    if ex is None:
        return ()
    ep, n = plan.mesh.ep, ex.num_experts
    if n % ep:
        raise PlanError.at(plan, "experts.num_experts", f"ep = {ep} does not divide "
                           f"num_experts = {n}", "every expert-parallel rank holds as many experts")
    names = moe_modules(plan, model)
    for name in names:
        module = model.get_submodule(name)
        counts = {p.shape[0] for p in module.parameters() if p.dim() >= 2}
        listed = [len(c) for c in module.children() if isinstance(c, torch.nn.ModuleList)]
        if n not in counts and n not in listed:
            have = sorted(counts | set(listed))
            raise PlanError.at(plan, "experts.num_experts", f"{name} does not hold {n} experts "
                               f"(its weights stack {', '.join(map(str, have)) or 'no'} on dim 0)",
                               "num_experts must equal the model's expert count")
    calls = experts_modules(plan, model)  # after the counts: that error says more
    return tuple(ExpertPlacement(name, tuple(ExpertShard(n, ep, r).indices for r in range(ep)),
                                 calls.get(name)) for name in names)


@dataclass(frozen=True)
class ExpertShard:
    """The contiguous block of global experts one EP rank holds (experts are stacked by
    global index, so a shard is a slice of dim 0 and checkpoints keep global indices)."""

    num_experts: int
    ep_size: int
    ep_rank: int

    @property
    def local(self) -> int:
        return self.num_experts // self.ep_size

    @property
    def first(self) -> int:
        return self.ep_rank * self.local

    @property
    def stop(self) -> int:
        return self.first + self.local

    @property
    def indices(self) -> tuple[int, ...]:
        return tuple(range(self.first, self.stop))

    def global_index(self, local_index: int) -> int:
        return self.first + local_index
