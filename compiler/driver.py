"""compile_plan: plan (+ model) -> CompiledPlan, phase by phase.

    load (meta) -> capture -> shape/cost propagation -> loss appended
    -> split -> stage graphs -> tied parameters -> schedule -> placement
    -> expert shards, TP annotations -> estimates
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.fx as fx

from ..dsl.ast import Plan
from ..dsl.errors import PlanError
from .analysis import MetaRun
from .blocks import blocks_of, module_path, within
from .capture import capture
from .compiled import CompiledPlan, StageSpec, TiedParam
from .costs import Cost, node_costs
from .estimates import DeviceModel, Traffic, estimate
from .experts import expert_weights, place_experts
from .loading import load_model
from .loss import LOSS_KINDS, TARGETS, append_loss, split_outputs
from .partition import Split, choose_split, compute_nodes
from .schedule import make_schedule
from .stages import build_stages
from .tensor_parallel import tp_annotations


def compile_plan(plan: Plan, model: Optional[torch.nn.Module] = None, *,
                 device: DeviceModel = DeviceModel()) -> CompiledPlan:
    """Compile `plan`. Without `model` it is built on the meta device (no weights allocated);
    with one, each stage GraphModule holds that model's own parameter tensors.
    `device` is the accelerator model the time estimate assumes."""
    if model is None:
        model = load_model(plan, "meta")
    experts = place_experts(plan, model)
    tp_kinds = tp_annotations(plan, model) if plan.mesh.tp > 1 else {}
    graph = trace_with_loss(plan, model)
    costs = node_costs(plan, graph.module.graph, graph.run)
    split = choose_split(plan, model, graph.module.graph, costs,
                         _param_bytes(graph.module, graph.module.graph))
    stages = build_stages(graph.module, split, graph.run, graph.loss, set(blocks_of(model)))
    _attach_costs(stages, split, costs, graph.module.graph)
    schedule = make_schedule(plan, stages)
    for st in stages:
        st.rank = schedule.stage_to_rank[st.index]
    tied = find_tied(model, stages)
    calls = module_calls(graph.module.graph, graph.run, split,
                         set(tp_kinds) | {e.module for e in experts})
    tp_traffic = tensor_parallel_traffic(model, tp_kinds, calls)
    moe_traffic = [Traffic(e.module, calls[e.module].stage, calls[e.module].in_bytes)
                   for e in experts if e.module in calls]
    expert_params = {f"{e.module}.{w}" for e in experts
                     for w in expert_weights(model.get_submodule(e.module),
                                             plan.experts.num_experts)}
    estimates = estimate(plan, stages, schedule, tied, tp_kinds, expert_params, tp_traffic,
                         moe_traffic, device)
    return CompiledPlan(plan=plan, stages=stages, schedule=schedule, tied=tied, experts=experts,
                        tp_rewrites=tp_kinds, capture=graph.method, capture_reason=graph.reason,
                        split_text=split.text if split.starts else "", split_points=split.starts,
                        estimates=estimates)


@dataclass(frozen=True)
class ModuleCall:
    """One module's call in the graph: its stage and the bytes going in and out per microbatch."""

    stage: int
    in_bytes: int
    out_bytes: int
    input_node: Optional[str] = None  # the graph value it reads (layers sharing it: one collective)


def tensor_parallel_traffic(model: torch.nn.Module, kinds: dict[str, str],
                            calls: dict[str, ModuleCall]) -> list[Traffic]:
    """One all-reduce per row-parallel output, and one per distinct input of column-parallel
    layers (q, k and v read the same input: Megatron fuses them into one collective)."""
    out, seen_inputs = [], set()
    for name, kind in kinds.items():
        call = calls.get(name)
        if call is None:
            continue
        if _all_reduces_output(model, name, kind):
            out.append(Traffic(name, call.stage, call.out_bytes))
        elif call.input_node not in seen_inputs:
            seen_inputs.add(call.input_node)
            out.append(Traffic(name, call.stage, call.in_bytes))
    return out


def module_calls(graph: fx.Graph, run: MetaRun, split: Split, names: set[str]
                 ) -> dict[str, ModuleCall]:
    """For each named module: the stage of its first node, its first tensor input's bytes
    (from outside the module) and its last node's output bytes."""
    first: dict[str, tuple[int, fx.Node]] = {}
    last: dict[str, fx.Node] = {}
    for i, node in enumerate(compute_nodes(graph)):
        path = module_path(node)
        while path:
            if path in names:
                first.setdefault(path, (i, node))
                last[path] = node
            path = path.rpartition(".")[0]
    out = {}
    for name, (i, node) in first.items():
        inputs = [a for a in node.all_input_nodes if a.op != "get_attr" and run.is_tensor(a)
                  and not within(module_path(a), name)]
        out[name] = ModuleCall(split.stage_of(i), _nbytes(run.value(inputs[0])) if inputs else 0,
                               _nbytes(run.value(last[name])) if run.is_tensor(last[name]) else 0,
                               inputs[0].name if inputs else None)
    return out


def _all_reduces_output(model: torch.nn.Module, name: str, kind: str) -> bool:
    """Row-parallel layers and vocab-parallel embeddings all-reduce their output (forward);
    column-parallel layers and a vocab-parallel head their input grad (backward)."""
    return kind == "row" or (kind == "vocab" and
                             isinstance(model.get_submodule(name), torch.nn.Embedding))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class TracedWithLoss:
    """The captured graph with the loss appended, and its meta run (shapes, costs)."""

    def __init__(self, module: fx.GraphModule, run: MetaRun, loss: fx.Node, method: str,
                 reason: str):
        self.module, self.run, self.loss = module, run, loss
        self.method, self.reason = method, reason


def trace_with_loss(plan: Plan, model: torch.nn.Module) -> TracedWithLoss:
    if plan.model.loss not in LOSS_KINDS:
        raise PlanError.at(plan, "model.loss", f"unknown loss {plan.model.loss!r}",
                           f"one of: {', '.join(LOSS_KINDS)}")
    example = example_inputs(plan)
    captured = capture(plan, model, example)
    gm = captured.module
    run = MetaRun(gm)
    run.run(list(gm.graph.nodes), example)
    first, _ = split_outputs(captured.outputs)
    _check_prediction(plan, run.values.get(first))
    before = set(gm.graph.nodes)
    loss = append_loss(gm.graph, plan.model.loss, captured.outputs,
                       lambda n: run.is_tensor(n) and run.value(n).dim() == 0)
    new = [n for n in gm.graph.nodes if n not in before]
    run.run(new, {TARGETS: _targets_example(plan, run.value(first))})
    gm.recompile()
    if run.value(loss).dim() != 0:
        raise PlanError.at(plan, "model.loss", f"loss = {plan.model.loss!r} gives a tensor of "
                           f"shape {tuple(run.value(loss).shape)}, not a scalar",
                           'with loss = "model" the model must return its scalar loss first')
    return TracedWithLoss(gm, run, loss, captured.method, captured.reason)


def example_inputs(plan: Plan) -> dict[str, torch.Tensor]:
    """Meta tensors for the model's inputs at one microbatch (batch = microbatch size)."""
    dims = {"batch": plan.microbatch_size, "seq": plan.data.seq_len}
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


def _param_bytes(gm: fx.GraphModule, graph: fx.Graph) -> dict[fx.Node, int]:
    """Parameter bytes per compute node (a get_attr's bytes go to its first user)."""
    out: dict[fx.Node, int] = {}
    seen: set[int] = set()
    for node in compute_nodes(graph):
        tensors = []
        if node.op == "call_module":
            tensors = list(gm.get_submodule(node.target).parameters())
        for a in node.all_input_nodes:
            if a.op == "get_attr":
                t = gm.get_parameter(a.target) if _is_param(gm, a.target) else None
                if t is not None:
                    tensors.append(t)
        total = 0
        for t in tensors:
            if id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
        out[node] = total
    return out


def _is_param(gm: fx.GraphModule, target: str) -> bool:
    try:
        gm.get_parameter(target)
        return True
    except AttributeError:
        return False


def _attach_costs(stages: list[StageSpec], split: Split, costs: dict[fx.Node, Cost],
                  graph: fx.Graph) -> None:
    """Forward FLOPs and saved bytes per microbatch, summed over each stage's own nodes."""
    for i, node in enumerate(compute_nodes(graph)):
        c = costs.get(node)
        if c is not None:
            st = stages[split.stage_of(i)]
            st.flops += c.flops
            st.activation_bytes += c.saved_bytes
            st.recompute_flops += c.recompute_flops


def find_tied(model: torch.nn.Module, stages: list[StageSpec]) -> tuple[TiedParam, ...]:
    """Parameters (same object under several names) held by more than one stage."""
    names_of: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(name)
    tied = []
    for names in names_of.values():
        holders = []  # (name, stage): one entry per stage, the first name it uses
        for st in stages:
            used = [n for n in names if n in st.param_names]
            if used:
                holders.append((used[0], st.index))
        if len({s for _, s in holders}) >= 2:
            tied.append(TiedParam(tuple(n for n, _ in holders), tuple(s for _, s in holders)))
    return tuple(tied)
