"""The model as one graph that returns the training loss, with shapes and costs known.

capture -> meta run of the model's graph -> loss appended (targets placeholder
added) -> meta run of the loss nodes. Everything after this works on one graph
whose last node is the scalar loss of one microbatch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.fx as fx

from ...dsl.ast import Plan
from ...dsl.errors import PlanError
from .analysis import MetaRun, MetaRunError
from .blocks import blocks_of, module_path
from .capture import capture
from .model_checks import python_state_watched
from .loss import LOSS_KINDS, TARGETS, append_loss, split_outputs


@dataclass(frozen=True)
class TracedWithLoss:
    module: fx.GraphModule  # attributes are the model's own tensors, original names
    run: MetaRun  # per-node meta values, FLOPs and saved bytes
    loss: fx.Node
    method: str  # "fx" | "export"
    reason: str  # why that capture method
    prediction: Optional[fx.Node] = None  # the model's first output (None: loss = model)


def trace_with_loss(plan: Plan, model: torch.nn.Module) -> TracedWithLoss:
    if plan.model.loss not in LOSS_KINDS:
        raise PlanError.at(plan, "model.loss", f"unknown loss {plan.model.loss!r}",
                           f"one of: {', '.join(LOSS_KINDS)}")
    example = example_inputs(plan)
    with python_state_watched(plan, model):
        captured = capture(plan, model, example)
    gm = captured.module
    run = MetaRun(gm, blocks=blocks_of(model))
    _propagate(plan, run, list(gm.graph.nodes), example)
    first, rest = split_outputs(captured.outputs)
    _check_aux_first(plan, run, first, rest)
    _check_prediction(plan, run.values.get(first))
    before = {n: n.name for n in gm.graph.nodes}
    loss = append_loss(gm.graph, plan.model.loss, captured.outputs,
                       lambda n: run.is_tensor(n) and run.value(n).dim() == 0)
    new = [n for n in gm.graph.nodes if n not in before]
    for n in gm.graph.nodes:  # (the model's own loss, renamed "loss")
        if n in before and n.name != before[n]:
            run.renamed(before[n], n.name)
    _propagate(plan, run, new, {TARGETS: _targets_example(plan, run.value(first))})
    gm.recompile()
    if run.value(loss).dim() != 0:
        raise PlanError.at(plan, "model.loss", f"loss = {plan.model.loss!r} gives a tensor of "
                           f"shape {tuple(run.value(loss).shape)}, not a scalar",
                           'with loss = "model" the model must return its scalar loss first')
    return TracedWithLoss(gm, run, loss, captured.method, captured.reason,
                          first if plan.model.loss != "model" else None)


def _propagate(plan: Plan, run: MetaRun, nodes: list[fx.Node], inputs: dict) -> None:
    try:
        run.run(nodes, inputs, shared=True)
    except MetaRunError as e:
        where = module_path(e.node)
        raise PlanError.at(
            plan, "model.source",
            f"shape propagation failed at `{e.node.name}`"
            + (f" in module `{where}`" if where else "") + f": {type(e.error).__name__}: "
            + (str(e.error).strip().splitlines() or [""])[0],
            "the compiler runs the graph on meta tensors (no data): an op whose output shape "
            "depends on values (nonzero, masked_select, a loop over routed tokens) cannot run "
            "there; use a dense or grouped-matmul formulation of that code") from e


def example_inputs(plan: Plan) -> dict[str, torch.Tensor]:
    """Meta tensors for the model's inputs at one microbatch (batch = microbatch size,
    seq = the sequence slice of one context-parallel rank)."""
    # context parallel: the model is captured on one cp rank's slice of the sequence
    dims = {"batch": plan.microbatch_size, "seq": plan.data.seq_len // plan.mesh.cp}
    out = {}
    for spec in plan.model.inputs:
        shape = []
        for d in spec.shape:
            if isinstance(d, str) and d not in dims:
                raise PlanError.at(plan, "model.inputs", f"unknown dimension {d!r} in input "
                                   f"{spec.name!r}", 'symbolic dims are "batch" and "seq"')
            shape.append(dims[d] if isinstance(d, str) else int(d))
        dtype = getattr(torch, spec.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise PlanError.at(plan, "model.inputs", f"unknown dtype {spec.dtype!r} for input "
                               f"{spec.name!r}", "a torch dtype name: int64, float32, ...")
        out[spec.name] = torch.zeros(shape, dtype=dtype, device="meta")
    return out


def _targets_example(plan: Plan, prediction: torch.Tensor) -> torch.Tensor:
    if plan.model.loss == "cross_entropy":
        return torch.zeros(prediction.shape[:-1], dtype=torch.int64, device="meta")
    return torch.zeros_like(prediction, device="meta")


def _check_aux_first(plan: Plan, run: MetaRun, first, rest) -> None:
    """A scalar returned before the prediction: transformers' MoE models with
    `output_router_logits = True` return `aux_loss` (the load-balancing loss, unscaled)
    before `logits`. Refused under cross_entropy/mse: the model weighs it
    (`router_aux_loss_coef`) only inside its own loss, computed when it is given labels,
    so adding it as returned would train another function than the model's. `loss =
    model` with labels fed uses that loss itself (docs/parallelism.md, "Aux losses")."""
    if plan.model.loss == "model":
        return
    value = run.values.get(first)
    later = [run.values.get(r) for r in rest if isinstance(r, fx.Node)]
    if isinstance(value, torch.Tensor) and value.dim() == 0 and any(
            isinstance(v, torch.Tensor) and v.dim() >= 2 and v.is_floating_point()
            for v in later):
        raise PlanError.at(
            plan, "model.loss", "the model returns a scalar before its predictions (as "
            "transformers' MoE models return their unscaled load-balancing `aux_loss` before "
            "`logits` with output_router_logits = True); pipeplan adds a model's scalar "
            "outputs as returned, but this one the model weighs (router_aux_loss_coef) only "
            "inside its own loss, so adding it would train another function",
            "use the model's own loss: loss = model, a `labels` input in model.inputs and "
            "data inputs = { labels = tokens }; or build the model with "
            "output_router_logits = False")


def _check_prediction(plan: Plan, value) -> None:
    kind = plan.model.loss
    if not isinstance(value, torch.Tensor):
        raise PlanError.at(plan, "model.loss", f"the model's first output is "
                           f"{type(value).__name__}, not a tensor",
                           "return logits (or the loss) first, then scalar aux losses")
    if kind == "cross_entropy" and (value.dim() < 2 or not value.is_floating_point()):
        raise PlanError.at(plan, "model.loss", f"cross_entropy needs logits [..., vocab]; the "
                           f"model returns {str(value.dtype)[6:]} {tuple(value.shape)}",
                           'use loss = "mse" or "model"')
    if kind == "cross_entropy" and plan.data.kind == "synthetic" and \
            plan.data.vocab > value.shape[-1]:
        raise PlanError.at(plan, "data.vocab", f"synthetic tokens go up to {plan.data.vocab - 1} "
                           f"but the model predicts {value.shape[-1]} classes",
                           f"set data vocab = {value.shape[-1]} (or the model's vocabulary)")
    if kind == "cross_entropy" and plan.data.kind in ("file", "text"):
        from ..data import check_data

        check_data(plan, vocab=value.shape[-1])  # the token ids are the targets' classes
