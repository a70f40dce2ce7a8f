"""compile_plan: plan (+ model) -> CompiledPlan, phase by phase.

    plan-value checks -> load (meta) -> pretrained weights (headers vs parameters) -> precision (fp64: the model in float64 before capture)
    -> expert shards, TP annotations (checked on the model)
    -> capture + loss + shape/cost propagation (traced.py) -> experts section checked on the
    graph, step-wide load-balancing statistics marked (balance.py) -> measured costs (profile.py,
    when the plan names a cost file) -> split
    -> stage graphs -> runtime checks (checks.py: what the runtime would refuse after
    launch, refused here at the plan line) -> tp stages run once on meta as the runtime
    rewrites them (tp_dry_run.py: what DTensor refuses, refused at the tensor line) -> joint
    graphs (compile.mode = graphs |
    inductor: each stage traced forward + backward, refused at the plan line if it cannot
    be) -> schedule -> placement -> tied parameters
    -> estimates
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.fx as fx

from ..dsl.ast import Plan
from ..schedules.simulate import simulate
from .capture.blocks import blocks_of
from .capture.capture import gradless_parameters
from .parallel.checks import check_plan_values, check_runnable
from .compiled import CompiledPlan, StageSpec
from .estimate.activations import TensorSplit, saved_records, stage_saved_bytes
from .estimate.costs import Cost, node_costs, param_bytes_per_node
from .estimate.device import SHARING_ROUNDS, DeviceModel, device_model
from .estimate.estimates import estimate, normalised
from .estimate.optime import op_times, stage_work
from .estimate.predict import action_costs, timing_of
from .parallel.ep import expert_weights, experts_modules, place_experts
from .parallel.ep_checks import check_experts
from .parallel.ep_balance import mark_step_statistics
from .capture.loading import load_model
from .estimate.precision import to_precision
from .estimate.profile import load_profile, node_times, profile_text, profiled_costs, replayed
from .graphs import check_joint_graphs
from .partition import Split, choose_split, compute_nodes
from .schedule import decided_schedule, make_schedule, stage_costs
from .stages import build_stages
from .parallel.tp import check_pairing, tp_annotations
from .parallel.tp_auto import left_whole, tp_split
from .parallel.tp_dry_run import check_tp_runs
from .capture.tied import find_tied
from .capture.traced import trace_with_loss
from .parallel.cp import attach_context_costs, heads_split_by_tp
from .parallel.cp_checks import context_checks
from .estimate.traffic import collective_traffic
from .weights import check_weights


def compile_plan(plan: Plan, model: Optional[torch.nn.Module] = None, *,
                 device: Optional[DeviceModel] = None, schedule=None,
                 rewrite=None) -> CompiledPlan:
    """Compile `plan`. Without `model` it is built on the meta device (no weights allocated);
    with one, each stage GraphModule holds that model's own parameter tensors (converted
    in place to the plan's precision first: float64 under `train.precision = fp64`).
    `device` is the accelerator model the time estimate assumes (default: the plan's
    device section, see `device_model`). `schedule`: a schedule already decided and
    verified (rank 0's, broadcast by backends/runtime/agreement.py, or a build directory's) used
    instead of generating one, so no search runs again; it must fit the stages. `rewrite`:
    the runtime's stage rewrite in a fake world (backends/parallel/pretrace.py), which the
    commands compiling before a launch hand in so that compiled stages under cp, tp or ep are
    estimated from their rewritten joint graphs (graphs/__init__.py)."""
    device = device or device_model(plan)
    check_plan_values(plan)
    profile = load_profile(plan)  # measured op times, when the plan names a cost file
    if model is None:
        model = load_model(plan, "meta")
    check_weights(plan, model)  # model.weights: headers only, before anything is traced
    to_precision(model, plan.train.precision)
    experts = place_experts(plan, model)
    if plan.mesh.tp > 1:  # the plan's patterns against the model, before anything is traced
        tp_annotations(plan, model)
    traced = trace_with_loss(plan, model)
    graph = traced.module.graph
    tp_kinds = tp_split(plan, model, graph, traced.run) if plan.mesh.tp > 1 else {}
    tp_whole = left_whole(plan, graph, model, traced.run, tp_kinds) \
        if plan.mesh.tp > 1 and plan.tensor.plan == "auto" else {}
    moe = experts_modules(plan, model)
    check_experts(plan, graph, traced.run, moe)
    mark_step_statistics(plan, traced.module, traced.run, traced.loss, traced.prediction, moe)
    check_pairing(plan, graph, model, tp_kinds, traced.run)
    tp_heads = heads_split_by_tp(plan, graph, model, tp_kinds, traced.run)
    context_checks(plan, model, traced, frozenset(moe.values()), tp_heads)
    costs = node_costs(plan, graph, traced.run)
    nodes = compute_nodes(graph)  # the split's positions index these
    measured = node_times(plan, model, nodes, costs, profile) if profile else None
    split = choose_split(plan, model, graph, costs,
                         param_bytes_per_node(traced.module, nodes),
                         [sum(t) for t in measured] if measured else None)
    stages = build_stages(traced.module, split, traced.run, traced.loss, set(blocks_of(model)),
                          _non_persistent_buffers(model))
    check_runnable(plan, model, stages, frozenset(traced.run.state_writes),
                   frozenset(traced.run.sparse_grads))
    _attach_costs(stages, split, costs, graph)
    _attach_activations(plan, stages, traced.run, costs, tp_kinds)
    check_tp_runs(plan, stages, graph, traced.run.values, experts, tp_kinds, rewrite)
    check_joint_graphs(plan, stages, graph, traced.run.values, experts, tp_kinds,
                       rewrite)  # graphs mode: exact bytes
    attach_context_costs(plan, stages, split, graph, nodes, traced.run, tp_heads)
    tp_traffic, moe_traffic = collective_traffic(model, graph, traced.run, split, tp_kinds,
                                                 experts)
    work = stage_work(graph, nodes, split.stage_of, costs, tp_kinds,
                      plan.mesh.tp, stages)  # each stage's ops, for the time model
    if profile:
        times = profiled_costs(split, measured, len(stages), profile.p2p_latency_s)
    else:
        times = _model_costs(plan, stages, work, tp_traffic, moe_traffic, device)
    schedule = make_schedule(plan, stages, normalised(times)) if schedule is None else \
        decided_schedule(plan, stages, schedule)
    if not profile and device.sharing is not None:  # ranks sharing this CPU: how busy they are
        alone = device
        for _ in range(SHARING_ROUNDS):
            device = alone.shared(simulate(schedule, times).concurrency)
            times = _model_costs(plan, stages, work, tp_traffic, moe_traffic, device)
    for st in stages:
        st.rank = schedule.stage_to_rank[st.index]
    tied = find_tied(model, stages)
    expert_params = {f"{e.module}.{w}" for e in experts
                     for w in expert_weights(model.get_submodule(e.module),
                                             plan.experts.num_experts)}
    replay = replayed(profile, schedule, times, split.starts) if profile else None
    if profile:
        device = dataclasses.replace(device, profile=profile_text(plan, profile, replay))
    gradless = gradless_parameters(graph, {n for n, _ in model.named_parameters()})
    estimates = estimate(plan, stages, schedule, times, tied, tp_kinds, expert_params,
                         tp_traffic, moe_traffic, device, replay, frozenset(gradless))
    estimates.timing = timing_of(plan, stages, schedule, work, tp_traffic, moe_traffic, tp_kinds,
                                 expert_params, estimates, frozenset(gradless))
    if not profile:  # the time model's step: the same simulation, its breakdown per rank
        estimates.prediction = estimates.timing.time_on(device, estimates.simulation, times)
        estimates.step_time_s = estimates.prediction.step_s + estimates.prepass_s
        if estimates.sync is not None:  # DiLoCo: its comparison on the same time model
            every = estimates.timing.time_on(device, estimates.simulation, times, every_step=True)
            estimates.sync = dataclasses.replace(
                estimates.sync, step_time_s=estimates.step_time_s,
                every_step_time_s=every.step_s + estimates.prepass_s)
    return CompiledPlan(plan=plan, stages=stages, schedule=schedule, tied=tied, experts=experts,
                        tp_rewrites=tp_kinds, tp_whole=tp_whole, capture=traced.method,
                        capture_reason=traced.reason,
                        gradless=gradless,
                        split_text=split.text if split.starts else "", split_points=split.starts,
                        estimates=estimates)


def _model_costs(plan: Plan, stages, work, tp_traffic, moe_traffic, device):
    """The time model's per-action costs on `device` (estimate/optime.py, predict.py)."""
    ops = [op_times(plan, w, device.hardware) for w in work]
    return stage_costs(plan, action_costs(plan, stages, ops, tp_traffic, moe_traffic, device))


def _attach_costs(stages: list[StageSpec], split: Split, costs: dict[fx.Node, Cost],
                  graph: fx.Graph) -> None:
    """Forward FLOPs and ops per microbatch, summed over each stage's own nodes."""
    for i, node in enumerate(compute_nodes(graph)):
        c = costs.get(node)
        if c is not None:
            st = stages[split.stage_of(i)]
            st.flops += c.flops
            st.recompute_flops += c.recompute_flops
            st.ops += c.ops
            st.recompute_ops += c.recompute_ops


def _attach_activations(plan: Plan, stages: list[StageSpec], run, costs: dict[fx.Node, Cost],
                        tp_kinds: dict[str, str]) -> None:
    """Bytes each stage's forward keeps for backward on one rank (estimate/activations.py)."""
    records = saved_records(plan.train.precision, run.gm, run)
    scale = {n.name: c.scale for n, c in costs.items() if c.scale != 1.0}
    split = TensorSplit(plan.mesh.tp, plan.tensor.sequence_parallel, tp_kinds) \
        if plan.mesh.tp > 1 else None
    for st in stages:
        st.activation_bytes = stage_saved_bytes(st.module, records, plan.recompute, split, scale)


def _non_persistent_buffers(model: torch.nn.Module) -> frozenset[str]:
    """Buffers the model keeps out of its state_dict (e.g. rotary inv_freq)."""
    keys = set(model.state_dict(keep_vars=True))
    return frozenset(n for n, _ in model.named_buffers(remove_duplicate=False) if n not in keys)
