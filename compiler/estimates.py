"""Per-rank estimates: memory by ZeRO stage, activations under the schedule, traffic, time.

Accounting (stated in the report, so a reader can check it):

* Bytes per parameter element: fp32 — weights 4, grads 4, AdamW 8 (two fp32
  moments); bf16 — weights 2, grads 2, AdamW 12 (fp32 master + two moments)
  (the ZeRO paper's 2 + 2 + 12). SGD keeps a 4-byte momentum when momentum > 0.
  ZeRO-1 shards the optimizer state over the data-parallel group, ZeRO-2 also
  the grads, ZeRO-3 also the weights. Tensor-parallel layers hold 1/tp of their
  weight (row-parallel biases are replicated); experts 1/ep of each MoE layer.
  Expert weights are replicated over dp·tp/ep ranks, their ZeRO group.
* Activations: the bytes each stage saves for backward per microbatch, held
  from its F until its W (or BW) — the schedule engine's memory rule — so a
  rank's peak is found by walking its action list. bf16 halves float bytes;
  with sequence parallelism they are divided by tp (without it, the estimate
  keeps the replicated size: an upper bound).
* Traffic per step, bytes each rank sends: p2p (activations forward, grads
  back, per microbatch across a rank boundary); dp (ring all-reduce,
  2(n-1)/n of the grads; 3(n-1)/n with ZeRO-3); tp (Megatron: a row-parallel
  layer all-reduces its output in forward, a column-parallel layer its input
  grad in backward); ep (all-to-all dispatch and combine of top_k copies of
  each token, forward and backward); tied (the all-reduce of tied grads).
* Time: op times = FLOPs / (tp · flops_per_s), plus the stage's tp traffic
  over the node-local link and its ep traffic over the network (half in F,
  half in B); p2p messages take latency + bytes / bandwidth. The
  schedule is generated (normalised) and simulated with those costs; step
  time = the simulated makespan plus the DP gradient all-reduce (not
  overlapped).
"""
from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass

import torch

from ..dsl.ast import Plan
from .compiled import Estimates, RankEstimate, StageSpec, TiedParam
from .traffic import Traffic


@dataclass(frozen=True)
class DeviceModel:
    """What the time estimate assumes about one accelerator and its links."""

    flops_per_s: float = 400e12  # sustained, e.g. an H100 at ~40% of its dense bf16 peak
    link_bytes_per_s: float = 50e9  # between nodes (p2p, dp, ep), e.g. 400 Gb/s InfiniBand
    latency_s: float = 10e-6
    tp_link_bytes_per_s: float = 450e9  # inside a node (tp), e.g. NVLink 4


@dataclass(frozen=True)
class ParamFacts:
    """What the estimate needs about each parameter held by a stage."""

    numel: int
    tp_sharded: bool
    expert: bool


def element_bytes(plan: Plan) -> tuple[int, int, int]:
    """(weight, grad, optimizer) bytes per parameter element."""
    bf16 = plan.train.precision == "bf16"
    w = g = 2 if bf16 else 4
    opt = plan.train.optimizer
    if opt.name == "adamw":
        o = 8
    else:
        o = 4 if opt.momentum else 0
    return w, g, o + (4 if bf16 else 0)


def param_facts(plan: Plan, stage: StageSpec, tp_kinds: dict[str, str],
                expert_params: set[str]) -> dict[int, ParamFacts]:
    """id(parameter) -> facts, for the parameters a stage holds."""
    out = {}
    for name, p in stage.module.named_parameters(remove_duplicate=False):
        owner, _, leaf = name.rpartition(".")
        kind = tp_kinds.get(owner)
        sharded = plan.mesh.tp > 1 and kind is not None and not (kind == "row" and leaf == "bias")
        out[id(p)] = ParamFacts(p.numel(), sharded, name in expert_params)
    return out


def estimate(plan: Plan, stages: list[StageSpec], schedule, costs, tied: tuple[TiedParam, ...],
             tp_kinds: dict[str, str], expert_params: set[str], tp_traffic: list[Traffic],
             moe_traffic: list[Traffic], device: DeviceModel = DeviceModel()) -> Estimates:
    """Estimates for every global rank (pp outermost, tp innermost; a pipeline rank's dp × tp
    ranks hold the same shares, so they get equal numbers). `costs` (from step_costs, in
    seconds) time the schedule."""
    mesh = plan.mesh
    float_scale = 0.5 if plan.train.precision == "bf16" else 1.0
    act_div = mesh.tp if plan.tensor.sequence_parallel else 1
    peaks = activation_peaks(schedule, [st.activation_bytes * float_scale / act_div
                                        for st in stages])
    per_pp = []
    for r in range(mesh.pp):
        mine = [st for st in stages if st.rank == r]
        facts: dict[int, ParamFacts] = {}
        for st in mine:
            facts.update(param_facts(plan, st, tp_kinds, expert_params))
        est = _state_bytes(plan, facts)
        est.rank, est.activation_bytes = r, int(peaks[r])
        est.flops = sum(3 * st.flops + st.recompute_flops for st in mine) * plan.microbatches \
            / mesh.tp
        est.comm_bytes.update({
            "p2p": int(_p2p_bytes(stages, r, plan.microbatches, float_scale)),
            "tp": int(_tp_bytes(plan, tp_traffic, mine, float_scale) * plan.microbatches),
            "ep": int(_ep_bytes(plan, moe_traffic, mine, float_scale) * plan.microbatches),
            "tied": int(_tied_bytes(tied, stages, r, element_bytes(plan)[1]))})
        per_pp.append(est)
    per_replica = mesh.dp * mesh.tp
    ranks = [dataclasses.replace(per_pp[g // per_replica], rank=g,
                                 comm_bytes=dict(per_pp[g // per_replica].comm_bytes))
             for g in range(mesh.pp * per_replica)]
    from ..schedules.simulate import simulate
    sim = simulate(schedule, costs)
    dp_time = max((rk.comm_bytes["dp"] for rk in ranks), default=0) / device.link_bytes_per_s
    return Estimates(ranks=ranks, bubble=sim.bubble, step_time_s=sim.makespan + dp_time,
                     device_model=asdict(device), simulation=sim)


def _state_bytes(plan: Plan, facts: dict[int, ParamFacts]) -> RankEstimate:
    """Weights, grads and optimizer state of one rank's parameters, and their DP traffic."""
    mesh, z = plan.mesh, plan.zero
    wb, gb, ob = element_bytes(plan)
    dense = sum(f.numel / (mesh.tp if f.tp_sharded else 1) for f in facts.values()
                if not f.expert)
    experts = sum(f.numel / mesh.ep / (mesh.tp if f.tp_sharded else 1) for f in facts.values()
                  if f.expert)
    expert_group = max(1, mesh.dp * mesh.tp // mesh.ep)  # ranks holding the same experts

    def held(level: int, nbytes: int) -> float:
        """ZeRO at or above `level` shards this state over each parameter's replicas."""
        if z >= level:
            return (dense / mesh.dp + experts / expert_group) * nbytes
        return (dense + experts) * nbytes

    passes = 3 if z >= 3 else 2
    dp = _ring(dense * gb, mesh.dp, passes) + _ring(experts * gb, expert_group, passes)
    return RankEstimate(rank=0, param_bytes=int(held(3, wb)), grad_bytes=int(held(2, gb)),
                        optimizer_bytes=int(held(1, ob)), comm_bytes={"dp": int(dp)})


def activation_peaks(schedule, stage_bytes: list[float]) -> list[float]:
    """Peak activation bytes per rank: F adds the stage's bytes, W or BW frees them."""
    peaks = []
    for actions in schedule.order:
        held = peak = 0.0
        for a in actions:
            if a.op == "F":
                held += stage_bytes[a.stage]
            elif a.op in ("W", "BW"):
                held -= stage_bytes[a.stage]
            peak = max(peak, held)
        peaks.append(peak)
    return peaks


def step_costs(plan: Plan, stages: list[StageSpec], tp_traffic: list[Traffic],
               moe_traffic: list[Traffic], device: DeviceModel):
    """Per-stage (F, B, W) op times in seconds and the p2p message time: a schedules.Costs.
    The schedule is generated (normalised) and simulated with these same costs."""
    from ..schedules.costs import Costs
    tp = plan.mesh.tp
    float_scale = 0.5 if plan.train.precision == "bf16" else 1.0
    table = []
    for st in stages:
        coll = (_tp_bytes(plan, tp_traffic, [st], float_scale) / device.tp_link_bytes_per_s
                + _ep_bytes(plan, moe_traffic, [st], float_scale) / device.link_bytes_per_s) / 2
        f = st.flops / tp / device.flops_per_s
        table.append((f + coll, f + st.recompute_flops / tp / device.flops_per_s + coll, f))
    msg = [sum(_bytes(o) for o in st.outputs) * float_scale for st in stages[:-1]]
    latency = device.latency_s + (max(msg, default=0.0) / device.link_bytes_per_s)
    return Costs(per_stage=tuple(table), latency=latency)


def normalised(costs):
    """The same costs with the largest op time = 1 (generators compare times with a fixed
    epsilon, so they get unit-scale numbers, not microseconds)."""
    from ..schedules.costs import Costs
    scale = max((max(t) for t in costs.per_stage), default=0.0) or 1.0
    return Costs(per_stage=tuple(tuple(x / scale for x in t) for t in costs.per_stage),
                 latency=costs.latency / scale)


def _bytes(spec) -> int:
    n = 1
    for d in spec.shape:
        n *= d
    return n * torch.empty((), dtype=getattr(torch, spec.dtype)).element_size()


def _p2p_bytes(stages: list[StageSpec], rank: int, m: int, float_scale: float) -> float:
    sent = 0.0
    for st in stages:
        if st.rank != rank:
            continue
        nxt = stages[st.index + 1] if st.index + 1 < len(stages) else None
        if nxt is not None and nxt.rank != rank:
            sent += sum(_bytes(o) * (float_scale if "float" in o.dtype else 1)
                        for o in st.outputs)
        prev = stages[st.index - 1] if st.index > 0 else None
        if prev is not None and prev.rank != rank:  # grads of what it received
            grads = {o.name: o for o in prev.outputs if o.requires_grad}
            sent += sum(_bytes(grads[r.name]) * float_scale for r in st.inputs
                        if r.source == prev.index and r.name in grads)
    return sent * m


def _ring(nbytes: float, n: int, passes: int) -> float:
    """Bytes one rank sends in a ring all-reduce (passes=2) or ZeRO-3's extra gather (3)."""
    return 0.0 if n <= 1 else passes * (n - 1) / n * nbytes


def _tp_bytes(plan: Plan, traffic: list[Traffic], stages: list[StageSpec],
              float_scale: float) -> float:
    idx = {st.index for st in stages}
    total = sum(t.nbytes for t in traffic if t.stage in idx)
    return _ring(total * float_scale, plan.mesh.tp, 2)


def _ep_bytes(plan: Plan, traffic: list[Traffic], stages: list[StageSpec],
              float_scale: float) -> float:
    """Dispatch + combine of top_k copies of each token, forward and backward."""
    ex, ep = plan.experts, plan.mesh.ep
    if ex is None or ep <= 1:
        return 0.0
    idx = {st.index for st in stages}
    tokens = sum(t.nbytes for t in traffic if t.stage in idx)
    return 4 * ex.top_k * tokens * float_scale * (ep - 1) / ep


def _tied_bytes(tied: tuple[TiedParam, ...], stages: list[StageSpec], rank: int, gb: int) -> float:
    total = 0.0
    for t in tied:
        holders = {stages[s].rank for s in t.stages}
        if rank in holders and len(holders) > 1:
            st = stages[t.stages[[stages[s].rank for s in t.stages].index(rank)]]
            name = t.names[[stages[s].rank for s in t.stages].index(rank)]
            p = st.module.get_parameter(name)
            total += _ring(p.numel() * gb, len(holders), 2)
    return total
