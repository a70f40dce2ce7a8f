"""The model measured once per rewrite: per-block tables the search sums instead of recompiling.

The compiler's own front half runs once per capture key (microbatch size, cp): load on meta,
capture, shape and cost propagation. Then, per rewrite the search needs (tensor parallel on
or off, sequence parallel, recompute none / selective / full), the compiler's passes run on
that one capture with a split at every block (`blocks_of`: embeddings, each layer, the head),
so each block becomes one `Unit`: its forward FLOPs, recomputed FLOPs, aten ops, saved bytes,
the bytes crossing its end, its TP collectives per microbatch, its experts traffic and its
parameters by ZeRO kind. A candidate's stage is a run of consecutive units; every number
the time and memory estimate reads is a sum over the run (compiler/driver.py sums the same
per-node costs by stage), so no candidate is traced again.

Microbatch size: the model is captured at sizes 1, 2 and 3 (per cp value, when the search
first asks for it); every number of a unit at size
b > 3 is then read off the line through the last two, v(b) = v(2) + (b - 2)(v(3) - v(2)) (a
position table's bytes do not grow with the batch, a layer's do; each grouped op's shape
grows along the line too), when both captures have the same units, parameters, traffic roles
and op groups; otherwise each size is captured itself. Size 1 is not on the line: a batch
dimension of 1 broadcasts, so some memory-bound ops move fewer elements there. The
planner's chosen plan is compiled for real at its own size afterwards (`pipeplan plan`
prints both estimates), and the tests compare the two at sizes never captured.

Captures are ahead of need on two cores (forked.py; the tables are the same either way):
while this process captures size 1 of cp 1, a forked child captures size 3; then, whenever
no child runs, one captures sizes 2 and 3 of the next cp value the search may reach
(largest first, the order it reaches them), so this process captures only size 1 of it
(the trace its cp checks read) when the search asks.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Callable, Optional

from ..compiler.capture.blocks import blocks_of
from ..compiler.capture.loading import load_model
from ..compiler.capture.traced import trace_with_loss
from ..compiler.capture.work import Gemm
from ..compiler.estimate.activations import SEQUENCE, TensorSplit, placements, saved_records, \
    stage_saved_bytes
from ..compiler.estimate.costs import node_costs
from ..compiler.estimate.optime import StageWork, stage_work
from ..compiler.estimate.precision import to_precision
from ..compiler.estimate.traffic import collective_traffic
from ..compiler.parallel.cp import attach_context_costs, check_context, heads_split_by_tp
from ..compiler.parallel.cp_checks import context_checks
from ..compiler.parallel.ep import experts_modules, expert_weights, \
    place_experts
from ..compiler.parallel.ep_balance import mark_step_statistics
from ..compiler.parallel.ep_checks import check_experts
from ..compiler.parallel.tp import check_pairing, check_sequence_parallel, tp_annotations
from ..compiler.parallel.tp_auto import tp_split
from ..compiler.parallel.zero import EXPERT, REPLICATED, TENSOR_PARALLEL
from ..compiler.partition import compute_nodes, first_positions, Split
from ..compiler.recompute import recompute_mode
from ..compiler.stages import build_stages
from ..dsl.ast import ContextSpec, MeshSpec, Plan, RecomputeRule, SplitSpec
from ..dsl.errors import PlanError
from . import forked, repeats

RECOMPUTE_MODES = ("none", "selective", "full")


@dataclass(frozen=True)
class Unit:
    """One block of the model, one microbatch (at the capture's microbatch size)."""

    name: str  # the block where it begins (a split point)
    flops: float
    recompute_flops: float
    ops: int
    recompute_ops: int
    activation_bytes: tuple  # (tp, bytes saved for backward on one rank) per tp value,
    # the unit first in its stage (its inputs arrive whole)
    activation_inner: tuple  # ... after a unit of its stage that seeds sequence shards (under
    # sequence parallel its inputs arrive as shards)
    out_bytes: float  # what crosses its end (action_costs's message: floats at the precision)
    cp_bytes: float
    cp_steps: tuple  # (forward, backward) cp message latencies (compiler/parallel/cp.py)
    tp_traffic: tuple  # (role, bytes at the plan's precision) per TP traffic item (traffic.py),
    # the unit first in its stage (its inputs arrive from another stage)
    tp_inner: tuple  # ... the unit after another in the same stage (no stage edge before it)
    tp_rerun: tuple  # of tp_traffic, the items a `full` recompute rule covers (their forward
    # collectives run again in B: predict.rerun_calls)
    tp_rerun_inner: tuple  # ... of tp_inner
    ep_tokens: int  # experts call rows moved (traffic role "tokens")
    ep_weights: int
    ep_roles: tuple  # the traffic roles of its experts calls, one per item (their all-to-alls)
    params: tuple  # (key, kind, numel before tp/ep division)
    made: int  # values it makes from no input or parameter (StageSpec.made: eager tp wraps)
    work: StageWork = field(default_factory=StageWork)  # its ops (optime.py), whole shapes


@dataclass
class Units:
    """Per-block tables for every rewrite, by microbatch size (linear, or captured each)."""

    plan: Plan
    blocks: tuple[str, ...]
    tables: dict = field(default_factory=dict)  # (mbs, tp_on, sp, recompute, cp) -> [Unit]
    affine: dict = field(default_factory=dict)  # cp -> sizes 2, 3 on a line (linear)
    refused: dict = field(default_factory=dict)  # what the compiler refuses, per axis value
    capture: Optional[Callable] = None  # (mbs, cp) -> per-rewrite tables
    check_cp: Optional[Callable] = None  # cp -> records the compiler's cp refusals
    settle: Callable = lambda: None  # stops captures started ahead and no longer needed
    captures: int = 0  # how many times the model was captured
    cache: dict = field(default_factory=dict)  # the cost model's per-shape results
    checked: set = field(default_factory=set)  # ("cp", value) whose refusals are known
    ahead: Optional[Callable] = None  # cost key -> its value computed ahead elsewhere, or None

    def at(self, mbs: int, tp_on: bool, sp: bool, recompute: str, cp: int = 1) -> list[Unit]:
        key = (mbs, tp_on, sp, recompute, cp)
        if key not in self.tables:
            two, three = (2,) + key[1:], (3,) + key[1:]
            if mbs > 3 and self.linear(cp):  # read off the line through sizes 2 and 3
                self.tables[key] = [_line(a, b, mbs) for a, b in
                                    zip(self.tables[two], self.tables[three])]
            else:
                self.capture(mbs, cp)
        return self.tables[key]

    def refusal(self, tp: int, cp: int) -> Optional[str]:
        """Why the compiler refuses cp (or tp x cp) on this model, None when it does not.
        Each cp value is checked the first time it is asked about (its own capture)."""
        if cp == 1:
            return None
        if ("cp", cp) not in self.checked:
            self.checked.add(("cp", cp))
            self.check_cp(cp)
        return self.refused.get(("cp", cp)) or self.refused.get(("tp x cp", tp, cp))

    def has(self, mbs: int, tp_on: bool, sp: bool, recompute: str, cp: int = 1) -> bool:
        """Can `at` answer without capturing the model again?"""
        return (mbs, tp_on, sp, recompute, cp) in self.tables or \
            (mbs > 3 and self.affine.get(cp, False))

    def linear(self, cp: int) -> bool:
        """Do sizes 2 and 3 at this cp (captured here if they are not yet) join on a line:
        the same units, parameters, traffic roles and op groups in every rewrite?"""
        if cp not in self.affine:
            for size in (2, 3):
                if not any(k[0] == size and k[4] == cp for k in self.tables):
                    self.capture(size, cp)
            self.affine[cp] = all(_same_shape(t, self.tables[(3,) + k[1:]])
                                  for k, t in list(self.tables.items())
                                  if k[0] == 2 and k[4] == cp)
        return self.affine[cp]


_NUMBERS = ("flops", "recompute_flops", "ops", "recompute_ops", "out_bytes",
            "cp_bytes", "ep_tokens", "ep_weights")


def _line(a: Unit, b: Unit, size: int) -> Unit:
    """Unit `a` (size 2) and `b` (size 3) read at `size` on the line through them."""
    k = size - 2
    return dataclasses.replace(
        a, **{f: getattr(a, f) + k * (getattr(b, f) - getattr(a, f)) for f in _NUMBERS},
        tp_traffic=_pairs_line(a.tp_traffic, b.tp_traffic, k),
        tp_inner=_pairs_line(a.tp_inner, b.tp_inner, k),
        tp_rerun=_pairs_line(a.tp_rerun, b.tp_rerun, k),
        tp_rerun_inner=_pairs_line(a.tp_rerun_inner, b.tp_rerun_inner, k),
        activation_bytes=_pairs_line(a.activation_bytes, b.activation_bytes, k),
        activation_inner=_pairs_line(a.activation_inner, b.activation_inner, k),
        work=_work_line(a.work, b.work, k))


def _pairs_line(a: tuple, b: tuple, k: int) -> tuple:
    """(key, number) pairs of size 2 read at size 2 + k on the line to size 3's."""
    return tuple((r, n + k * (m - n)) for (r, n), (_, m) in zip(a, b))


def _work_line(a: StageWork, b: StageWork, k: int) -> StageWork:
    """Each grouped op of `a` (size 2) read at size 2 + k on the line to its partner in `b`:
    shapes grow linearly with the batch, counts and kernels stay."""
    gemms = {}
    for (ga, kind, rec), (gb, _, _) in zip(a.gemms, b.gemms):
        g = Gemm(*(x + k * (y - x) for x, y in zip((ga.batch, ga.m, ga.n, ga.k),
                                                     (gb.batch, gb.m, gb.n, gb.k))),
                 attention=ga.attention)
        key = (g, kind, rec)
        gemms[key] = gemms.get(key, 0.0) + a.gemms[(ga, kind, rec)]
    memory = {key: [e + k * (f - e), o + k * (q - o), n]
              for (key, (e, o, n)), (_, (f, q, _)) in zip(a.memory.items(), b.memory.items())}
    return StageWork(gemms, memory, a.ops, a.recompute_ops, a.seeds, a.input_grads)


def _work_pairs(a: StageWork, b: StageWork) -> bool:
    """Both sizes group their ops alike (so `_work_line` pairs them)."""
    return len(a.gemms) == len(b.gemms) and list(a.memory) == list(b.memory) and all(
        ka[1:] == kb[1:] and a.gemms[ka] == b.gemms[kb] for ka, kb in zip(a.gemms, b.gemms))


def measure(plan: Plan, tp_values: tuple[int, ...], cp_values: tuple[int, ...],
            recompute_pattern: Optional[str], progress=None, check_all_cp: bool = True,
            model=None) -> Units:
    """Capture `plan`'s model at microbatch sizes 1, 2 and 3 (once each) and build its unit
    tables; record which tp values the compiler's own checks refuse, and why, and the same
    of each cp value (its own capture) now, or with `check_all_cp` False when the search
    first asks (Units.refusal). `model`: the plan's model already loaded on meta (else it
    is loaded here)."""
    model = model if model is not None else load_model(plan, "meta")
    to_precision(model, plan.train.precision)
    units = Units(plan, tuple(blocks_of(model)))
    traced_at = {}  # (mbs, cp) -> that capture (capture/traced.TracedWithLoss)

    pending = {}  # (mbs, cp) -> waiting for a forked child's tables (forked.py)

    stash = {}  # tables a child captured, moved into units.tables when asked for (so what
    # the search reads of units.tables -- Units.has -- never depends on a child's timing)

    here = set()  # (mbs, cp) this process is capturing now (no child takes it too)

    def have(mbs: int, cp: int) -> bool:
        return (mbs, cp) in here or \
            any(k[0] == mbs and k[4] == cp for k in (*units.tables, *stash))

    def capture(mbs: int, cp: int) -> None:
        collect((mbs, cp))
        got = {k: t for k, t in stash.items() if k[0] == mbs and k[4] == cp}
        units.captures += 1
        if got:
            units.tables.update(got)
            for k in got:
                del stash[k]
            speculate()
            return
        here.add((mbs, cp))
        if mbs < 3:
            ahead((3,), cp)  # a child takes size 3 while this process captures mbs
        speculate()
        if progress:
            progress(f"capturing the model (microbatch {mbs}, cp {cp})")
        try:
            traced_at[(mbs, cp)] = _capture(units, model, plan, mbs, cp, tp_values,
                                            recompute_pattern)
        finally:
            here.discard((mbs, cp))

    def collect(need=None) -> None:
        """Stash the tables of every child that is done, waiting for the one capturing
        `need` (mbs, cp)."""
        for child in {id(ch): ch for ch in pending.values()}.values():
            mine = [k for k, ch in pending.items() if ch is child]
            if need not in mine and not child.done():
                continue
            for key in mine:
                del pending[key]
            stash.update(child.wait() or {})

    def ahead(sizes: tuple[int, ...], cp: int) -> bool:
        """Capture these sizes of cp in a child meanwhile (one child at a time), for
        `capture`; False when none is started."""
        sizes = tuple(b for b in sizes if not have(b, cp))
        if pending or not sizes:
            return False

        def work() -> dict:
            for b in sizes:
                _capture(units, model, plan, b, cp, tp_values, recompute_pattern)
            return {k: t for k, t in units.tables.items() if k[0] in sizes and k[4] == cp}
        child = forked.start(work)
        if child is not None:
            pending.update({(b, cp): child for b in sizes})
        return child is not None

    def speculate() -> None:
        """With no child running: sizes 2 and 3 of the next cp value the search may reach
        (largest first, as the search reaches them: its quick bound divides by cp), before
        it asks. Size 1 is captured here when it does (its cp checks read that trace)."""
        for cp in sorted(cp_values, reverse=True):
            if pending:
                return
            if cp > 1 and ("cp", cp) not in units.refused:
                ahead((2, 3), cp)

    for tp in tp_values:  # shapes tp must divide (tp_annotations), before any capture
        if tp > 1:
            try:
                tp_annotations(unit_plan(plan, units.blocks, 1, tp, False, "none", None), model)
            except PlanError as e:
                units.refused[("tp", tp)] = _reason(e, tp=tp)
    tp_values = tuple(t for t in tp_values if ("tp", t) not in units.refused)
    units.capture = capture

    def check_cp(cp: int) -> None:
        _cp_refusals(units, model, plan, traced_at, tp_values, cp)  # captures size 1 here
        if ("cp", cp) in units.refused:
            for key in [k for k in pending if k[1] == cp]:
                pending.pop(key).cancel()
            speculate()

    def settle() -> None:
        """No child left running (the search is over)."""
        for key in list(pending):
            pending.pop(key).cancel()
    units.check_cp, units.settle = check_cp, settle
    capture(1, 1)
    units.linear(1)  # sizes 2 and 3
    _tp_refusals(units, model, plan, traced_at[(1, 1)], tp_values)
    if check_all_cp:
        for cp in cp_values:
            units.refusal(1, cp)
    else:  # the search asks for cp values as it reaches them: the next one ahead
        speculate()
    return units


def _same_shape(t1: list[Unit], t2: list[Unit]) -> bool:
    """Same blocks, parameters and traffic roles at both sizes (so a line joins them)."""
    return len(t1) == len(t2) and all(
        a.name == b.name and a.params == b.params
        and [r for r, _ in a.tp_traffic] == [r for r, _ in b.tp_traffic]
        and [r for r, _ in a.tp_inner] == [r for r, _ in b.tp_inner]
        and [r for r, _ in a.tp_rerun] == [r for r, _ in b.tp_rerun]
        and [r for r, _ in a.tp_rerun_inner] == [r for r, _ in b.tp_rerun_inner]
        and _work_pairs(a.work, b.work) for a, b in zip(t1, t2))


def unit_plan(plan: Plan, blocks: tuple[str, ...], mbs: int, tp: int, sp: bool,
              recompute: str, pattern: Optional[str], cp: int = 1) -> Plan:
    """The plan the compiler measures units with: one pipeline rank holding one stage per
    block, one microbatch of `mbs` sequences."""
    rules = () if recompute == "none" or pattern is None else (RecomputeRule(pattern, recompute),)
    context = (plan.context or ContextSpec()) if cp > 1 else None
    tensor = plan.tensor if tp > 1 else dataclasses.replace(plan.tensor, column=(), row=(),
                                                            vocab=(), sequence_parallel=False)
    tensor = dataclasses.replace(tensor, sequence_parallel=sp and tp > 1)
    return dataclasses.replace(
        plan, mesh=MeshSpec(pp=1, dp=1, tp=tp, ep=1, cp=cp),
        pipeline=dataclasses.replace(plan.pipeline, schedule="gpipe", microbatches=1,
                                     microbatch_size=None, virtual=len(blocks),
                                     split=SplitSpec("points", points=blocks[1:]),
                                     memory_limit=None, costs=None, profile=None),
        train=dataclasses.replace(plan.train, global_batch=mbs), tensor=tensor,
        recompute=rules, zero=0, context=context)


def _capture(units: Units, model, plan: Plan, mbs: int, cp: int, tp_values, pattern) -> None:
    blocks = units.blocks
    tp_probe = min((t for t in tp_values if t > 1), default=1)
    probe = unit_plan(plan, blocks, mbs, tp_probe, False, "none", pattern, cp)
    traced = trace_with_loss(probe, model)
    graph, run = traced.module.graph, traced.run
    experts = place_experts(probe, model)
    moe = experts_modules(probe, model)
    check_experts(probe, graph, run, moe)
    mark_step_statistics(probe, traced.module, run, traced.loss, traced.prediction, moe)
    if cp > 1:  # the driver's cp passes (a refusal is the cp value's reason, _refusals)
        context_checks(unit_plan(plan, blocks, mbs, 1, False, "none", pattern, cp), model,
                       traced, frozenset(moe.values()), {})
    nodes = compute_nodes(graph)
    positions = first_positions(probe, model, nodes, blocks[1:], "pipeline.split")
    split = Split(blocks[1:], positions)
    stages = build_stages(traced.module, split, run, traced.loss, set(blocks))
    expert_params = {f"{e.module}.{w}" for e in experts
                     for w in expert_weights(model.get_submodule(e.module),
                                             plan.experts.num_experts)} if plan.experts else set()
    fs = 0.5 if plan.train.precision == "bf16" else 1.0
    records = saved_records(plan.train.precision, run.gm, run)
    costs_of: dict = {}  # recompute mode -> node_costs
    for tp_on in ((False, True) if tp_probe > 1 else (False,)):
        p_tp = unit_plan(plan, blocks, mbs, tp_probe if tp_on else 1, False, "none", pattern, cp)
        kinds = tp_split(p_tp, model, graph, run) if tp_on else {}
        tp_heads = heads_split_by_tp(p_tp, graph, model, kinds, run)
        tp_traffic, moe_traffic = collective_traffic(model, graph, run, split, kinds, experts)
        tp_inner = _inner_traffic(model, graph, run, kinds, experts, tp_traffic,
                                  len(stages) - 1)
        shards = _sequence_inputs(graph, traced.module, stages, kinds, records) if tp_on \
            else None
        forms = repeats.Forms(records, kinds, blocks)
        for sp in ((False, True) if tp_on else (False,)):
            for mode in (RECOMPUTE_MODES if pattern else ("none",)):
                p = unit_plan(plan, blocks, mbs, tp_probe if tp_on else 1, sp, mode, pattern, cp)
                if mode not in costs_of:  # what node_costs reads of p: the recompute
                    # rules, experts and cp (the same for every tp and sp here)
                    costs_of[mode] = node_costs(p, graph, run)
                costs = costs_of[mode]
                works = stage_work(graph, nodes, split.stage_of, costs, kinds,
                                   tp_probe if tp_on else 1, stages)
                scale = {n.name: c.scale for n, c in costs.items() if c.scale != 1.0}
                tps = tuple(t for t in tp_values if t > 1) if tp_on else (1,)
                cp_stages = [dataclasses.replace(st, cp_bytes=0.0, cp_calls=0, cp_steps=(0, 0))
                             for st in stages]
                attach_context_costs(p, cp_stages, split, graph, nodes, run, tp_heads)
                table = []

                def items(traffic, stage: int, rerun: bool = False, p=p) -> tuple:
                    """(role, bytes at the precision) of a stage's TP traffic items (those a
                    `full` rule covers: `rerun`)."""
                    return tuple((t.role, int(t.nbytes * fs)) for t in traffic
                                 if t.stage == stage and (not rerun or under_full_recompute(p, t))
                                 ) if tp_on else ()

                saved = _saved_bytes(records, p.recompute, sp, kinds, scale, forms)
                alone = [tuple((t, saved(st.module, st.index, t)) for t in tps)
                         for st in stages]
                own_costs = [[] for _ in stages]  # each stage's node costs, in node order
                for i, n in enumerate(nodes):
                    if costs.get(n) is not None:
                        own_costs[split.stage_of(i)].append(costs[n])
                for st in stages:
                    own = own_costs[st.index]
                    u = st.index
                    inner = tuple((t, saved(st.module, u, t, shards[u])) for t in tps) \
                        if sp else alone[u]
                    table.append(Unit(
                        name=blocks[st.index],
                        flops=sum(c.flops for c in own),
                        recompute_flops=sum(c.recompute_flops for c in own),
                        ops=sum(c.ops for c in own),
                        recompute_ops=sum(c.recompute_ops for c in own),
                        activation_bytes=alone[u], activation_inner=inner,
                        out_bytes=sum(_nbytes(o) * (fs if "float" in o.dtype else 1)
                                      for o in st.outputs),
                        cp_bytes=cp_stages[st.index].cp_bytes,
                        cp_steps=cp_stages[st.index].cp_steps,
                        tp_traffic=items(tp_traffic, st.index),
                        tp_inner=items(tp_inner, st.index),
                        tp_rerun=items(tp_traffic, st.index, rerun=True),
                        tp_rerun_inner=items(tp_inner, st.index, rerun=True),
                        ep_tokens=sum(t.nbytes for t in moe_traffic
                                      if t.stage == st.index and t.role == "tokens"),
                        ep_weights=sum(t.nbytes for t in moe_traffic
                                       if t.stage == st.index and t.role == "weights"),
                        ep_roles=tuple(t.role for t in moe_traffic if t.stage == st.index),
                        params=_params(st, kinds, expert_params, plan), made=st.made,
                        work=works[st.index]))
                units.tables[(mbs, tp_on, sp, mode, cp)] = table
    return traced


def under_full_recompute(plan: Plan, traffic) -> bool:
    """Does a `full` recompute rule cover the module of this TP traffic item (its forward
    collectives rerun in B: predict.rerun_calls)?"""
    return recompute_mode(plan.recompute, traffic.module)[0] == "full"


def _saved_bytes(records: dict, rules, sp: bool, kinds: dict, scale: dict,
                 forms: repeats.Forms) -> Callable:
    """(stage graph, its block's index, tp, its inputs that are sequence shards) -> bytes it
    saves for backward on one rank (activations.stage_saved_bytes under one rewrite; once
    per distinct block: repeats.py)."""
    def walk(module, t: int, shards: frozenset) -> int:
        split = TensorSplit(t, sp, kinds, shards) if t > 1 else None
        return stage_saved_bytes(module, records, rules, split, scale)
    return repeats.cached_walk(walk, forms, rules, scale)


def _sequence_inputs(graph, module, stages, kinds: dict, records: dict) -> list:
    """Per unit, its inputs that are sequence shards under sequence parallel when an
    earlier block of its stage made the residual stream one (the placements of the whole
    model as one stage, activations.placements)."""
    def is_tensor(n):
        c = records.get(n.name)
        return bool(c is not None and c.outs) or n.op == "placeholder"
    place = placements(graph, module, TensorSplit(2, True, kinds), is_tensor)[0]
    seq = frozenset(n.name for n, where in place.items() if where == SEQUENCE)
    return [frozenset(n.name for n in st.module.graph.nodes
                      if n.op == "placeholder" and n.name in seq) for st in stages]


def _inner_traffic(model, graph, run, kinds: dict, experts, per_block: list,
                   last: int) -> list:
    """Each unit's TP traffic when an earlier unit of the same stage precedes it: the roles
    traffic.py reads with the whole model as one stage (a column input after a row output
    is a sequence shard, "input", not "whole_input"; no stage edge, so no "partial_input"
    or "seq_*"), each item given the unit its module is in; the loss's ("counted_loss": a
    mean of sequence shards, all-reduced as it leaves) the `last` unit, which holds it."""
    unit = {t.module: t.stage for t in per_block}
    whole, _ = collective_traffic(model, graph, run, Split((), ()), kinds, experts)
    return [dataclasses.replace(t, stage=unit[t.module] if t.module in unit else last)
            for t in whole if t.module in unit or t.role == "counted_loss"]


def _params(st, tp_kinds: dict, expert_params: set, plan: Plan) -> tuple:
    """(key, kind, full numel) of each trainable parameter, as estimates.rank_shards kinds
    them (a row-parallel bias stays replicated)."""
    out = []
    dispatched = plan.experts is not None
    for name, p in st.module.named_parameters():
        if not p.requires_grad:
            continue
        owner, _, leaf = name.rpartition(".")
        tk = tp_kinds.get(owner)
        if dispatched and name in expert_params:
            kind = EXPERT
        elif tk is not None and not (tk == "row" and leaf == "bias"):
            kind = TENSOR_PARALLEL
        else:
            kind = REPLICATED
        out.append((id(p), kind, p.numel()))
    return tuple(out)


def _nbytes(spec) -> int:
    import torch
    n = 1
    for d in spec.shape:
        n *= d
    return n * torch.empty((), dtype=getattr(torch, spec.dtype)).element_size()


def _tp_refusals(units: Units, model, plan: Plan, traced, tp_values) -> None:
    """Each tp value the compiler's own checks refuse on this model, and why (the first
    capture)."""
    for tp in tp_values:
        if tp == 1 or ("tp", tp) in units.refused:
            continue
        p = unit_plan(plan, units.blocks, 1, tp, False, "none", None)
        try:
            kinds = tp_split(p, model, traced.module.graph, traced.run)
            check_pairing(p, traced.module.graph, model, kinds, traced.run)
        except PlanError as e:
            units.refused[("tp", tp)] = _reason(e, tp=tp)
            continue
        try:  # sequence parallel's own check (attention inside the pairs)
            check_sequence_parallel(unit_plan(plan, units.blocks, 1, tp, True, "none", None),
                                    traced.module.graph, model, kinds, traced.run)
        except PlanError as e:
            units.refused[("sp", tp)] = _reason(e, tp=tp)


def _reason(e: PlanError, tp: int = 1, cp: int = 1) -> str:
    """The compiler's reason for refusing a tp or cp value, the value itself written as its
    axis ("cp = 4 does not divide ..." -> "cp does not divide ..."), so one reason lists
    every value it refuses (the values are listed beside it)."""
    said = e.diagnostics[0].message
    if tp > 1 and cp > 1:
        said = said.replace(f"tp * cp = {tp} * {cp}", "tp * cp")
    if cp > 1:
        said = re.sub(rf"\bcp = {cp}\b", "cp", said)
    return re.sub(rf"\btp = {tp}\b", "tp", said) if tp > 1 else said


def _cp_refusals(units: Units, model, plan: Plan, traced_at: dict, tp_values, cp: int) -> None:
    """Whether the compiler's checks refuse cp (and tp x cp) on this model, and why: on the cp
    value's own capture (one cp rank's sequence), through the compiler's context-parallel
    passes in the driver's order (cp_checks.py)."""
    p = dataclasses.replace(unit_plan(plan, units.blocks, 1, 1, False, "none", None, cp),
                            context=plan.context or ContextSpec())
    try:  # its first capture runs the compiler's cp passes (_capture)
        if (1, cp) not in traced_at:
            units.capture(1, cp)
        at = traced_at[(1, cp)]
    except PlanError as e:
        units.refused[("cp", cp)] = _reason(e, cp=cp)
        return
    for tp in tp_values:  # heads tp splits, split again by cp (Ulysses)
        if tp == 1 or ("tp", tp) in units.refused:
            continue
        pt = dataclasses.replace(unit_plan(plan, units.blocks, 1, tp, False, "none", None,
                                           cp), context=p.context)
        try:
            kinds = tp_split(pt, model, at.module.graph, at.run)
            check_context(pt, at.module.graph, at.run,
                          heads_split_by_tp(pt, at.module.graph, model, kinds, at.run))
        except PlanError as e:
            units.refused[("tp x cp", tp, cp)] = _reason(e, tp=tp, cp=cp)
