"""The one question the search asks: a candidate -> its predicted step time and peak memory.

`predict(units, cand, device)` is the narrow interface; everything else in planner/ only
ranks its answers. It is the compiler's time model (compiler/estimate/predict.py,
optime.py; docs/compiler.md "The time model") computed from unit sums instead of a new
trace: each stage's ops are the sum of its units' grouped ops (optime.StageWork), timed by
`op_times` on the device profile; the TP collectives inside its actions, EP and CP bytes
exposed as `action_costs` places them; the schedule generated on the normalised costs and
simulated on the real ones; then `predict.breakdown`: each stage's DP reduction overlapped
from its last W (`exposed_reduction`), the optimizer's memory-bound pass per rank. Memory:
activation peaks by walking the schedule (`held_peaks`), state bytes by ZeRO stage
(`_state_bytes`).

`lower_bound(units, cand, device)` is no longer than any schedule of the candidate can be:
per rank, the fill before its first stage gets a microbatch, then its work, or its forward
and input-gradient work followed by the drain of its last backward through the stages
before it (W may overlap the drain); the worst rank (the DP reduction may overlap, the
optimizer is not counted: both only lengthen the step). Its bytes are exact for the fixed
kinds (their orders never depend on costs: the activation peaks walk the order itself) and
one microbatch in flight for `auto`.
"""
from __future__ import annotations

import bisect
import dataclasses
import itertools
import struct
from dataclasses import dataclass
from typing import Optional

import numpy as np

from ..compiler.estimate.collectives import _role_collectives, ring_bytes
from ..compiler.estimate.device import SHARING_ROUNDS, DeviceModel, mesh_links
from ..compiler.estimate.estimates import RankShards, _state_bytes, normalised, \
    routing_prepass_s, state_bytes
from ..compiler.estimate.optime import StageWork, host_around, op_times
from ..compiler.estimate.predict import _posts, breakdown, dp_ring_bytes, exchange_waits, \
    add_step_end, in_w_without_input_grads, passes, regather_s, resumed, shared_floor, \
    split_of, step_end_s, step_sync, tp_passes, waiting_of
from ..compiler.parallel.zero import EXPERT, TENSOR_PARALLEL, group_shards
from ..dsl.layout import ep_across_tp
from ..schedules import generate
from ..schedules.bound import makespan_bound
from ..schedules.generate import unverified
from ..schedules.verify import verify
from ..schedules.costs import Costs
from ..schedules.memory import held_peaks, held_states, peaks_of
from ..schedules.simulate import simulate
from .space import Candidate, on_recompute_rank, placement, plan_of
from .units import Unit, Units

UNSPLIT_BACKWARD = ("gpipe", "1f1b", "interleaved")  # their backward is one BW op


@dataclass(frozen=True)
class Prediction:
    """What `pipeplan plan` prints per candidate (seconds, bytes, FLOPs per step)."""

    step_time_s: float
    makespan_s: float  # the simulated pipeline
    dp_time_s: float  # after the pipeline: the DP reduction's exposed tail + the optimizer
    comm_s: float  # the busiest rank's exposed communication (predict.RankTime.comm)
    bubble: float  # idle / total over the whole iteration (simulate's definition)
    peak_bytes: int  # the fullest rank: params + grads + optimizer + activations
    state_bytes: int  # ... of which parameters, gradients and optimizer states
    flops_per_gpu: float  # executed FLOPs per step per GPU, recompute included
    model_flops_per_gpu: float  # without recompute (for MFU)
    split: tuple[int, ...]  # unit index where stages 1..S-1 begin
    placement: tuple[int, ...]  # stage -> pipeline rank


def _table(units: Units, c: Candidate) -> list[Unit]:
    return units.at(c.mbs, c.tp > 1, c.sp, c.recompute, c.cp)


def _work(units: list[Unit]) -> StageWork:
    """The grouped ops of a run of units (optime.StageWork.add's sums)."""
    out = StageWork(input_grads=units[0].work.input_grads if units else True)
    for u in units:
        for key, n in u.work.gemms.items():
            out.gemms[key] = out.gemms.get(key, 0.0) + n
        for key, (e, o, k) in u.work.memory.items():
            m = out.memory.setdefault(key, [0.0, 0.0, 0])
            m[0] += e
            m[1] += o
            m[2] += k
        out.ops += u.work.ops
        out.recompute_ops += u.work.recompute_ops
        out.seeds += u.work.seeds
    return out


def _stage_times(units: Units, c: Candidate, plan, device: DeviceModel, links,
                 run: list[Unit]):
    """(OpTimes, (F, B, W) seconds, of which waiting on other ranks) of a run of units as
    one stage: action_costs's rule
    (cached by what the units hold, not where they are: a 80-layer stack's middle stages of
    equal length are timed once)."""
    key = ("stage times", tuple(_content(units, u) for u in run), c.tp, c.sp, c.ep,
           c.dp if plan.experts else 0, links.tp, links.ep, device_key(units, device))
    if key not in units.cache:
        units.cache[key] = _stage_times_of(c, plan, device, links, run)
    return units.cache[key]


def _content(units: Units, u: Unit) -> int:
    """One number per distinct unit content, the block's name and parameters' identities
    left out (what a stage's time reads of its parameters is how many there are)."""
    ids = units.cache.setdefault("unit ids", {})
    if id(u) not in ids:
        w = u.work
        key = (u.flops, u.recompute_flops, u.ops, u.recompute_ops, u.out_bytes, u.cp_bytes,
               u.cp_steps, u.ep_roles, u.tp_traffic, u.tp_inner, u.tp_rerun, u.tp_rerun_inner,
               u.ep_tokens, u.ep_weights,
               len(u.params),
               tuple(w.gemms.items()),
               tuple((k, tuple(v)) for k, v in w.memory.items()), w.ops, w.recompute_ops,
               w.seeds, w.input_grads)
        contents = units.cache.setdefault("unit contents", {})
        ids[id(u)] = (u, contents.setdefault(key, len(contents)))  # u kept: its id stays
    return ids[id(u)][1]


def _stage_times_of(c: Candidate, plan, device: DeviceModel, links, run: list[Unit]):
    t = op_times(plan, _work(run), device.hardware)
    fs = 0.5 if plan.train.precision == "bf16" else 1.0
    inner = _inner(run, c.sp)
    calls = [call for u, i in zip(run, inner)
             for role, nbytes in (u.tp_inner if i else u.tp_traffic)
             for call in _role_collectives(role, nbytes, c.tp, c.sp)] if c.tp > 1 else []
    tp_f, tp_b = tp_passes(calls, c.tp, links.tp, device.ring_step_s)
    ep_b = sum(_ep_bytes(plan, u, c) for u in run) if c.ep > 1 and plan.experts else 0.0
    other = ep_b / links.ep + sum(u.cp_bytes for u in run) * fs / links.tp
    wait_f, wait_b = exchange_waits(plan, c.ep, [r for u in run for r in u.ep_roles],
                                    (sum(u.cp_steps[0] for u in run),
                                     sum(u.cp_steps[1] for u in run)), device.ring_step_s)
    rerun = [call for u, i in zip(run, inner)
             for role, nbytes in (u.tp_rerun_inner if i else u.tp_rerun)
             for call in _role_collectives(role, nbytes, c.tp, c.sp)] if c.tp > 1 else []
    again = tp_passes(rerun, c.tp, links.tp, device.ring_step_s)[0]
    # wrapped tensors: the units' trainable parameters, the values they make (masks) and the
    # stage's input (buffers are not in the units: on the measured CPU the planner's stage
    # is a little cheaper here)
    host_f, host_b = host_around(plan, device.hardware,
                                 sum(len(u.params) + u.made for u in run) + 1, passes(calls),
                                 sum(u.ep_roles.count("tokens") for u in run), c.ep)
    row, waiting = in_w_without_input_grads(
        run[0].work.input_grads,
        (t.f + tp_f + other / 2 + wait_f + host_f, t.b + tp_b + other / 2 + again + wait_b
         + host_b, t.w), waiting_of(calls, c.tp, (tp_f, tp_b), (wait_f, wait_b), again, device,
                                    rerun))
    return t, row, waiting


def _inner(run: list[Unit], sp: bool) -> list[bool]:
    """Per unit of a stage: read its "inner" numbers (units.Unit.tp_inner, activation_inner)?
    The first unit's inputs cross a stage edge (whole); a later one's come from its stage, as
    sequence shards under sequence parallel once a unit before it all-reduced (reduce-
    scattered) an output: a row layer or a split embedding (the "output" traffic role)."""
    out, seeded = [], False
    for i, u in enumerate(run):
        out.append(i > 0 and (seeded or not sp))
        seeded = seeded or any(role == "output" for role, _ in u.tp_traffic)
    return out


def _ep_bytes(plan, u: Unit, c: Candidate) -> float:
    """A unit's EP all-to-all bytes per microbatch (collectives.ep_bytes)."""
    ex = plan.experts
    fs = 0.5 if plan.train.precision == "bf16" else 1.0
    share = c.tp if ep_across_tp(plan.mesh) else 1  # EP across TP: 1/tp of the rows each
    return (4 * ex.top_k * u.ep_tokens + 2 * u.ep_weights) * fs * (c.ep - 1) / c.ep / share


def _balanced_split(units: Units, weights: list[float], stages: int) -> tuple[int, ...]:
    key = ("split", tuple(weights), stages)
    if key not in units.cache:
        units.cache[key] = balanced_split(weights, stages)
    return units.cache[key]


def balanced_split(weights: list[float], stages: int) -> tuple[int, ...]:
    """Unit indices where stages 1..S-1 begin, minimising the heaviest stage: the greedy cut
    (`_cuts`) at the least float bottleneck it meets (deterministic).

    That least bottleneck is found without bisecting the whole range [max(weights),
    sum(weights)] (some 53 greedy passes): feasibility changes only where a run of units'
    sum crosses the limit, so the search first brackets it between two adjacent sums of
    contiguous runs (prefix differences at or above the mean stage, galloped then
    bisected), then bisects the floats between those two -- near either end when rounding
    moved it off a run's sum (64 floats), else all of them. Monotone feasibility (a higher
    limit never cuts sooner) makes every step exact: the same float as a bisection of the
    whole range run until it cannot move, in 10-20 passes."""
    n = len(weights)
    if stages <= 1:
        return ()
    prefix = list(itertools.accumulate(weights, initial=0.0))
    least, total = max(weights), prefix[n]
    runs = np.subtract.outer(np.array(prefix), np.array(prefix)).ravel()
    floor = max(least, total / stages * (1 - 1e-9))  # no limit under the mean stage fits
    sums = np.unique(runs[(runs > floor) & (runs < total)])
    below, above, i, step = -1, len(sums), 0, 1  # sums[below] is too low, sums[above] fits
    while i < len(sums):
        if _cuts(prefix, stages, float(sums[i])) is not None:
            above = i
            break
        below, i, step = i, i + step, step * 2
    while above - below > 1:
        mid = (below + above) // 2
        if _cuts(prefix, stages, float(sums[mid])) is None:
            below = mid
        else:
            above = mid
    # the floats as integers (same order for non-negative floats): lo too low, hi fits
    lo = _bits(float(sums[below]) if below >= 0 else least)
    hi = _bits(float(sums[above]) if above < len(sums) else total)
    if hi - lo > 128:
        if _cuts(prefix, stages, _float(lo + 64)) is not None:
            hi = lo + 64
        elif _cuts(prefix, stages, _float(hi - 64)) is None:
            lo = hi - 64
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _cuts(prefix, stages, _float(mid)) is None:
            lo = mid
        else:
            hi = mid
    limit = _float(hi)
    return tuple(_cuts(prefix, stages, limit * (1 + 1e-12))
                 or _cuts(prefix, stages, limit * (1 + 1e-9)))


def _cuts(prefix: list[float], stages: int, limit: float) -> Optional[list[int]]:
    """Greedy: each stage takes units while they fit under `limit`, leaving one for every
    later stage (prefix sums, one bisection per stage); None where it does not fit."""
    n = len(prefix) - 1
    out, start = [], 0
    for left in range(stages - 1, 0, -1):  # cuts still to make
        fit = bisect.bisect_right(prefix, prefix[start] + limit, start + 1) - 1
        cut = min(fit, n - left)  # every later stage needs a unit
        if cut <= start:
            return None  # unit `start` alone is over the limit
        out.append(cut)
        start = cut
    return out if prefix[n] - prefix[start] <= limit else None


def _bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]


def _float(i: int) -> float:
    return struct.unpack("<d", struct.pack("<q", i))[0]


@dataclass(frozen=True)
class Shape:
    """A candidate's stages before any schedule: op times, split, activations per stage."""

    ops: tuple  # optime.OpTimes per stage (compute alone)
    per_stage: tuple  # (F, B, W) seconds, collectives included (action_costs)
    waiting: tuple  # of those, the seconds waiting on other ranks (Costs.waiting)
    latency: float
    split: tuple[int, ...]
    act: tuple[float, ...]  # activation bytes per microbatch per stage (what the walk adds)
    links: object
    table: tuple = ()  # the units, each as its stage runs it (recompute on its rank or not)

    def costs(self) -> Costs:
        """Its schedules.Costs (a separate W's host calls from the OpTimes: Costs.split)."""
        return Costs(per_stage=self.per_stage, latency=self.latency, waiting=self.waiting,
                     split=split_of(self.ops))


def shape(units: Units, c: Candidate, device: DeviceModel) -> Shape:
    """The candidate's stages (cached: the schedule kind and ZeRO stage do not change them)."""
    key = ("shape", c.pp, c.dp, c.tp, c.cp, c.ep, c.virtual, c.mbs, c.sp, c.recompute,
           device_key(units, device)) + ((c.rc_ranks, placement(c.schedule, c.pp, c.pp * c.virtual))
                          if c.rc_ranks else ())
    if key not in units.cache:
        units.cache[key] = _shape(units, c, device)
    return units.cache[key]


def _shape(units: Units, c: Candidate, device: DeviceModel) -> Shape:
    plan = plan_of(units.plan, dataclasses.replace(c, rc_ranks=0), units.blocks)
    links = _links(plan, device)
    table = _table(units, c)
    stages = c.pp * c.virtual
    weights = _unit_weights(units, c, plan, device, links, table)
    split = _balanced_split(units, weights, stages)
    if c.rc_ranks:  # recompute on the first ranks' stages only: their units from the
        # recompute table, the others' from `none`; the split balanced on those (twice:
        # the split moves units between ranks)
        plain = dataclasses.replace(c, recompute="none", rc_ranks=0)
        plain_table = _table(units, plain)
        light = _unit_weights(units, plain, plan, device, links, plain_table)
        for _ in range(2):
            on = on_recompute_rank(c, len(table), split)
            split = _balanced_split(units, [w if o else x for w, x, o in
                                            zip(weights, light, on)], stages)
        on = on_recompute_rank(c, len(table), split)
        table = [u if o else x for u, x, o in zip(table, plain_table, on)]
    bounds = (0,) + split + (len(table),)
    post = device.hardware.post_s if device.hardware else 0.0  # the measured CPU's
    timed = [_stage_times(units, c, plan, device, links, table[a:b])
             for a, b in zip(bounds, bounds[1:])]
    for s, ((t, (f, b, w), waits), a) in enumerate(zip(timed, bounds)):
        # each transfer's posting and each action's resume, as predict.action_costs charges
        posts = _posts(s, stages) * post
        row, t = resumed(device, table[a].work.input_grads, (f + posts, b + posts, w), t)
        timed[s] = (t, row, waits)
    tp = c.tp if c.tp > 1 else 1
    act = tuple(sum(dict(u.activation_inner if i else u.activation_bytes)[tp]
                    for u, i in zip(table[a:b], _inner(table[a:b], c.sp and c.tp > 1)))
                for a, b in zip(bounds, bounds[1:]))
    msg = [table[b - 1].out_bytes for b in bounds[1:-1]]
    latency = device.latency_s + max(msg, default=0.0) / links.p2p
    return Shape(tuple(t for t, _, _ in timed), tuple(x for _, x, _ in timed),
                 tuple(w for _, _, w in timed), latency, split, act, links, tuple(table))


def _unit_weights(units: Units, c: Candidate, plan, device: DeviceModel, links,
                  table: list[Unit]) -> list[float]:
    """Each unit's F + B + W seconds as a stage of its own (what the split balances),
    cached per table and what those seconds read of the mesh: tp, ep, the TP and EP links."""
    key = ("weights", id(table), c.tp, c.ep, c.sp, c.dp if plan.experts else 0, links.tp,
           links.ep, device_key(units, device))
    if key not in units.cache:
        units.cache[key] = [sum(_stage_times(units, c, plan, device, links, [u])[1])
                            for u in table]
    return units.cache[key]


def _links(plan, device: DeviceModel):
    m = plan.mesh
    return _links_cached((m.pp, m.dp, m.tp, m.ep, m.cp, m.islands), plan, device)


_LINKS: dict = {}


def _links_cached(key, plan, device):
    k = key + (id(device),)
    hit = _LINKS.get(k)
    if hit is None or hit[0] is not device:  # the device held beside its links: an id
        hit = _LINKS[k] = (device, mesh_links(plan, device))  # freed and reused misses
    return hit[1]


def device_key(units: Units, device: DeviceModel) -> int:
    """`device`'s part of a units.cache key: its id, the device itself kept in the cache so
    no later device is ever given that id while the entries live (predict makes a shared
    device per candidate on the measured CPU: freed, its id went to the next one, whose
    prediction then read the first one's cached stage times)."""
    units.cache.setdefault(("device", id(device)), device)
    return id(device)


def state(units: Units, c: Candidate, split: tuple[int, ...], stage_rank: tuple[int, ...],
          actions: Optional[list] = None) -> list:
    """RankEstimate (params, grads, optimizer, dp bytes) per pipeline rank (_state_bytes on
    the rank's flat shards as the runtime lays them). `actions`: per rank, the stage of each
    of its actions in order (ZeRO-3 gathers); None: one action per stage."""
    plan = plan_of(units.plan, c, units.blocks)
    layouts = _layouts(units, c, split, stage_rank)
    return [_state_bytes(plan, lay, actions[r] if actions is not None else tuple(lay.uses))
            for r, lay in enumerate(layouts)]


def _layouts(units: Units, c: Candidate, split: tuple[int, ...], stage_rank) -> list:
    """Each pipeline rank's RankShards (cached: the same for every ZeRO stage and kind)."""
    key = ("layout", c.pp, c.tp, c.ep, c.cp, split, stage_rank)  # parameters: no batch, no rewrite
    if key in units.cache:
        return units.cache[key]
    table = _table(units, c)
    bounds = (0,) + split + (len(table),)
    out = []
    for r in range(c.pp):
        listed, numel = [], {}
        for s, (a, b) in enumerate(zip(bounds, bounds[1:])):
            if stage_rank[s] != r:
                continue
            params = []
            for u in table[a:b]:
                for k, kind, n in u.params:
                    numel[k] = n // c.tp if kind == TENSOR_PARALLEL else \
                        n // c.ep if kind == EXPERT else n
                    params.append((k, kind))
            listed.append((s, params))
        shards, uses = group_shards(listed)
        out.append(RankShards(shards, uses, numel, tuple(listed)))
    units.cache[key] = out
    return out


def quick_bound(units: Units, c: Candidate, device: DeviceModel) -> float:
    """No schedule of `c` is faster, from its compute alone (no split, no schedule, no new
    capture; never above lower_bound's time): the busiest pipeline rank does at least the
    mean of the pipeline's work, m x (the units' F + B + W, communication left out) / pp.
    Every op is timed on its own (optime.op_times sums them), so the units' times add up
    to their stages'. Recompute on some ranks only: the table without it (less work). A cp
    value not captured yet: its cp = 1 table divided by cp (a sequence shard's ops take no
    less than their share of the whole sequence's: op time grows no faster than the op)."""
    rc = "none" if c.rc_ranks else c.recompute
    cp = c.cp if units.has(c.mbs, c.tp > 1, c.sp, rc, c.cp) else 1
    key = ("quick", c.mbs, c.tp, c.sp, rc, cp, device_key(units, device))
    if key not in units.cache:
        plan = plan_of(units.plan, dataclasses.replace(c, recompute=rc, rc_ranks=0),
                       units.blocks)
        t = op_times(plan, _work(units.at(c.mbs, c.tp > 1, c.sp, rc, cp)), device.hardware)
        units.cache[key] = t.f + t.b + t.w
    return c.microbatches * units.cache[key] / (c.pp * (c.cp // cp))


def quick_held(units: Units, c: Candidate) -> float:
    """No rank of `c` holds fewer state bytes (parameters, gradients, optimizer states) than
    this, with no split, no schedule and no new capture: the whole model's state on one
    rank at c's dp, tp, ep and ZeRO stage, over pp (the fullest rank holds at least the
    mean; a split only adds: each rank pads its own shards, a tied weight is on two)."""
    key = ("quick held", c.dp, c.tp, c.cp, c.ep, c.zero)
    if key not in units.cache:
        one = dataclasses.replace(c, pp=1, virtual=1, rc_ranks=0)
        lay = _layouts(units, dataclasses.replace(one, cp=1, mbs=1, sp=False,
                                                  recompute="none"), (), (0,))[0]
        rk = _state_bytes(plan_of(units.plan, one, units.blocks), lay, tuple(lay.uses))
        units.cache[key] = rk.param_bytes + rk.grad_bytes + rk.optimizer_bytes
    return units.cache[key] / c.pp


def lower_bound(units: Units, c: Candidate, device: DeviceModel) -> tuple[float, int]:
    """(no schedule of `c` is faster, no rank of `c` holds fewer bytes than the fullest)."""
    return time_bound(units, c, device), max(held_bytes(units, c, device))


def time_bound(units: Units, c: Candidate, device: DeviceModel) -> float:
    """No schedule of `c` is faster (lower_bound's time: the search asks it first, and the
    bytes, a walk of the order, only of candidates still under the K-th best)."""
    sh = shape(units, c, device)
    unsplit = c.schedule in UNSPLIT_BACKWARD
    return min(max(_pipe_bound(units, c, sh, place, unsplit)[0],
                   _limited_bound(units, c, sh, place))
               for place in _places(c, len(sh.per_stage)))


def _places(c: Candidate, stages: int) -> list:
    """The placements a candidate's schedule may take: its kind's, and for `auto` with two
    stages a rank the V too (auto chooses at generation)."""
    out = [placement(c.schedule, c.pp, stages)]
    if c.schedule == "auto" and c.virtual == 2:
        out.append(placement("zbv", c.pp, stages))
    return out


def _limited_bound(units: Units, c: Candidate, sh: Shape, place) -> float:
    """Under a memory limit (auto's: cost.auto_memory_limit), the schedule engine's bound on
    every order of this placement holding no more (schedules/bound.py: a rank that may
    hold only k microbatches idles until their backwards come back); 0 without one."""
    if not c.memory_limit:
        return 0.0
    key = ("limited bound", id(sh), place, c.microbatches, c.memory_limit)
    if key not in units.cache:
        table = sh.costs().stage_table(place)
        units.cache[key] = makespan_bound(place, c.microbatches, table,
                                          float(c.memory_limit))
    return units.cache[key]


def held_bytes(units: Units, c: Candidate, device: DeviceModel,
               floor: bool = False) -> tuple[int, ...]:
    """Per pipeline rank, no fewer bytes than it holds at its peak: parameters, gradients and
    optimizer states, and activations -- exact for a fixed kind (its order does not depend
    on costs: the peaks walk the order itself), one microbatch in flight for `auto` (it
    may order microbatches any way) and with `floor` (any order holds that much: read
    without building a fixed kind's order)."""
    sh = shape(units, c, device)
    place = placement(c.schedule, c.pp, len(sh.per_stage))
    fixed = c.schedule != "auto" and not floor
    key = ("held", id(sh), place, c.zero) + ((c.schedule, c.microbatches) if fixed else ())
    if key not in units.cache:
        ranks = _held_state(units, c, sh.split, place)
        # the activations: the same for every ZeRO stage and mesh giving these bytes
        akey = ("held acts", sh.act, place, c.pp, c.virtual) + key[4:]
        if akey not in units.cache:
            units.cache[akey] = peaks_of(_held_states(units, c), sh.act) if fixed else \
                _rank_max(sh.act, place, c.pp)
        acts = units.cache[akey]
        units.cache[key] = tuple(int(rk.param_bytes + rk.grad_bytes + rk.optimizer_bytes + a)
                                 for rk, a in zip(ranks, acts))
    return units.cache[key]


def _held_state(units: Units, c: Candidate, split: tuple, place: tuple) -> list:
    """Each rank's states (cached: the same for every kind, m, microbatch size and rewrite
    of a split)."""
    key = ("held state", c.pp, c.dp, c.tp, c.cp, c.ep, split, place, c.zero)
    if key not in units.cache:
        units.cache[key] = state(units, c, split, place)
    return units.cache[key]


def _held_states(units: Units, c: Candidate) -> tuple:
    """A fixed kind's order walked once for its activation peaks (schedules/memory.py):
    here, or in a forked child ahead of need (units.ahead: search._orders_ahead)."""
    key = held_states_key(c)
    if key not in units.cache:
        got = units.ahead(key) if units.ahead is not None else None
        units.cache[key] = got if got is not None else \
            held_states(order(units, c, verified=False))
    return units.cache[key]


def held_states_key(c: Candidate) -> tuple:
    """What a fixed kind's held states depend on: its order's kind, pp, m and v."""
    return ("held states", c.schedule, c.pp, c.microbatches, c.virtual)


def order_held_states(key: tuple) -> tuple:
    """held_states_key's value, computed from the key alone (in a child, search.py)."""
    _, kind, pp, m, v = key
    return held_states(unverified(kind, pp, m, v))


def order(units: Units, c: Candidate, verified: bool = True):
    """A fixed kind's order (schedules/generate.py; cached: it depends on the kind, pp,
    microbatches and virtual stages only, never on costs); verified unless only what it
    holds is read (the memory bound), and then verified once when a prediction needs it."""
    key = ("order", c.schedule, c.pp, c.microbatches, c.virtual)
    if key not in units.cache:
        units.cache[key] = unverified(c.schedule, c.pp, c.microbatches, c.virtual)
    if verified and ("verified",) + key not in units.cache:
        verify(units.cache[key])
        units.cache[("verified",) + key] = True
    return units.cache[key]


def _rank_max(values, place, pp: int) -> list:
    out = [0.0] * pp
    for s, r in enumerate(place):
        out[r] = max(out[r], values[s])
    return out


def step_bound(units: Units, c: Candidate, device: DeviceModel) -> float:
    """A tighter bound than lower_bound's time (it adds what follows the pipeline), dearer
    to compute: the search asks it only of candidates it is about to evaluate."""
    sh = shape(units, c, device)
    unsplit = c.schedule in UNSPLIT_BACKWARD
    return min(_step_bound(units, c, sh, place, unsplit, device)
               for place in _places(c, len(sh.per_stage)))


def _step_bound(units: Units, c: Candidate, sh: Shape, place, unsplit: bool,
                device: DeviceModel) -> float:
    """No step of `c` on this placement is shorter: predict.breakdown's step is the max over
    ranks of (its last action's end + its exposed DP reduction + its optimizer pass). A
    rank's last action is a W (or BW) of one of its stages, whose reduction starts there, so
    at least the shortest of its stages' reductions is exposed: step >= each rank's own end
    bound + its tail, and >= the pipeline's bound + the smallest tail."""
    worst, own = _pipe_bound(units, c, sh, place, unsplit)
    worst = max(worst, _limited_bound(units, c, sh, place))
    key = ("tail", id(sh), place, c.zero)
    if key not in units.cache:
        plan = plan_of(units.plan, c, units.blocks, sh.split)
        dp_s, opt_s, _, after, *_ = _reduction_and_optimizer(units, c, plan, sh, place,
                                                             device)
        least = [min((d for s, d in enumerate(dp_s) if place[s] == r), default=0.0)
                 for r in range(c.pp)]
        units.cache[key] = [o + d + a for o, d, a in zip(opt_s, least, after)]
    tail = units.cache[key]
    return max(max(o + t for o, t in zip(own, tail)), worst + min(tail))


def _pipe_bound(units: Units, c: Candidate, sh: Shape, place, unsplit: bool) -> tuple:
    """The pipeline's part of the bound (cached per shape, placement and backward kind).
    Rank r cannot start before the first microbatch's forward reaches its first stage s0
    (the fill); its last B is on s0 (backward flows down), and the B chain of that
    microbatch through the stages before s0 (the drain) follows it, while its W may
    overlap the drain: max over r of fill + max(m x work, m x (F + B) + drain); with an
    unsplit backward (one BW op) W is part of B. Also each rank's own bound (fill + m x
    work): its last action ends no sooner."""
    key = ("pipe", id(sh), place, unsplit, c.microbatches)
    if key in units.cache:
        return units.cache[key]
    work, fb, first = [0.0] * c.pp, [0.0] * c.pp, [None] * c.pp
    for s, r in enumerate(place):
        f, b, w = sh.per_stage[s]
        work[r] += f + b + w
        fb[r] += f + b + (w if unsplit else 0.0)
        if first[r] is None or s < first[r]:
            first[r] = s
    fill, drain, f_acc, b_acc = [], [], 0.0, 0.0
    for s in range(len(sh.per_stage)):  # prefix sums over the stages before s
        fill.append(f_acc)
        drain.append(b_acc)
        f, b, w = sh.per_stage[s]
        hop = sh.latency if s + 1 < len(place) and place[s + 1] != place[s] else 0.0
        f_acc += f + hop  # a message between ranks only (same-rank stages hand over in memory)
        b_acc += b + (w if unsplit else 0.0) + hop
    m = c.microbatches
    worst = max(fill[first[r]] + max(m * work[r], m * fb[r] + drain[first[r]])
                for r in range(c.pp))
    units.cache[key] = worst, [fill[first[r]] + m * work[r] for r in range(c.pp)]
    return units.cache[key]


def _auto_order(units: Units, c: Candidate, sh: Shape, costs: Costs):
    """`auto`'s order for these stages' costs under the candidate's memory limit (its search
    reads the pipeline, the per-stage costs and the limit only: candidates that differ in
    ZeRO stage, or in a data-parallel size their stage costs do not see, share one search)."""
    key = ("auto order", c.pp, c.microbatches, c.virtual, sh.per_stage, sh.latency,
           costs.split, c.memory_limit)
    if key not in units.cache:
        units.cache[key] = generate("auto", ranks=c.pp, microbatches=c.microbatches,
                                    virtual=c.virtual, costs=normalised(costs),
                                    memory_limit=float(c.memory_limit) or None)
    return units.cache[key]


def auto_memory_limit(units: Units, c: Candidate, device: DeviceModel,
                      capacity: float) -> int:
    """For an `auto` candidate: how many microbatches' activations (the schedule engine's
    unit: a microbatch through all of a rank's stages) each rank may hold beside its
    parameters, gradients and optimizer states within `capacity` -- the plan's
    `pipeline.memory_limit` that makes auto search only orders that fit, where with no
    limit it takes the fastest, holding as many microbatches as that needs. Taken over
    both placements auto may choose (loop, and V with two stages a rank): the most state
    bytes on a rank and the most activation bytes a rank's unit holds. 0: not one fits."""
    sh = shape(units, c, device)
    held, unit = 0.0, 0.0
    for place in _places(c, len(sh.per_stage)):
        held = max(held, max(rk.param_bytes + rk.grad_bytes + rk.optimizer_bytes
                             for rk in _held_state(units, c, sh.split, place)))
        per_rank = [0.0] * c.pp
        for s, r in enumerate(place):
            per_rank[r] += sh.act[s]
        unit = max(unit, max(per_rank))
    if unit <= 0:
        return c.microbatches
    return max(0, min(c.microbatches, int((capacity - held) // unit)))


def predict(units: Units, c: Candidate, device: DeviceModel) -> Prediction:
    """The compiler's estimate of candidate `c` (what `pipeplan check` prints for its plan)."""
    sh = shape(units, c, device)
    costs = sh.costs()
    sched = order(units, c) if c.schedule != "auto" else _auto_order(units, c, sh, costs)
    sim = simulate(sched, costs)
    if device.sharing is not None:  # ranks sharing a CPU: as busy as the timeline keeps them,
        # in as many copies of the pipeline as the candidate has (check's device_model)
        alone = device
        for _ in range(SHARING_ROUNDS):
            device = _shared(units, alone, c.dp * c.cp * c.tp, sim.concurrency)
            sh = shape(units, c, device)
            costs = sh.costs()
            sim = simulate(sched, costs)
    peaks = held_peaks(sched, list(sh.act))[0]
    actions = [tuple(a.stage for a in sched.order[r]) for r in range(c.pp)]
    ranks = state(units, c, sh.split, sched.stage_to_rank, actions)
    plan = plan_of(units.plan, c, units.blocks, sh.split)
    dp_s, opt_s, gather_s, after, once, gathers, norm_groups = _reduction_and_optimizer(
        units, c, plan, sh, sched.stage_to_rank, device)
    sync, loss_steps, tied_steps = step_sync(plan, _tied_sums(units, c, plan, sh,
                                                          sched.stage_to_rank),
                                             len(sh.per_stage), device, False, norm_groups)
    once = [o + t for o, t in zip(once, tied_steps)]
    floor = shared_floor(sched, costs, device, once, gathers, opt_s, loss_steps)
    step, times = breakdown(sched, sim, list(sh.ops), costs, dp_s, opt_s, gather_s,
                            after if any(after) else None, floor, sync)
    prepass = routing_prepass_s(plan, sched, costs)
    states = [rk.param_bytes + rk.grad_bytes + rk.optimizer_bytes for rk in ranks]
    peak = max(s + int(a) for s, a in zip(states, peaks))
    table = sh.table
    world = c.pp * c.dp * c.cp * c.tp
    hw = sum(3 * u.flops + u.recompute_flops for u in table) * c.microbatches * c.dp * c.cp
    model = sum(3 * u.flops for u in table) * c.microbatches * c.dp * c.cp
    return Prediction(step + prepass, sim.makespan, step - sim.makespan,
                      max((t.comm for t in times), default=0.0), sim.bubble, int(peak),
                      int(max(states)), hw / world, model / world, sh.split,
                      tuple(sched.stage_to_rank))


def _shared(units: Units, device: DeviceModel, replicas: int, busy: float) -> DeviceModel:
    """The measured CPU's speeds for `replicas` copies of a pipeline keeping `busy` ranks
    computing at once (Sharing; one device per distinct sharing, so their stage times are
    cached once)."""
    key = ("shared", device_key(units, device), replicas, busy)
    if key not in units.cache:
        sharing = dataclasses.replace(device.sharing, replicas=replicas)
        units.cache[key] = dataclasses.replace(device, sharing=sharing).shared(busy)
    return units.cache[key]


def _reduction_and_optimizer(units: Units, c: Candidate, plan, sh: Shape, stage_rank,
                             device: DeviceModel) -> tuple[list, ...]:
    """Seconds to reduce each stage's gradients over dp, each pipeline rank's optimizer
    pass (predict.optimizer_s: timing_of's bytes of its ZeRO shards, read and written at
    the sustained memory bandwidth, and the host's ops per tensor it steps; clipping, its
    share of the norm, predict.norm_s), one ZeRO-3 all-gather of each stage's parameters,
    and per pipeline rank ZeRO-1/2's all-gather after the optimizer
    (predict.dp_ring_bytes); per stage the ring steps of its collectives once a step and of
    one ZeRO-3 gather (what predict.shared_floor charges gloo's threads for); per pipeline
    rank the groups of its norm's all-reduces (predict.norm_groups_of)."""
    per = state_bytes(plan)
    table = _table(units, c)
    bounds = (0,) + sh.split + (len(table),)
    dp_s, opt, gather_s, after = [], [0.0] * c.pp, [], [0.0] * c.pp
    tensors, normed, norm_groups = [0] * c.pp, [0.0] * c.pp, [()] * c.pp
    once, gathers = [], []
    for s, (a, b) in enumerate(zip(bounds, bounds[1:])):
        layout = _stage_layout(units, c, table, s, a, b)
        reduce, regather, waits, rewaits = dp_ring_bytes(plan, layout)
        once.append(waits + rewaits)
        dp_s.append(reduce / sh.links.dp + waits * device.ring_step_s)
        after[stage_rank[s]] += regather_s(regather, rewaits, sh.links.dp, device.ring_step_s)
        n = sum(layout.numel.values())
        add_step_end(plan, layout, stage_rank[s], (opt, tensors, normed, norm_groups))
        gather = ring_bytes("allgather", n * per.param / c.dp, c.dp) if c.zero == 3 else 0.0
        gathers.append(c.dp - 1 if gather else 0)
        gather_s.append(device.ring_step_s * (c.dp - 1) + gather / sh.links.dp if gather else 0.0)
    return dp_s, [step_end_s(plan, b, n, g, device.hardware)
                  for b, n, g in zip(opt, tensors, normed)], \
        gather_s, after, once, gathers, norm_groups


def _tied_sums(units: Units, c: Candidate, plan, sh: Shape, stage_rank) -> list[list]:
    """Per pipeline rank, (stage, bytes, holders) of each tied gradient it sums with the
    other pipeline ranks holding it (estimates.tied_sums' numbers): a parameter that units
    in stages on different ranks hold, its local size on the first such stage of a rank."""
    table = _table(units, c)
    bounds = (0,) + sh.split + (len(table),)
    where: dict = {}
    for s, (a, b) in enumerate(zip(bounds, bounds[1:])):
        for u in table[a:b]:
            for key, kind, n in u.params:
                where.setdefault(key, {}).setdefault(s, (kind, n))
    grad = state_bytes(plan).grad
    out = [[] for _ in range(c.pp)]
    for at in where.values():
        ranks = {stage_rank[s] for s in at}
        if len(ranks) < 2:
            continue
        first = {}
        for s in sorted(at):
            first.setdefault(stage_rank[s], s)
        for r, s in first.items():
            kind, n = at[s]
            local = n // c.tp if kind == TENSOR_PARALLEL else n // c.ep if kind == EXPERT else n
            out[r].append((s, local * grad, len(ranks)))
    return out


def _stage_layout(units: Units, c: Candidate, table: list[Unit], s: int, a: int,
                  b: int) -> RankShards:
    """One stage's RankShards alone (predict.timing_of's per-stage layout; cached)."""
    key = ("stage layout", c.tp, c.ep, c.cp, s, a, b)
    if key not in units.cache:
        numel, params = {}, []
        for u in table[a:b]:
            for k, kind, n in u.params:
                numel[k] = n // c.tp if kind == TENSOR_PARALLEL else \
                    n // c.ep if kind == EXPERT else n
                params.append((k, kind))
        shards, uses = group_shards([(s, params)])
        units.cache[key] = RankShards(shards, uses, numel, ((s, params),))
    return units.cache[key]
