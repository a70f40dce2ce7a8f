"""The runtime's refusals, run at compile time: `check_runnable(plan, model, stages)`.

Everything the runtime would refuse after its processes start is asked here,
once the model is loaded and its stage graphs are built, and refused as a
PlanError at the plan line. `pipeplan check` (after tracing), `pipeplan
compile`, and `pipeplan run` / `verify` (before spawning a process) all
compile, so all of them run these checks. Each check names the runtime code
whose refusal it moves forward:

* checkpoints of sharded state (backends/checkpoint.py);
* a data file that is missing, of an unknown kind, or shorter than one window
  (backends/data.py, which would fail at step 1 on every rank);
* `experts.dispatcher` / `experts.shared_experts` values no runtime path
  implements (backends/parallelize.py; ignored outright when ep = 1);
* the per-stage rewrites' model checks (backends/parallelize.py's
  `check_parallel_model`: tied weights split alike, sequence-parallel length,
  MoE layers the expert-parallel layer can shard);
* a MoE layer that export inlined into a stage graph (backends/parallelize.py
  refuses it at setup: the dispatching layer needs it as one call; under fx
  the runtime keeps experts.modules as leaf calls);
* recompute rules whose region writes its own input in place
  (backends/recompute.py's check, run on the compiled stage graphs).
"""
from __future__ import annotations

from typing import Sequence

import torch.fx as fx
from torch import nn

from ..dsl.ast import Plan
from ..dsl.errors import PlanError
from ..errors import PipeplanError
from .compiled import StageSpec
from .experts import experts_dispatched
from .patterns import matches_any

IMPLEMENTED_DISPATCHERS = ("alltoall",)


def check_plan_values(plan: Plan) -> None:
    """The checks that need only the plan (run first: they are cheap)."""
    check_checkpointable(plan)
    _check_data(plan)
    spec = plan.experts
    if spec is not None and spec.dispatcher not in IMPLEMENTED_DISPATCHERS:
        raise PlanError.at(plan, "experts.dispatcher",
                           f"experts.dispatcher = {spec.dispatcher} is not implemented",
                           f"use {' or '.join(IMPLEMENTED_DISPATCHERS)}")
    if spec is not None and spec.shared_experts:
        raise PlanError.at(plan, "experts.shared_experts",
                           "experts.shared_experts is not implemented by pipeplan's expert layer",
                           "model the shared experts as a dense MLP beside the MoE layer")


def check_checkpointable(plan: Plan) -> None:
    """Checkpoints (DCP) cover whole parameters only, so far."""
    spec = plan.train.checkpoint
    if spec is None:
        return
    if plan.zero > 0 or plan.mesh.tp > 1 or plan.mesh.ep > 1:
        raise PlanError.at(plan, "train.checkpoint",
                           "checkpoints of ZeRO, tensor-parallel or expert-parallel shards are "
                           "not supported yet", "drop the checkpoint, or run without zero/tp/ep")
    if spec.every < 1 or spec.keep < 1:
        raise PlanError.at(plan, "train.checkpoint", "checkpoint every and keep must be >= 1")


def _check_data(plan: Plan) -> None:
    if plan.data.kind != "file":
        return
    from ..backends import data

    try:
        data.global_batch(plan, 0)
    except PipeplanError as e:
        raise PlanError.at(plan, "data.path", str(e),
                           "paths are relative to the plan file's folder") from None


def check_runnable(plan: Plan, model: nn.Module, stages: Sequence[StageSpec],
                   method: str) -> None:
    """Every runtime refusal that needs the model or the stage graphs (`method`: how the
    model was captured, "fx" or "export")."""
    if _rewrites_stages(plan):
        from ..backends.parallelize import check_parallel_model

        check_parallel_model(plan, model)
    if experts_dispatched(plan) and method == "export":
        # fx: the runtime compiles with experts.modules as leaf modules
        # (backends/layout.py's with_required_leaves); export inlines every module.
        _check_moe_calls(plan, stages)
    rules = tuple(r for r in plan.recompute if r.mode != "none")
    if rules:
        _check_recompute(plan, rules, stages)


def _rewrites_stages(plan: Plan) -> bool:
    """Whether the runtime rewrites stage modules (backends/layout.py's rule)."""
    ex = plan.experts
    return (plan.mesh.tp > 1 or plan.zero > 0
            or (ex is not None and (plan.mesh.ep > 1 or not ex.dropless)))


def _check_moe_calls(plan: Plan, stages: Sequence[StageSpec]) -> None:
    """The dispatching layer replaces each MoE layer's call: it must be one call in the graph
    (fx leaves a bare attribute holder where it inlined a module)."""
    for st in stages:
        for name, mod in st.module.named_modules():
            if name and matches_any(name, plan.experts.modules) and type(mod) is nn.Module:
                raise PlanError.at(
                    plan, "experts.modules",
                    f"MoE layer {name} was traced into stage {st.index}'s graph, so expert "
                    f"parallel cannot replace its call",
                    "capture = fx keeps the experts.modules layers as single calls (export "
                    "inlines every module); the model must be fx-traceable for that")


def _check_recompute(plan: Plan, rules, stages: Sequence[StageSpec]) -> None:
    from ..backends.recompute import check_no_inplace_on_inputs, find_regions

    for st in stages:
        if not isinstance(st.module, fx.GraphModule):
            continue
        for region in find_regions(st.module.graph, rules):
            try:
                check_no_inplace_on_inputs(region)
            except PipeplanError as e:
                raise PlanError.at(plan, "recompute", str(e)) from None
