"""Predicted step time: per-action costs, one simulated timeline, and what each pipeline rank
spends its step on (compute / exposed communication / bubble / optimizer).

* Action costs (`action_costs`): each stage's F, B, W from its ops on the device
  (optime.py), plus the tensor-parallel collectives the rewrite places in them
  (collectives.py), each call latency x ring steps + the bytes its ring sends / the tp
  group's link, exposed (the runtime does not overlap them), each in the pass the
  rewrite places it in (`tp_passes`: a row layer's all-reduce in F, a column layer's
  input-gradient all-reduce in B), the forward's again in B for the layers a `full`
  recompute rule covers (`rerun_calls`: their rerun communicates; `selective` does not);
  expert all-to-alls and context-parallel exchanges by bytes / link, half in F and half
  in B, plus a latency per message
  (`exchange_waits`: an all-to-all over n ranks is n - 1 pairwise exchanges, a ring hop
  one). p2p: latency + the largest message
  / the link between neighbouring pipeline ranks, on its own stream (the simulator's
  arrival delay: the sender does not wait); on the measured CPU posting each send and
  receive costs the host its measured time (`post_s`), charged to the action that
  receives or sends it (by stage adjacency: a V schedule's same-rank handover counted too).
* Gradient reduction (`exposed_reduction`): the runtime (backends/runtime/grads.py)
  launches each stage's bucketed DP all-reduce when that stage's last W/BW of the step
  ends, one after another on the communication stream, and waits before the optimizer:
  only what outlasts the rank's last action is exposed.
* ZeRO-3 gathers (`exposed_gathers`): the runtime's prefetch window
  (backends/parallel/zero/window.py) all-gathers a stage's parameters over dp before the
  rank's first action of the step (nothing to hide it behind: exposed), and where the
  next action runs another stage it starts that stage's gather as the current action
  begins: only what outlasts the current action is exposed.
* ZeRO-1/2's all-gather of the updated shards (`dp_ring_bytes`) runs after the optimizer
  step, blocking: exposed whole.
* Optimizer: one memory-bound pass over the rank's shard (read parameters, gradients and
  states, write parameters and states) at the device's sustained memory bandwidth.
* The trainer's own collectives (`StepSync`, `step_sync`): the logged loss's all-reduce
  over the island, which every rank waits for before its optimizer (so none steps before
  the last rank's actions end), and the tied gradients' sums between pipeline ranks,
  overlapped with the backward or after the DP reduction as the runtime runs them.

`Timing.time_on(device)` re-times a compiled plan on any device model without tracing
(per-stage arithmetic and one simulation): the function a plan search calls per candidate.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from ...dsl.ast import Plan
from ..compiled import BATCH, StageSpec
from ..recompute import recompute_mode
from .collectives import _tp_microbatch, ep_bytes, ep_calls, ring_bytes, ring_steps
from .device import DeviceModel, mesh_links
from .optime import OpTimes, StageWork, host_around, op_times, optimizer_ops, takes_input_grads


@dataclass(frozen=True)
class RankTime:
    """Seconds of one pipeline rank's step: compute + comm + bubble + optimizer = step."""

    rank: int
    compute: float  # its ops: F, B, W and recompute
    comm: float  # exposed: collectives inside its actions + the DP reduction's tail
    bubble: float  # waiting: for other ranks' actions, p2p arrivals, the slowest rank (and
    # ranks sharing a CPU: for a core, predict.shared_floor)
    optimizer: float


@dataclass(frozen=True)
class Prediction:
    step_s: float
    ranks: tuple[RankTime, ...]  # per pipeline rank (its dp x tp ranks alike)
    flops_per_gpu: float  # model FLOPs per step per GPU (recompute counted: hardware FLOPs)
    model_flops_per_gpu: float  # without recompute: what MFU counts
    peak: float  # the device's peak FLOP/s in the compute precision
    cpu_s: float = 0.0  # ranks sharing a CPU: its processes' CPU seconds per step (the floor
    # x the cores: predict.shared_floor); 0 elsewhere

    @property
    def tflops_per_gpu(self) -> float:
        """Achieved FLOP/s per GPU as Megatron-LM reports it (recompute included), in T."""
        return self.flops_per_gpu / self.step_s / 1e12 if self.step_s else 0.0

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation: model FLOPs (no recompute) per second over peak."""
        return self.model_flops_per_gpu / self.step_s / self.peak if self.step_s else 0.0


def collective_s(op: str, nbytes: float, n: int, bandwidth: float, latency: float) -> float:
    """One ring collective a rank hands `nbytes`: a latency per ring step + bytes sent."""
    if n <= 1:
        return 0.0
    return latency * ring_steps(op, n) + ring_bytes(op, nbytes, n) / bandwidth


def tp_passes(calls, tp: int, link: float, latency: float) -> tuple[float, float]:
    """(forward, backward) seconds of a stage's TP collectives per microbatch, each call in
    the pass the rewrite places it in (collectives._role_collectives: a row layer's
    all-reduce in F, a column layer's input-gradient all-reduce in B, ...), exposed."""
    f = b = 0.0
    for op, n, phase in calls:
        s = collective_s(op, n, tp, link, latency)
        f, b = (f + s, b) if phase == "F" else (f, b + s)
    return f, b


def rerun_calls(plan: Plan, tp_traffic, stage: int, float_scale: float) -> list:
    """The TP calls (tp_passes' form) of a stage's layers a `full` recompute rule covers:
    their forward ("F") collectives run again in B, as the rerun communicates
    (compiler/recompute.dropped; `selective` keeps their outputs)."""
    full = [t for t in tp_traffic if t.stage == stage
            and recompute_mode(plan.recompute, t.module)[0] == "full"]
    return _tp_microbatch(plan, full, {stage}, float_scale) if full and plan.mesh.tp > 1 \
        else []


def waiting_of(calls, tp: int, tp_s: tuple[float, float], exchange_s: tuple[float, float],
               again: float, device: DeviceModel, again_calls=()) -> tuple[float, float, float]:
    """Costs.waiting of a stage: of the seconds its F and B spend in collectives (`tp_s`:
    its TP calls', `calls` in tp_passes' form; `exchange_s`: EP's and CP's message
    latencies; `again`: the forward's TP collectives a full recompute reruns in B, those
    of `again_calls`), those its rank leaves the cores to others: less what gloo's own
    threads compute meanwhile, per ring step (the measured CPU's collective_cpu_s; 0 on an
    accelerator)."""
    f_steps = sum(ring_steps(op, tp) for op, _, phase in calls if phase == "F")
    b_steps = sum(ring_steps(op, tp) for op, _, phase in calls) - f_steps
    b_steps += sum(ring_steps(op, tp) for op, _, phase in again_calls if phase == "F")
    step = device.ring_step_s
    exchanges = (exchange_s[0] / step, exchange_s[1] / step) if step > 0 else (0.0, 0.0)
    behind = device.hardware.collective_cpu_s if device.hardware else 0.0
    f = tp_s[0] + exchange_s[0] - (f_steps + exchanges[0]) * behind
    b = tp_s[1] + again + exchange_s[1] - (b_steps + exchanges[1]) * behind
    return max(0.0, f), max(0.0, b), 0.0


def wrapped(st: StageSpec) -> int:
    """Tensors eager tensor parallelism wraps as DTensors per microbatch of a stage: its
    parameters, buffers, received inputs and the values its graph makes (StageSpec.made:
    batch fields among them, where they meet the others)."""
    received = sum(1 for ref in st.inputs if ref.source != BATCH)
    return len(st.param_names) + len(st.buffer_names) + received + st.made


def passes(calls) -> tuple[int, int]:
    """How many of a stage's TP calls (op, bytes, pass) run in the forward, in the backward."""
    f = sum(1 for *_, phase in calls if phase == "F")
    return f, len(calls) - f


def exchange_waits(plan: Plan, ep: int, ep_roles, cp_steps: tuple,
                   latency: float) -> tuple[float, float]:
    """(forward, backward) seconds one microbatch of a stage waits on message latency in
    its expert all-to-alls and context-parallel exchanges (their bytes are charged
    apart). `ep_roles`: the traffic roles of the stage's experts calls (traffic.py), each
    making `collectives.ep_calls` all-to-alls, each ep - 1 pairwise exchanges (Thakur et
    al. 2005), half of them forward and half backward; `cp_steps`: the cp exchanges'
    latencies forward and backward (compiler/parallel/cp.py: exchanges)."""
    calls = sum(ep_calls(plan, role, prepass=False) for role in ep_roles) \
        if ep > 1 and plan.experts else 0
    ep_s = calls * (ep - 1) * latency / 2
    return ep_s + cp_steps[0] * latency, ep_s + cp_steps[1] * latency


def action_costs(plan: Plan, stages: list[StageSpec], ops: list[OpTimes], tp_traffic,
                 moe_traffic, device: DeviceModel):
    """Seconds per (F, B, W) of each stage and the p2p delay: a schedules.Costs, with the
    seconds of each action its rank waits in collectives (TP's, EP's and CP's latencies)
    as its `waiting`, and what a separate W adds on the host as its `split`."""
    from ...schedules.costs import Costs
    links = mesh_links(plan, device)
    tp = plan.mesh.tp
    float_scale = 0.5 if plan.train.precision == "bf16" else 1.0
    table, waiting, resumed_ops = [], [], []
    for st, t in zip(stages, ops):
        calls = _tp_microbatch(plan, tp_traffic, {st.index}, float_scale) if tp > 1 else []
        tp_f, tp_b = tp_passes(calls, tp, links.tp, device.ring_step_s)
        other = (ep_bytes(plan, moe_traffic, [st], float_scale) / links.ep
                 + st.cp_bytes * float_scale / links.tp)
        wait_f, wait_b = exchange_waits(
            plan, plan.mesh.ep, [x.role for x in moe_traffic if x.stage == st.index],
            st.cp_steps, device.ring_step_s)
        rerun = rerun_calls(plan, tp_traffic, st.index, float_scale)
        again = tp_passes(rerun, tp, links.tp, device.ring_step_s)[0]
        post = _posts(st.index, len(stages)) * (device.hardware.post_s if device.hardware else 0.0)
        host_f, host_b = host_around(plan, device.hardware, wrapped(st), passes(calls), sum(
            1 for x in moe_traffic if x.stage == st.index and x.role == "tokens"), plan.mesh.ep)
        grads = takes_input_grads(st)
        row, waits = in_w_without_input_grads(
            grads,
            (t.f + tp_f + other / 2 + wait_f + host_f, t.b + tp_b + other / 2 + again + wait_b
             + host_b, t.w),
            waiting_of(calls, tp, (tp_f, tp_b), (wait_f, wait_b), again, device, rerun))
        row, t = resumed(device, grads, (row[0] + post, row[1] + post, row[2]), t)
        table.append(row)
        resumed_ops.append(t)
        waiting.append(waits)
    msg = [sum(_nbytes(o) * (float_scale if "float" in o.dtype else 1) for o in st.outputs)
           for st in stages[:-1]]
    latency = device.latency_s + max(msg, default=0.0) / links.p2p
    return Costs(per_stage=tuple(table), latency=latency, waiting=tuple(waiting),
                 split=split_of(resumed_ops))


def resume_s(device: DeviceModel) -> float:
    """CPU seconds each action of a rank pays on resuming its core where the plan's ranks
    outnumber the cores (after each blocking handoff another process used the core: its
    caches refilled), at the shared speeds: the measured CPU's resume_s
    (cpu_probe.measure_resume); 0 elsewhere."""
    shared = device.shared_at
    if shared is None or device.hardware is None or not shared[0].resume:
        return 0.0
    return device.hardware.resume_s


def resumed(device: DeviceModel, input_grads: bool, row: tuple,
            t: OpTimes) -> tuple[tuple, OpTimes]:
    """A stage's (F, B, W) seconds and OpTimes with each action's resume (`resume_s`) added:
    to F, to B (a fused BW pays it once) and to a separate W (OpTimes.split: what a separate
    W adds); on a stage no gradient leaves, whose B does nothing, to W (so BW and W pay it
    once). Check (action_costs) and the planner both call it."""
    r = resume_s(device)
    if not r:
        return row, t
    f, b, w = row
    if input_grads:
        return (f + r, b + r, w), replace(t, split=t.split + r)
    return (f + r, b, w + r), t


def split_of(ops: list[OpTimes]) -> Optional[tuple[float, ...]]:
    """Costs.split from the stages' OpTimes (None where no stage's W adds anything)."""
    return tuple(t.split for t in ops) if any(t.split for t in ops) else None


def in_w_without_input_grads(input_grads: bool, row: tuple, waits: tuple) -> tuple:
    """A stage's (F, B, W) seconds and their waits, a stage no gradient leaves running its
    whole backward in W (optime.op_times: B's compute is already there), its backward's
    collectives with it: B does nothing but receive."""
    if input_grads:
        return row, waits
    return (row[0], 0.0, row[1] + row[2]), (waits[0], 0.0, waits[1] + waits[2])


def exposed_reduction(jobs: list[tuple[float, float]], compute_end: float) -> float:
    """The overlap rule: reductions (ready time, duration) run one at a time, in order of
    readiness, on the communication stream; what ends after `compute_end` is exposed."""
    t = 0.0
    for ready, duration in sorted(jobs):
        t = max(t, ready) + duration
    return max(0.0, t - compute_end)


def _posts(stage: int, stages: int) -> int:
    """Transfers F posts on the measured CPU (the host's work per send or receive), and B
    as many: F receives from the stage before and sends to the one after, B the other way
    round."""
    return int(stage > 0) + int(stage < stages - 1)


def exposed_gathers(actions, durations: list[float], gather_s: list[float]) -> float:
    """ZeRO-3's prefetch window on one rank's actions of a step: the first action's gather
    is exposed whole; each change of stage is gathered while the action before it runs, so
    only what outlasts that action is exposed. `gather_s[s]`: one gather of stage s."""
    if not actions or not any(gather_s):
        return 0.0
    exposed = gather_s[actions[0].stage]
    for prev, nxt, d in zip(actions, actions[1:], durations):
        if nxt.stage != prev.stage:
            exposed += max(0.0, gather_s[nxt.stage] - d)
    return exposed


@dataclass(frozen=True)
class StepSync:
    """The trainer's own collectives each step (backends/runtime/trainer.py, grads.py):
    the loss all-reduce over the island (`loss_s`; every rank starts it as its actions end
    and waits for it before the optimizer, so no rank's optimizer starts before the last
    rank's actions end), and per pipeline rank the sums of its tied gradients
    (`tied[r]`: (stage, seconds, overlapped) each; overlapped ones start when their
    stage's last W/BW ends, on the communication stream with the DP reduction's buckets,
    the others run after the DP reduction, blocking: grads.GradSync / ZeroSync)."""

    loss_s: float = 0.0
    tied: tuple = ()
    norm_s: float = 0.0  # clipping: the gradient norm's all-reduces, after every rank's
    # gradient sync (a pipeline's ranks meet in its last); before the optimizer


def breakdown(schedule, sim, ops: list[OpTimes], costs, dp_s: list[float],
              optimizer_s: list[float], gather_s: Optional[list[float]] = None,
              after_s: Optional[list[float]] = None, floor: float = 0.0,
              sync: StepSync = StepSync()) -> tuple[float, tuple[RankTime, ...]]:
    """(step seconds, per pipeline rank) of one simulated step. `dp_s[s]`: seconds to reduce
    stage s's gradients over dp; `optimizer_s[r]`: rank r's optimizer step; `gather_s[s]`:
    one ZeRO-3 all-gather of stage s's parameters (None: no ZeRO-3); `after_s[r]`:
    communication rank r waits for after its optimizer step, overlapping nothing (DiLoCo's
    outer sync, per step on average; ZeRO-1/2's all-gather); `floor`: no step is shorter
    (shared_floor; the ranks then wait for a core, counted as bubble); `sync`: the step's
    own collectives (StepSync: a rank waiting for the loss all-reduce waits for the last
    rank's actions, bubble, then for the all-reduce itself, communication; clipping, for
    the norm's all-reduces after the last rank's gradient sync)."""
    table = costs.stage_table(schedule.stage_to_rank)
    rows = []
    for r, actions in enumerate(schedule.order):
        compute = sum(_op_time(ops, a) for a in actions)
        durations = [table.time(a.op, a.stage) for a in actions]
        busy = sum(durations)
        gathered = exposed_gathers(actions, durations, gather_s) if gather_s else 0.0
        end = (sim.end[r][-1] if actions else 0.0) + gathered
        last = {a.stage: e for a, e in zip(actions, sim.end[r]) if a.op in ("W", "BW")}
        tied = sync.tied[r] if sync.tied else ()
        jobs = [(e, dp_s[s]) for s, e in last.items()]
        jobs += [(last.get(s, end), t) for s, t, overlapped in tied if overlapped]
        exposed = exposed_reduction(jobs, end) + sum(t for _, t, o in tied if not o)
        rows.append((r, compute, busy - compute + gathered + exposed, end, end + exposed))
    summed = max((end for *_, end, _ in rows), default=0.0) + sync.loss_s  # the loss's
    normed = max((ready for *_, ready in rows), default=0.0) + sync.norm_s  # the norm's
    out, step = [], floor
    for (r, compute, comm, _, ready), opt in zip(rows, optimizer_s):
        start = max(ready, summed, normed if sync.norm_s else 0.0)
        comm += _covered(((summed - sync.loss_s, summed), (normed - sync.norm_s, normed)),
                         ready, start)  # waiting in the all-reduces, the rest bubble
        after = after_s[r] if after_s else 0.0
        out.append((r, compute, comm + after, opt))
        step = max(step, start + opt + after)
    return step, tuple(RankTime(r, c, comm, step - c - comm - opt, opt)
                       for r, c, comm, opt in out)


def _covered(spans, lo: float, hi: float) -> float:
    """Seconds of [lo, hi] inside the union of `spans` ((start, end) each)."""
    total, reach = 0.0, lo
    for a, b in sorted(spans):
        a, b = max(a, reach), min(b, hi)
        if b > a:
            total, reach = total + b - a, b
    return total


def shared_floor(schedule, costs, device: DeviceModel, once_steps: list[float],
                 gather_steps: list[float], optimizer_s: list[float],
                 step_steps: float = 0.0) -> float:
    """Ranks sharing a CPU's cores (`device.shared_at`; 0 elsewhere): no step is shorter
    than the CPU seconds all their processes spend in it over the cores, whatever the
    timeline says (it stretches every action alike by the busy count). A pipeline rank
    spends, at the shared speeds: each action's seconds less its `costs.waiting`; gloo's
    own threads' work (hardware.collective_cpu_s) per ring step of its stages' reductions
    and all-gathers once a step (`once_steps[s]`) and of a ZeRO-3 gather of stage s
    (`gather_steps[s]`) each time its actions come to the stage (exposed_gathers' count),
    and per p2p transfer it posts (transfer_cpu_s), and of the loss all-reduce every
    process joins once a step (`step_steps`: its ring steps); its optimizer pass. The
    speeds are alone x the fair share: over it, x the replicas, over the cores."""
    if device.shared_at is None:
        return 0.0
    sharing, busy = device.shared_at
    hw = device.hardware
    from ...schedules.costs import StageCosts
    table = costs.stage_table(schedule.stage_to_rank)
    waiting = StageCosts(costs.waiting or ((0.0, 0.0, 0.0),) * len(table.table), 0.0)
    total = sum(optimizer_s)
    for actions in schedule.order:
        for i, a in enumerate(actions):
            total += table.time(a.op, a.stage) - waiting.time(a.op, a.stage)
            if a.op != "W":
                total += _posts(a.stage, schedule.stages) * hw.transfer_cpu_s
            if i == 0 or a.stage != actions[i - 1].stage:
                total += gather_steps[a.stage] * hw.collective_cpu_s
        total += (sum(once_steps[s] for s in {a.stage for a in actions}) + step_steps) \
            * hw.collective_cpu_s
    return total * sharing.replicas / (sharing.factor(busy) * sharing.cores)


def _op_time(ops: list[OpTimes], a) -> float:
    t = ops[a.stage]
    return {"F": t.f, "B": t.b, "W": t.w + t.split, "BW": t.b + t.w}[a.op]


@dataclass
class Timing:
    """What timing a compiled plan needs, kept so it can be timed again on any device model
    without tracing: each stage's grouped ops (optime.StageWork), the traffic of its
    collectives, the schedule, the ring bytes each stage reduces over dp, each pipeline
    rank's optimizer bytes, and the FLOPs per GPU."""

    plan: Plan
    stages: list
    schedule: object
    work: list  # StageWork per stage
    tp_traffic: list
    moe_traffic: list
    dp_bytes: list  # per stage: ring bytes one of its ranks sends to reduce its gradients
    optimizer_bytes: list  # per pipeline rank: bytes its optimizer step reads and writes
    gather_bytes: list  # per stage: ring bytes one of its ranks sends per ZeRO-3 gather
    flops_per_gpu: float
    model_flops_per_gpu: float
    regather_bytes: Optional[list] = None  # per stage: ZeRO-1/2's all-gather after the optimizer
    dp_waits: Optional[list] = None  # per stage: (latencies the reduction, the all-gather wait)
    tied: Optional[list] = None  # per pipeline rank: (stage, bytes, holders) of each tied
    # gradient it sums with other pipeline ranks (estimates.tied_sums)
    optimizer_tensors: Optional[list] = None  # per pipeline rank: tensors its step walks
    norm_bytes: Optional[list] = None  # per pipeline rank: gradient bytes its norm reads
    norm_groups: Optional[list] = None  # ... and the groups of its norm's all-reduces

    def step_sync(self, device: DeviceModel,
                  every_step: bool = False) -> tuple[StepSync, float, list[float]]:
        """The trainer's own collectives on `device` (StepSync), with the ring steps of the
        loss all-reduce and of each stage's tied sums (what shared_floor charges)."""
        return step_sync(self.plan, self.tied or [[] for _ in range(self.plan.mesh.pp)],
                         len(self.stages), device, every_step, self.norm_groups)

    def costs(self, device: DeviceModel):
        """(per-stage op times, the schedule's action costs in seconds) on `device`."""
        ops = [op_times(self.plan, w, device.hardware) for w in self.work]
        return ops, action_costs(self.plan, self.stages, ops, self.tp_traffic,
                                 self.moe_traffic, device)

    def time_on(self, device: DeviceModel, sim=None, costs=None,
                every_step: bool = False) -> Prediction:
        """The predicted step on `device`: costs, one simulation of the schedule (or `sim`,
        already run with `costs`), the breakdown per rank. Under DiLoCo the data-parallel
        reduction is the outer sync, every H steps and after the step (H times fewer bytes
        per step, none hidden); `every_step`: as every-step DP would run instead."""
        from ...schedules.simulate import simulate
        ops, own = self.costs(device)
        if sim is None:
            costs = own
            sim = simulate(self.schedule, costs)
        hw = device.hardware
        dp_link = mesh_links(self.plan, device).dp
        waits = self.dp_waits or [(0, 0)] * len(self.dp_bytes)
        dp_s = [b / dp_link + w * device.ring_step_s for b, (w, _) in zip(self.dp_bytes, waits)]
        after = None
        if self.plan.sync.diloco and not every_step:  # amortised over its H inner steps
            after = [0.0] * self.plan.mesh.pp
            for st, b in zip(self.stages, self.dp_bytes):  # one all-reduce per fragment:
                after[st.rank] += b / dp_link / self.plan.sync.inner_steps  # bytes only
            dp_s = [0.0] * len(dp_s)
        pp = len(self.optimizer_bytes)
        opt_s = [step_end_s(self.plan, b, n, g, hw) for b, n, g in
                 zip(self.optimizer_bytes, self.optimizer_tensors or [0] * pp,
                     self.norm_bytes or [0.0] * pp)]
        gather_s = [device.ring_step_s * (self.plan.mesh.dp - 1) + b / dp_link if b else 0.0
                    for b in self.gather_bytes]
        for st, b, (_, w) in zip(self.stages, self.regather_bytes or (), waits):
            if b:
                after = after or [0.0] * self.plan.mesh.pp
                after[st.rank] += regather_s(b, w, dp_link, device.ring_step_s)
        outer = self.plan.sync.inner_steps if self.plan.sync.diloco and not every_step else 1
        once = [w / outer + r for w, r in waits]  # DiLoCo: one reduction per H steps
        gathers = [self.plan.mesh.dp - 1 if b else 0 for b in self.gather_bytes]
        sync, loss_steps, tied_steps = self.step_sync(device, every_step)
        once = [o + t for o, t in zip(once, tied_steps)]
        floor = shared_floor(self.schedule, costs, device, once, gathers, opt_s, loss_steps)
        step, ranks = breakdown(self.schedule, sim, ops, costs, dp_s, opt_s, gather_s, after,
                                floor, sync)
        return Prediction(step, ranks, self.flops_per_gpu, self.model_flops_per_gpu,
                          device.flops_per_s,
                          floor * device.shared_at[0].cores if device.shared_at else 0.0)


def step_sync(plan: Plan, tied: list, stages: int, device: DeviceModel,
              every_step: bool = False, norm_groups: Optional[list] = None
              ) -> tuple[StepSync, float, list[float]]:
    """The trainer's own collectives each step on `device` (StepSync) from `tied` (per
    pipeline rank: (stage, bytes, holders) of its tied sums, estimates.tied_sums), and their
    ring steps: the loss all-reduce's (a float64 over the island: the world, or under
    DiLoCo its pp x tp ranks) and per stage its tied sums'. Tied sums overlap the backward
    where the runtime starts them early: no ZeRO and no every-step DP reduction of them.
    `every_step`: as the plan would run with every-step DP instead of DiLoCo. Clipping,
    the norm's scalar all-reduces (`norm_groups`: per pipeline rank, norm_groups_of) then
    one over the pipeline, which every pipeline rank joins (StepSync.norm_s: the slowest
    rank's), their ring steps with the loss's."""
    mesh = plan.mesh
    links = mesh_links(plan, device)
    islands = plan.sync.diloco and not every_step
    island = mesh.pp * mesh.tp if islands else mesh.world_size
    loss_s = collective_s("allreduce", 8, island, links.p2p, device.ring_step_s)
    overlapped = plan.zero == 0 and (mesh.dp == 1 or islands)
    steps = [0.0] * stages
    per_rank = []
    for sums in tied:
        per_rank.append(tuple((s, collective_s("allreduce", n, k, links.p2p, device.ring_step_s),
                               overlapped) for s, n, k in sums))
        for s, _, k in sums:
            steps[s] += ring_steps("allreduce", k)
    norm, norm_steps = 0.0, 0
    if plan.train.grad_clip is not None:
        from .estimates import _size_of
        link = {"tp": links.tp, "ep": links.ep}
        for groups in norm_groups or [()]:
            if plan.zero == 0:  # global_norm adds a group's terms over all the rank's stages
                groups = sorted(set(groups))
            calls = [(_size_of(plan, g), link.get(g, links.dp)) for g in groups]
            norm = max(norm, sum(collective_s("allreduce", 8, n, link, device.ring_step_s)
                                 for n, link in calls))
            norm_steps = max(norm_steps, sum(ring_steps("allreduce", n) for n, _ in calls))
        if mesh.pp > 1:
            norm += collective_s("allreduce", 8, mesh.pp, links.p2p, device.ring_step_s)
            norm_steps += ring_steps("allreduce", mesh.pp)
    return (StepSync(loss_s, tuple(per_rank), norm),
            ring_steps("allreduce", island) + norm_steps, steps)


def predicted(compiled, device: Optional[DeviceModel] = None) -> Prediction:
    """The predicted step of a compiled plan (`compile_plan(plan)`) on `device` (default: the
    plan's own), re-timed from its stored Timing: no tracing, per-stage arithmetic and one
    simulation of its schedule. What a plan search calls per candidate device."""
    from .device import device_model
    if device is None:  # the plan's own, ranks sharing a CPU as busy as its timeline says
        device = device_model(compiled.plan).shared(compiled.estimates.simulation.concurrency)
    return compiled.estimates.timing.time_on(device)


def timing_of(plan: Plan, stages: list[StageSpec], schedule, work: list[StageWork],
              tp_traffic, moe_traffic, tp_kinds: dict[str, str], expert_params: set[str],
              estimates, gradless: frozenset = frozenset()) -> Timing:
    """A compiled plan's Timing: per stage the ring bytes of its DP reduction (the runtime's
    ZeRO layout, estimates.rank_shards; `gradless` parameters are never reduced nor stepped),
    per pipeline rank its optimizer's bytes and its tied gradients' sums (Estimates.tied)."""
    from .estimates import rank_shards, state_bytes
    per, dp_bytes, opt_bytes, gathers = state_bytes(plan), [], [0.0] * plan.mesh.pp, []
    regathers, waits, tensors = [], [], [0] * plan.mesh.pp
    norm_bytes, norm_groups = [0.0] * plan.mesh.pp, [()] * plan.mesh.pp
    dp = plan.mesh.dp
    for st in stages:
        layout = rank_shards(plan, [st], tp_kinds, expert_params, gradless)
        reduce, regather, *w = dp_ring_bytes(plan, layout)
        dp_bytes.append(reduce)
        regathers.append(regather)
        waits.append(tuple(w))
        n = sum(layout.numel.values())
        add_step_end(plan, layout, st.rank, (opt_bytes, tensors, norm_bytes, norm_groups))
        gathers.append(ring_bytes("allgather", n * per.param / dp, dp) if plan.zero == 3
                       else 0.0)
    world = plan.mesh.world_size
    flops = sum(r.flops for r in estimates.ranks) / world
    model = sum(3 * st.flops for st in stages) * plan.microbatches * plan.mesh.dp \
        * plan.mesh.cp / world
    return Timing(plan, stages, schedule, work, tp_traffic, moe_traffic, dp_bytes, opt_bytes,
                  gathers, flops, model, regathers, waits, estimates.tied, tensors,
                  norm_bytes, norm_groups)


def add_step_end(plan: Plan, layout, rank: int, into: tuple) -> None:
    """Add what a stage's shards (`layout`, estimates.rank_shards) give its pipeline rank's
    step end to `into` (per-rank lists): the optimizer's bytes read and written, the tensors
    it steps, the gradient bytes the clipped norm reads and its norm's all-reduce groups."""
    from .estimates import state_bytes
    per, dp = state_bytes(plan), plan.mesh.dp
    shard = dp if plan.zero in (1, 2, 3) else 1
    n = sum(layout.numel.values())
    opt, tensors, norm, groups = into
    opt[rank] += n * (2 * per.param + per.grad + 2 * per.optimizer / shard)
    tensors[rank] += optimizer_tensors(plan, layout)
    norm[rank] += n * per.grad / shard
    groups[rank] += norm_groups_of(plan, layout)


NORM_OPS = 4  # per gradient tensor the norm reads: its square, its sum, the float64 cast
# and the add into its group's total (backends/runtime/grads.py: GradSync.norm, global_norm;
# under ZeRO per flat shard, zero/sharding.py: grad_sq_norm)


def norm_groups_of(plan: Plan, layout) -> tuple:
    """The groups of the scalar all-reduces a stage's parameters (`layout`,
    estimates.rank_shards) add to the clipped gradient norm (backends/runtime/grads.py):
    without ZeRO one per group sharding some of them (tp for tensor-parallel slices, ep
    for experts; global_norm sums a group's terms first); under ZeRO each flat shard's own
    reduce group (dp, or expert-dp) and the ranks holding its kind's other parts (tp, ep)."""
    from ..parallel.zero import EXPERT, TENSOR_PARALLEL
    from .estimates import _size_of
    mesh = plan.mesh
    spread = {TENSOR_PARALLEL: "tp" if mesh.tp > 1 else None,
              EXPERT: "ep" if mesh.ep > 1 else None}
    if plan.zero == 0:
        kinds = {kind for _, params in layout.listed for _, kind in params}
        return tuple(sorted(g for g in (spread.get(k) for k in kinds) if g))
    out = []
    for shard in layout.shards:
        reduce = "edp" if shard.kind == EXPERT else "dp"
        out += [g for g in (reduce if _size_of(plan, reduce) > 1 else None,
                            spread.get(shard.kind)) if g]
    return tuple(out)


def step_end_s(plan: Plan, opt_bytes: float, tensors: int, norm_bytes: float, hw) -> float:
    """A pipeline rank's own work after its gradient sync (add_step_end's numbers): the
    optimizer step and, clipping, its share of the norm."""
    return optimizer_s(plan, opt_bytes, tensors, hw) + norm_s(plan, norm_bytes, tensors, hw)


def norm_s(plan: Plan, nbytes: float, tensors: int, hw) -> float:
    """A pipeline rank's share of the clipped gradient norm on its own: its gradients read
    once at the sustained memory bandwidth, NORM_OPS per tensor on a host that pays per op;
    0 when the plan does not clip."""
    if plan.train.grad_clip is None:
        return 0.0
    bw = hw.memory_bandwidth * hw.efficiency.memory
    return (nbytes / bw if bw > 0 else 0.0) + tensors * NORM_OPS * hw.op_s


def optimizer_tensors(plan: Plan, layout) -> int:
    """Tensors the optimizer steps for a stage's shards (`layout`, estimates.rank_shards):
    each parameter without ZeRO, each flat shard under it (backends/parallel/zero)."""
    return len(layout.numel) if plan.zero == 0 else len(layout.shards)


def optimizer_s(plan: Plan, nbytes: float, tensors: int, hw) -> float:
    """A pipeline rank's optimizer step: the bytes it reads and writes (timing_of) at the
    sustained memory bandwidth, and on a host that pays per op (the measured CPU's op_s;
    0 on accelerators) optime.optimizer_ops: a step's own and each tensor's it steps."""
    bw = hw.memory_bandwidth * hw.efficiency.memory
    fixed, per = optimizer_ops(plan.train.optimizer, hw)
    ops = fixed + per * tensors if tensors else 0
    return (nbytes / bw if bw > 0 else 0.0) + ops * hw.op_s


def dp_ring_bytes(plan: Plan, layout) -> tuple[float, float, int, int]:
    """(ring bytes one rank sends reducing a stage's gradients over its data-parallel
    groups, ring bytes of ZeRO-1/2's all-gather of the updated shards, and the message
    latencies each waits: its calls' ring steps, `ring_steps`) for the stage's shards
    `layout` (estimates.rank_shards; the calls: ZeRO 0's buckets, one per flat shard
    under ZeRO). The runtime (backends/parallel/zero/sharding.py: after_step) runs that
    all-gather after the optimizer step, blocking: it overlaps nothing, unlike the
    reduction, which the backward hides (`exposed_reduction`). Under DiLoCo both are the
    outer sync's (its own rule)."""
    from .estimates import _size_of, _state_bytes
    est = _state_bytes(plan, layout, ())
    total = est.comm_bytes.get("dp", 0)
    steps = [(op == "allgather", c * ring_steps(op, _size_of(plan, group)))
             for (group, op), c in est.collective_calls.items()]
    reduce_waits = sum(n for gather, n in steps if not gather)
    if plan.zero not in (1, 2) or plan.mesh.islands:
        return total, 0.0, reduce_waits, 0
    after = sum(ring_bytes(op, n, _size_of(plan, group))
                for (group, op), n in est.collectives.items() if op == "allgather")
    return total - after, after, reduce_waits, sum(n for gather, n in steps if gather)


def regather_s(nbytes: float, waits: int, link: float, latency: float) -> float:
    """Seconds of ZeRO-1/2's all-gather after the optimizer step (`dp_ring_bytes`): a
    latency per ring step of its calls and its ring bytes over the dp link."""
    return latency * waits + nbytes / link if nbytes else 0.0


def _nbytes(spec) -> int:
    import torch
    n = 1
    for d in spec.shape:
        n *= d
    return n * torch.empty((), dtype=getattr(torch, spec.dtype)).element_size()
