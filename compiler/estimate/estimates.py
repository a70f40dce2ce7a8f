"""Per-rank estimates: memory by ZeRO stage, activations under the schedule, traffic, time.

Accounting (stated in the report, so a reader can check it):

* Parameters, gradients, optimizer states: the bytes the runtime holds after a
  step, exactly. Each rank's parameters are laid into ZeRO flat shards as the
  runtime lays them (`zero_layout.group_shards`: per stage, replicated /
  tensor-parallel slices / experts), and each shard costs
  `zero_layout.shard_memory` (padded to a multiple of its group; ZeRO-1 shards
  optimizer states, ZeRO-2 also grads, ZeRO-3 also weights; AdamW's float32
  step counter per tensor it steps). Groups: dp for replicated parameters and
  TP slices (1/tp of each annotated weight; row-parallel biases replicated);
  for experts (1/ep of each MoE layer) the expert-data-parallel group of dp/ep
  ranks. ZeRO-0 is the runtime's plain optimizer (one counter per parameter).
  Bytes per element: 4 / 4 / AdamW 8 (SGD 4 with momentum), with bf16 too:
  the runtime's bf16 is autocast over fp32 master weights, so parameters,
  gradients (and their reductions) and optimizer states stay fp32. A parameter
  no optimizer steps (requires_grad off, or the model gives it no gradient:
  `CompiledPlan.gradless`) is held whole beside the shards, its weights alone.
* Activations: the bytes each stage keeps for backward per microbatch on one
  rank (StageSpec.activation_bytes: estimate/activations.py, exact against the
  runtime under TP, sequence parallel, recompute and bf16), held from its F
  until its W (or BW) — the schedule engine's memory rule — so a rank's peak
  is found by walking its action list.
* Collectives per step (`RankEstimate.collectives`): the bytes each rank
  hands to each collective, {(group, op): n}, as backends' CommMeter counts
  them at the call sites. dp/edp: ZeRO's gradient reduction (all-reduce, or
  reduce-scatter at 2-3) of each padded shard and its all-gather of updated
  shards (1-2), or at 3 of the shard around every action of a stage reading it;
  ZeRO-0 all-reduces the gradients. tp and ep: what the rewrites imply
  (collectives.py, from the graph's traffic roles; also per stage, with call
  counts: `Estimates.stage_collectives`). tied: each tied gradient's all-reduce
  between its pipeline
  ranks. Scalar all-reduces (norms, the logged loss) are left out.
* Traffic per step, bytes each rank sends (`comm_bytes`): p2p (activations
  forward, grads back, per microbatch across a rank boundary); dp (the
  collectives above through rings: an all-reduce sends 2(n-1)/n of its
  tensor, a reduce-scatter (n-1)/n, an all-gather n-1 times its shard); tp
  (its collectives through rings, likewise); ep ((ep-1)/ep of the all-to-all
  rows); tied (the all-reduce of tied grads between their pipeline ranks).
  Every rank of a pipeline rank's dp x tp x ep slice holds and sends alike
  (shards are padded evenly), so each global rank's entry is its pipeline
  rank's; only a rank's share of the all-to-all rows follows its routing.
* Time: the time model (predict.py: per-op times on the device, exposed collectives,
  the schedule simulated with those per-action costs, the DP reduction's exposed tail, the
  optimizer step; driver.py puts its step in `step_time_s`), plus, under
  `experts.balance = step`, the routing pre-pass (`routing_prepass_s`: the schedule's
  forwards alone, simulated; their FLOPs, activation sends and the forward half of the EP
  all-to-alls are added to each rank's, the all-to-all calls to its collectives). The
  makespan + unoverlapped DP time computed here is what DiLoCo's sync estimate starts from.
"""
from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass
from typing import Optional, Sequence

import torch

from ...dsl.ast import Plan
from ...dsl.layout import group_sizes
from .collectives import ep_bytes, implied_collectives, ring_bytes
from .device import DeviceModel, mesh_links
from ...schedules.memory import held_peaks
from ..compiled import Estimates, RankEstimate, StageSpec, TiedParam
from ..parallel.ep import experts_dispatched
from .traffic import Traffic
from ..parallel.zero import (EXPERT, REPLICATED, TENSOR_PARALLEL, MemoryBytes, StateBytes,
                             buckets, group_shards, padded, shard_memory)


def state_bytes(plan: Plan) -> StateBytes:
    opt = plan.train.optimizer
    return StateBytes.of(opt.name, bool(opt.momentum))


@dataclass(frozen=True)
class RankShards:
    """One pipeline rank's parameters as the runtime's ZeRO lays them (zero_layout)."""

    shards: list  # zero_layout.ShardGroup, keys: id(parameter)
    uses: dict  # stage index -> indices into shards
    numel: dict  # id(parameter) -> elements this rank holds of it (after tp / ep)
    listed: tuple  # (stage index, [(key, kind)] in module order): ZeRO 0's buckets
    frozen: int = 0  # elements this rank holds of parameters no optimizer steps (weights only)


def rank_shards(plan: Plan, stages: list[StageSpec], tp_kinds: dict[str, str],
                expert_params: set[str], gradless: frozenset = frozenset()) -> RankShards:
    """Each parameter's kind and local size, grouped as `build_zero_optimizer` groups the
    rewritten stage modules' parameters (both call zero_layout.group_shards). Parameters that
    do not require grad, or that the model gives no gradient (`gradless`, the trainer freezes
    them), are held whole outside ZeRO's flat buffers: weights, no gradient, no state."""
    mesh, dispatched = plan.mesh, experts_dispatched(plan)
    listed, numel, frozen, seen = [], {}, 0, set()
    for st in stages:
        params = []
        for name, p in st.module.named_parameters():
            kind = _kind_of(plan, name, tp_kinds, expert_params, dispatched)
            n = p.numel() // {EXPERT: mesh.ep, TENSOR_PARALLEL: mesh.tp}.get(kind, 1)
            if not p.requires_grad or name in gradless:
                if id(p) not in seen:
                    seen.add(id(p))
                    frozen += n
                continue
            numel[id(p)] = n
            params.append((id(p), kind))
        listed.append((st.index, params))
    shards, uses = group_shards(listed)
    return RankShards(shards, uses, numel, tuple(listed), frozen)


def _kind_of(plan: Plan, name: str, tp_kinds: dict[str, str], expert_params: set[str],
             dispatched: bool) -> str:
    """How the tp and ep rewrites hold parameter `name`: an expert's, a tp shard, whole."""
    owner, _, leaf = name.rpartition(".")
    if dispatched and name in expert_params:
        return EXPERT
    tp_kind = tp_kinds.get(owner) if plan.mesh.tp > 1 else None
    if tp_kind is not None and not (tp_kind == "row" and leaf == "bias"):
        return TENSOR_PARALLEL
    return REPLICATED


def _group_of(plan: Plan, kind: str) -> tuple[str, int]:
    """(name, size) of the group a kind's gradients are reduced over."""
    if kind == EXPERT and plan.mesh.ep > 1:
        return "edp", group_sizes(plan.mesh).edp
    return "dp", plan.mesh.dp * plan.mesh.cp  # context parallel: reduced over dp x cp


def estimate(plan: Plan, stages: list[StageSpec], schedule, costs, tied: tuple[TiedParam, ...],
             tp_kinds: dict[str, str], expert_params: set[str], tp_traffic: list[Traffic],
             moe_traffic: list[Traffic], device: DeviceModel, replay=None,
             gradless: frozenset = frozenset()) -> Estimates:
    """Estimates for every global rank (pp outermost, tp innermost; a pipeline rank's dp × tp
    ranks hold the same shares, so they get equal numbers). `costs` (predict.action_costs, in
    seconds) time the schedule under `device`; `replay` (profile.replayed: the median
    profiled step's simulation and the median makespan) replaces that timing."""
    mesh = plan.mesh
    float_scale = 0.5 if plan.train.precision == "bf16" else 1.0
    peaks = held_peaks(schedule, [st.activation_bytes for st in stages])[0]
    per_pp, sums = [], []
    for r in range(mesh.pp):
        mine = [st for st in stages if st.rank == r]
        layout = rank_shards(plan, mine, tp_kinds, expert_params, gradless)
        actions = [a.stage for a in schedule.order[r]]
        est = _state_bytes(plan, layout, actions)
        est.rank, est.activation_bytes = r, int(peaks[r])
        implied = implied_collectives(plan, tp_traffic, moe_traffic, {st.index for st in mine},
                                      _partial_grads(plan, layout))
        est.collectives.update({k: b for k, (_, b) in implied.items()})
        est.collective_calls.update({k: c for k, (c, _) in implied.items()})
        sums.append(tied_sums(tied, stages, r, layout, state_bytes(plan).grad))
        tied_grads = [(n, k) for _, n, k in sums[-1]]
        if tied_grads:
            est.collectives[("tied", "allreduce")] = sum(n for n, _ in tied_grads)
            est.collective_calls[("tied", "allreduce")] = len(tied_grads)
        est.flops = sum(3 * st.flops + st.recompute_flops for st in mine) * plan.microbatches \
            / mesh.tp
        est.comm_bytes.update({
            "p2p": int(_p2p_bytes(stages, r, plan.microbatches, float_scale)),
            "tp": int(sum(ring_bytes(op, n, mesh.tp) for (g, op), n in est.collectives.items()
                          if g == "tp")),
            "ep": int(ep_bytes(plan, moe_traffic, mine, float_scale) * plan.microbatches),
            "tied": int(sum(ring_bytes("allreduce", n, holders) for n, holders in tied_grads))})
        if mesh.cp > 1:  # Ulysses all-to-alls or ring hops (compiler/parallel/cp.py)
            cp_bytes = sum(st.cp_bytes for st in mine) * float_scale * plan.microbatches
            op = "ring p2p" if plan.context.method == "ring" else "alltoall"
            est.collectives[("cp", op)] = int(cp_bytes)
            est.collective_calls[("cp", op)] = sum(st.cp_calls for st in mine) \
                * plan.microbatches
            est.comm_bytes["cp"] = int(cp_bytes)
        per_pp.append(est)
    per_replica = mesh.dp * mesh.cp * mesh.tp
    ranks = [dataclasses.replace(per_pp[g // per_replica], rank=g,
                                 comm_bytes=dict(per_pp[g // per_replica].comm_bytes),
                                 collectives=dict(per_pp[g // per_replica].collectives))
             for g in range(mesh.pp * per_replica)]
    from ...schedules.simulate import simulate
    sim, makespan = replay if replay is not None else (None, 0.0)
    if sim is None:
        sim = simulate(schedule, costs)
        makespan = sim.makespan
    from ..parallel.diloco import sync_estimate
    dp_link = mesh_links(plan, device).dp
    sync = sync_estimate(plan, stages, ranks, makespan, dp_link)  # DiLoCo: dp bytes / H
    dp_time = max((rk.comm_bytes["dp"] for rk in ranks), default=0) / dp_link
    prepass = routing_prepass_s(plan, schedule, costs)
    if prepass:  # its forward FLOPs and activations sent, on every rank
        for rk in ranks:
            mine = [st for st in stages if st.rank == rk.rank // per_replica]
            rk.flops += sum(st.flops for st in mine) * plan.microbatches / mesh.tp
            rk.comm_bytes["p2p"] += int(_p2p_bytes(stages, rk.rank // per_replica,
                                                   plan.microbatches, float_scale, grads=False))
            rk.comm_bytes["ep"] += int(ep_bytes(plan, moe_traffic, mine, float_scale)
                                       * plan.microbatches / 2)  # the forward half
    return Estimates(ranks=ranks, bubble=sim.bubble,
                     step_time_s=makespan + prepass + dp_time, prepass_s=prepass,
                     device_model=asdict(device), simulation=sim, sync=sync,
                     stage_collectives=stage_collectives(plan, stages, tp_kinds, expert_params,
                                                         tp_traffic, moe_traffic), tied=sums,
                     issued_collectives=issued_collectives(plan, stages, tp_kinds,
                                                           expert_params))


def _state_bytes(plan: Plan, layout: RankShards, order: Sequence[int]) -> RankEstimate:
    """Weights, grads and optimizer states of one rank's shards, and their DP collectives.
    `order`: the stage of each action of the rank's step, in order (ZeRO-3 gathers: the
    prefetch window gathers a shard once per run of consecutive actions whose stages read
    it, backends/parallel/zero/window.py)."""
    z, per = plan.zero, state_bytes(plan)
    memory, coll, calls = [], {}, {}

    def add(group: str, op: str, nbytes: float, count: int = 1) -> None:
        coll[(group, op)] = coll.get((group, op), 0) + int(nbytes)
        calls[(group, op)] = calls.get((group, op), 0) + count

    islands = plan.mesh.islands  # DiLoCo: the dp sums are pseudo-gradients (sync_estimate.py)
    if z == 0:  # the plain optimizer over every parameter; gradients all-reduced per group
        total = sum(layout.numel.values())
        memory.append(shard_memory(total, 1, 0, per, tensors=len(layout.numel)))
        bucketed = _buckets(plan, layout, per.param)
        for s in layout.shards:
            group, n = ("dp", plan.mesh.dp) if islands else _group_of(plan, s.kind)
            if n > 1:
                add(group, "allreduce", sum(layout.numel[k] for k in s.keys) * per.grad,
                    bucketed.pop((s.stage, group), 0))
            if islands and s.kind == EXPERT and _group_of(plan, s.kind)[1] > 1:
                # an island's own expert replicas (ep below tp): summed every step
                add("edp", "allreduce", sum(layout.numel[k] for k in s.keys) * per.grad,
                    bucketed.pop((s.stage, "edp"), 0))
    for i, s in enumerate(layout.shards if z > 0 else ()):
        numel = sum(layout.numel[k] for k in s.keys)
        group, n = _group_of(plan, s.kind)
        memory.append(shard_memory(numel, n, z, per))
        if n == 1:
            continue
        full = padded(numel, n)
        add(group, "allreduce" if z == 1 else "reduce_scatter", full * per.grad)
        gathers = 1 if z < 3 else _runs(order, {st for st, used in layout.uses.items()
                                                if i in used})
        add(group, "allgather", gathers * full // n * per.param, gathers)
    memory.append(MemoryBytes(layout.frozen * per.param, 0, 0))  # held whole, never stepped
    held = MemoryBytes(*(sum(getattr(m, f) for m in memory)
                         for f in ("params", "grads", "optimizer")))

    def through(inside: bool) -> int:  # ring bytes; inside: an island's own edp sums
        return int(sum(ring_bytes(op, nbytes, _size_of(plan, group))
                       for (group, op), nbytes in coll.items()
                       if not islands or (group == "edp") == inside))

    comm = {"dp": through(False)}  # DiLoCo: "dp" crosses the islands, "edp" stays inside
    if islands and ("edp", "allreduce") in coll:
        comm["edp"] = through(True)
    return RankEstimate(rank=0, param_bytes=held.params, grad_bytes=held.grads,
                        optimizer_bytes=held.optimizer, comm_bytes=comm, collectives=coll,
                        collective_calls={k: c for k, c in calls.items() if c})


def _runs(order: Sequence[int], stages: set) -> int:
    """Maximal runs of consecutive actions in `order` whose stage is in `stages`."""
    return sum(1 for k, st in enumerate(order)
               if st in stages and (k == 0 or order[k - 1] not in stages))


def _buckets(plan: Plan, layout: RankShards, param_size: int) -> dict[tuple[int, str], int]:
    """ZeRO 0: {(stage, group): all-reduces} the runtime's gradient sync makes of each
    stage's gradients (backends/runtime/grads.py: per group, parameters in module order,
    zero_layout.buckets; a parameter two stages hold counted in the first's, as
    group_shards places it)."""
    islands, seen, sizes = plan.mesh.islands, set(), {}
    for stage, params in layout.listed:
        for key, kind in params:
            if key in seen:
                continue
            seen.add(key)
            group = "dp" if islands else _group_of(plan, kind)[0]
            sizes.setdefault((stage, group), []).append(layout.numel[key] * param_size)
            if islands and kind == EXPERT and _group_of(plan, kind)[1] > 1:
                sizes.setdefault((stage, "edp"), []).append(layout.numel[key] * param_size)
    return {k: len(buckets(v)) for k, v in sizes.items()}


def _size_of(plan: Plan, group: str) -> int:
    return {"dp": plan.mesh.dp * plan.mesh.cp, "cp": plan.mesh.cp,
            "edp": group_sizes(plan.mesh).edp, "tp": plan.mesh.tp,
            "ep": plan.mesh.ep, "ep_tp": plan.mesh.ep * plan.mesh.tp}[group]


def stage_collectives(plan: Plan, stages: list[StageSpec], tp_kinds: dict[str, str],
                      expert_params: set[str], tp_traffic: list[Traffic],
                      moe_traffic: list[Traffic]) -> list[dict]:
    """Per stage, the tensor- and expert-parallel collectives its rewrite implies per step
    on each of its ranks: {(group, op): (calls, bytes handed in)} (what `pipeplan check`
    and report.md print, so an unexpected all-gather shows before launch)."""
    return [implied_collectives(plan, tp_traffic, moe_traffic, {st.index},
                                _partial_grads(plan, rank_shards(plan, [st], tp_kinds,
                                                                 expert_params)))
            for st in stages]


def issued_collectives(plan: Plan, stages: list[StageSpec], tp_kinds: dict[str, str],
                       expert_params: set[str]) -> list[Optional[dict]]:
    """Per stage, the collectives its rewritten run issued at check time (StageSpec.
    traced_collectives, per microbatch: DTensor's own, gathers it chose included) over a
    step, keyed as `stage_collectives`, with sequence parallel's once-a-step sums of partial
    gradients (outside the stage's run) added as that counts them; None where the stage
    did not run at check."""
    out = []
    for st in stages:
        if st.traced_collectives is None:
            out.append(None)
            continue
        m = plan.microbatches
        found = {("ep" if op == "alltoall" else "tp", op): (calls * m, nbytes * m)
                 for op, (calls, nbytes) in st.traced_collectives.items()}
        if plan.tensor.sequence_parallel and plan.mesh.tp > 1:
            calls, nbytes = _partial_grads(plan, rank_shards(plan, [st], tp_kinds,
                                                             expert_params))
            c, b = found.get(("tp", "allreduce"), (0, 0))
            if calls:
                found[("tp", "allreduce")] = (c + calls, b + nbytes)
        out.append(found)
    return out


def _partial_grads(plan: Plan, layout: RankShards) -> tuple[int, int]:
    """(how many, bytes): the replicated gradients sequence parallel sums over tp."""
    keys = [k for s in layout.shards if s.kind != TENSOR_PARALLEL for k in s.keys]
    return len(keys), sum(layout.numel[k] for k in keys) * state_bytes(plan).grad


def normalised(costs):
    """The same costs with the largest op time = 1 (generators compare times with a fixed
    epsilon, so they get unit-scale numbers, not microseconds)."""
    from ...schedules.costs import Costs
    scale = max((max(t) for t in costs.per_stage), default=0.0) or 1.0
    return Costs(per_stage=tuple(tuple(x / scale for x in t) for t in costs.per_stage),
                 latency=costs.latency / scale,
                 split=tuple(x / scale for x in costs.split) if costs.split else None)


def _bytes(spec) -> int:
    n = 1
    for d in spec.shape:
        n *= d
    return n * torch.empty((), dtype=getattr(torch, spec.dtype)).element_size()


def routing_prepass_s(plan: Plan, schedule, costs) -> float:
    """`experts.balance = step`: the no-grad forward of every microbatch that runs before
    each step (backends/runtime/balance.py), timed as the schedule's forwards alone, in their
    order, under the same costs. 0 otherwise."""
    if plan.experts is None or plan.experts.balance != "step":
        return 0.0
    table = costs.stage_table(schedule.stage_to_rank)
    orders = [[a for a in actions if a.op == "F"] for actions in schedule.order]
    at, free, end = [0] * len(orders), [0.0] * len(orders), {}
    while any(at[r] < len(o) for r, o in enumerate(orders)):  # each pass runs >= 1 forward
        for r, order in enumerate(orders):
            while at[r] < len(order):
                a = order[at[r]]
                if a.stage and (a.stage - 1, a.microbatch) not in end:
                    break  # waits for the previous stage's forward
                ready = 0.0 if not a.stage else end[(a.stage - 1, a.microbatch)] + (
                    table.latency if schedule.stage_to_rank[a.stage - 1] != r else 0.0)
                free[r] = max(free[r], ready) + table.time("F", a.stage)
                end[(a.stage, a.microbatch)] = free[r]
                at[r] += 1
    return max(free, default=0.0)


def _p2p_bytes(stages: list[StageSpec], rank: int, m: int, float_scale: float,
               grads: bool = True) -> float:
    sent = 0.0
    for st in stages:
        if st.rank != rank:
            continue
        nxt = stages[st.index + 1] if st.index + 1 < len(stages) else None
        if nxt is not None and nxt.rank != rank:
            sent += sum(_bytes(o) * (float_scale if "float" in o.dtype else 1)
                        for o in st.outputs)
        prev = stages[st.index - 1] if st.index > 0 else None
        if grads and prev is not None and prev.rank != rank:  # grads of what it received
            grads = {o.name: o for o in prev.outputs if o.requires_grad}
            sent += sum(_bytes(grads[r.name]) * float_scale for r in st.inputs
                        if r.source == prev.index and r.name in grads)
    return sent * m


def tied_sums(tied: tuple[TiedParam, ...], stages: list[StageSpec], rank: int,
              layout: RankShards, gb: int) -> list[tuple[int, int, int]]:
    """(stage, bytes, holding ranks) of each tied gradient pipeline rank `rank` all-reduces
    with the other pipeline ranks holding it (backends/runtime/grads.py: sum_tied; its
    local size: a vocab-parallel weight's TP slice; the stage: the one on this rank that
    holds it)."""
    out = []
    for t in tied:
        ranks = [stages[s].rank for s in t.stages]
        if rank in ranks and len(set(ranks)) > 1:
            i = ranks.index(rank)
            p = stages[t.stages[i]].module.get_parameter(t.names[i])
            out.append((t.stages[i], layout.numel[id(p)] * gb, len(set(ranks))))
    return out
