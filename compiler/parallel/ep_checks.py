"""Compile-time checks of the `experts` section against the captured model.

Each plan value of the section either changes what runs or is refused here, at
its plan line, before any process starts:

* `modules`: each MoE layer's experts module must be one call in the graph (not
  hidden inside a leaf module); without the interface, refused (experts.py).
* `top_k`: the model's router decides k (the captured call's `top_k_index` is
  [T, k]); the plan's value feeds the cost model and must equal it.
* `dropless = false` + `capacity_factor` (+ `drop_policy`): the dispatcher drops
  the slots over each expert's capacity (compiler/parallel/ep_dispatch.py).
* `aux_loss`, `z_loss`: pipeplan adds the aux losses the model itself returns,
  computed by the model's code; it computes none of its own, so a coefficient
  here is refused (set it in the model: its args or config).
* `dispatcher = allgather`, `shared_experts`: not implemented (a model's shared
  expert is its own code beside the experts call and runs as written).
* `balance = step`: the model's load-balancing statistics over the whole step
  (checked and marked in balance.py, after these checks).
* sequence parallel with MoE layers: each call would see one sequence shard, so
  the model's own aux statistics would differ from the reference's; refused.
"""
from __future__ import annotations

from typing import Iterator

import torch.fx as fx

from ...dsl.ast import ExpertsSpec, Plan
from ...dsl.errors import Diagnostic, PlanError
from ..capture.analysis import MetaRun


def check_experts(plan: Plan, graph: fx.Graph, run: MetaRun, experts: dict[str, str]) -> None:
    """`experts`: MoE layer -> experts module (experts.experts_modules). Raises one PlanError
    naming every problem at its plan line."""
    if plan.experts is None:
        return
    problems = list(_section_problems(plan)) + list(_graph_problems(plan, graph, run, experts))
    if problems:
        raise PlanError([Diagnostic(msg, plan.span_of(key), hint) for key, msg, hint in problems],
                        plan.source_text or None, plan.sources)


def _section_problems(plan: Plan) -> Iterator[tuple[str, str, str]]:
    ex, default = plan.experts, ExpertsSpec(modules=(), num_experts=1)
    for key in ("aux_loss", "z_loss"):
        if getattr(ex, key) != getattr(default, key):
            yield (f"experts.{key}", f"experts.{key} = {getattr(ex, key):g}: pipeplan adds the "
                   f"aux losses the model returns, as the model computes them, and computes "
                   f"none of its own",
                   "set the coefficient in the model (its args or config) and remove it here")
    if ex.dispatcher != default.dispatcher:
        yield ("experts.dispatcher", f"experts.dispatcher = {ex.dispatcher} is not implemented",
               "use dispatcher = alltoall (or remove the line)")
    if ex.shared_experts:
        yield ("experts.shared_experts", "experts.shared_experts is not implemented: a "
               "model's shared expert is its own code beside the experts call and runs as "
               "written, replicated", "remove shared_experts (the model defines them)")
    if plan.tensor.sequence_parallel and plan.mesh.tp > 1:
        yield ("tensor.sequence_parallel", "sequence parallel with MoE layers: each experts "
               "call would see one sequence shard, so the model's own aux-loss statistics "
               "would differ from the single-process run's",
               "turn sequence_parallel off for MoE models")


def _graph_problems(plan: Plan, graph: fx.Graph, run: MetaRun,
                    experts: dict[str, str]) -> Iterator[tuple[str, str, str]]:
    calls: dict[str, list[fx.Node]] = {}
    for node in graph.nodes:
        if node.op == "call_module" and node.target in experts.values():
            calls.setdefault(node.target, []).append(node)
    for layer, name in experts.items():
        found = calls.get(name, [])
        if len(found) != 1:
            leaf = [n.target for n in graph.nodes if n.op == "call_module"
                    and name.startswith(n.target + ".")]
            where = f" inside the leaf module {leaf[0]}" if leaf else ""
            yield ("experts.modules", f"the experts module {name} of {layer} is called "
                   f"{len(found)} times in the captured graph{where}; expert parallelism "
                   f"distributes exactly one call per layer",
                   "remove the MoE layer from model.leaf_modules" if leaf else
                   "call the experts module once per forward")
            continue
        index = run.values.get(found[0].args[1]) if len(found[0].args) > 1 else None
        k = index.shape[-1] if index is not None and index.dim() >= 1 else None
        if k is not None and k != plan.experts.top_k:
            yield ("experts.top_k", f"experts.top_k = {plan.experts.top_k} but the model's "
                   f"router of {layer} picks {k} experts per token",
                   f"set top_k = {k} (or change the model's own top_k)")
