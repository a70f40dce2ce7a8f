"""Semantic checks: what a well-typed plan must also satisfy before anything runs.

Each check is a small pure function `Plan -> problems`, registered with the
dotted keys it reads. A check is skipped when one of those keys failed to
read (its error is already reported), so every independent problem is
reported once, and none is a knock-on effect of another.

What each schedule kind needs (stages per rank, microbatches) is the table in
schedules/kinds.py. The registry (`check`, `Problem`) is rules.py.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Optional

from . import compile_checks, input_checks, sync_checks, train_checks  # noqa: F401  (register
# the compile, model-input, size, sync, eval and tracker checks)
from .ast import ExpertsSpec, OptimizerSpec, Plan
from .errors import Diagnostic, PlanError
from .layout import ep_fits
from .rules import CHECKS, Check, Problem, check, where
from ..schedules.kinds import KINDS, KINDS_TABLE, min_microbatches


def _default(cls, name: str):
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


# -- mesh
@check("mesh", "experts")
def _expert_parallel(plan: Plan) -> Iterator[Problem]:
    m = plan.mesh
    if not ep_fits(m):
        yield Problem("mesh.ep", f"ep = {m.ep} divides neither dp = {m.dp} nor dp x tp = "
                      f"{m.dp * m.tp}",
                      "ep re-divides the ranks of each pipeline stage (it does not add "
                      "ranks): pick ep among the divisors of dp, or of dp x tp for expert "
                      "parallel across tensor-parallel ranks")
    if m.ep > 1 and plan.experts is None:
        yield Problem("mesh.ep", f"ep = {m.ep} but the plan has no experts section",
                      "add experts { modules = [...] num_experts = N } or set ep = 1")
    if plan.experts is not None and plan.experts.num_experts % m.ep:
        yield Problem(where(plan, "experts.num_experts", "mesh.ep"),
                      f"ep = {m.ep} does not divide num_experts = {plan.experts.num_experts}",
                      "every expert-parallel rank holds the same number of experts")


# -- pipeline
@check("mesh", "pipeline.schedule", "pipeline.virtual")
def _virtual_stages(plan: Plan) -> Iterator[Problem]:
    p = plan.pipeline
    rule = KINDS_TABLE[p.schedule]
    key = where(plan, "pipeline.virtual", "pipeline.schedule")
    if rule.min_virtual == rule.max_virtual and p.virtual != rule.min_virtual:
        shape = "the V placement: 2 stages per rank" if rule.min_virtual == 2 else "1 stage per rank"
        yield Problem(key, f"{p.schedule} needs virtual = {rule.min_virtual}, got {p.virtual}",
                      f"{p.schedule} uses {shape}; set virtual = {rule.min_virtual}"
                      + (", or use interleaved for more" if rule.min_virtual == 1 else ""))
    elif p.virtual < rule.min_virtual:
        yield Problem(key, f"{p.schedule} needs virtual >= {rule.min_virtual}, got {p.virtual}",
                      "interleaving needs several model chunks per rank; set virtual = 2, "
                      "or use 1f1b")
    elif rule.max_virtual is not None and p.virtual > rule.max_virtual:
        yield Problem(key, f"{p.schedule} takes virtual <= {rule.max_virtual}, got {p.virtual}",
                      "auto searches 1 and 2 stages per rank; use interleaved for more")


@check("mesh.pp", "pipeline.schedule", "pipeline.microbatches", "pipeline.microbatch_size",
       "train.global_batch", "mesh.dp")
def _microbatches(plan: Plan) -> Iterator[Problem]:
    p, pp = plan.pipeline, plan.mesh.pp
    if p.microbatches is not None and p.microbatch_size is not None:
        yield Problem("pipeline.microbatch_size",
                      "set pipeline.microbatches or pipeline.microbatch_size, not both",
                      "the other follows from train.global_batch / (dp * this one)")
        return
    dp, batch = plan.mesh.dp, plan.train.global_batch
    if p.microbatch_size is not None:
        key, count = "pipeline.microbatch_size", batch // dp // p.microbatch_size
        if batch % (dp * p.microbatch_size):
            yield Problem(where(plan, "train.global_batch", key),
                          f"global_batch = {batch} is not divisible by "
                          f"dp * microbatch_size = {dp} * {p.microbatch_size}",
                          "every dp rank runs the same whole number of microbatches")
            return
    else:
        key, count = "pipeline.microbatches", plan.microbatches
        if batch % (dp * count):
            yield Problem(where(plan, "train.global_batch", key),
                          f"global_batch = {batch} is not divisible by "
                          f"dp * microbatches = {dp} * {count}",
                          "every microbatch on every dp rank has the same size; pick a global "
                          f"batch that is a multiple of {dp * count}")
    need = min_microbatches(p.schedule, pp)
    if count < need:
        yield Problem(key, f"{p.schedule} with pp = {pp} needs at least {need} microbatches, "
                           f"got {count}",
                      f"{KINDS_TABLE[p.schedule].why}; use microbatches >= {need} or "
                      f"another schedule (zbv has the same V placement and takes any count)")


@check("mesh", "pipeline.virtual", "pipeline.split", "model.args")
def _split(plan: Plan) -> Iterator[Problem]:
    split, stages = plan.pipeline.split, plan.mesh.pp * plan.pipeline.virtual
    if split.kind == "points":
        if len(split.points) != stages - 1:
            yield Problem("pipeline.split",
                          f"{len(split.points)} split points make {len(split.points) + 1} "
                          f"stages, but pp * virtual = {stages}",
                          f"name the {stages - 1} modules where stages 2..{stages} begin")
        for i, name in enumerate(split.points):
            if name in split.points[:i]:
                yield Problem(f"pipeline.split.{i}", f"split point '{name}' is given twice",
                              "each split point starts a new stage; remove the repeat")
    if split.kind != "ranges":
        return
    if len(split.ranges) != stages:
        yield Problem("pipeline.split", f"{len(split.ranges)} layer ranges for pp * virtual = "
                                        f"{stages} stages", "give one range per stage")
    expected = 0
    for i, r in enumerate(split.ranges):
        if r.prefix != split.ranges[0].prefix:
            yield Problem(f"pipeline.split.{i}", f"range over '{r.prefix}' but the first range "
                          f"is over '{split.ranges[0].prefix}'", "split one layer list")
        elif r.stop <= r.start:
            yield Problem(f"pipeline.split.{i}", f"range {r.prefix}[{r.start}:{r.stop}] is empty",
                          "a stage needs at least one layer: start < stop")
        elif r.start != expected:
            kind = "skips" if r.start > expected else "overlaps"
            missing = (f"layers {expected}..{r.start - 1} would be dropped" if r.start > expected
                       else f"layers {r.start}..{expected - 1} would run twice")
            yield Problem(f"pipeline.split.{i}",
                          f"range {r.prefix}[{r.start}:{r.stop}] {kind} the previous one: {missing}",
                          f"start this range at {expected}")
        expected = max(expected, r.stop)
    total = plan.model.args.get(split.ranges[0].prefix.rsplit(".", 1)[-1])
    if isinstance(total, int) and not isinstance(total, bool) and expected != total:
        last = len(split.ranges) - 1
        yield Problem(f"pipeline.split.{last}",
                      f"the ranges cover {expected} layers but model.args."
                      f"{split.ranges[0].prefix.rsplit('.', 1)[-1]} = {total}",
                      f"end the last range at {total}; no layer may be silently dropped")


@check("pipeline.memory_limit")
def _memory_limit(plan: Plan) -> Iterator[Problem]:
    limit = plan.pipeline.memory_limit
    if limit is not None and not limit.in_bytes and limit.amount < 1:
        yield Problem("pipeline.memory_limit",
                      f"memory_limit = {limit.amount:g} microbatches cannot hold one microbatch",
                      "give at least 1 (microbatches of activations) or a size like 40GiB")


# -- experts
@check("experts", "model.args")
def _experts(plan: Plan) -> Iterator[Problem]:
    e = plan.experts
    if e is None:
        return
    if e.top_k > e.num_experts:
        yield Problem("experts.top_k", f"top_k = {e.top_k} is more than num_experts = "
                      f"{e.num_experts}", "each token picks top_k distinct experts")
    if e.dropless and e.capacity_factor is not None:
        yield Problem("experts.capacity_factor",
                      "capacity_factor does nothing with dropless = true",
                      "set dropless = false to drop tokens over capacity, or remove "
                      "capacity_factor")
    if e.dropless and e.drop_policy != _default(ExpertsSpec, "drop_policy"):
        yield Problem("experts.drop_policy", "drop_policy does nothing with dropless = true",
                      "set dropless = false, or remove drop_policy")
    if not e.dropless and e.capacity_factor is None:
        yield Problem(where(plan, "experts.dropless", "experts"),
                      "dropless = false needs a capacity_factor",
                      "add capacity_factor = 1.25 (tokens per expert = factor * tokens * "
                      "top_k / num_experts)")
    # (aux_loss / z_loss are the model's own; compiler/parallel/ep_checks.py refuses them here)
    for arg, value in (("num_experts", e.num_experts), ("top_k", e.top_k)):
        given = plan.model.args.get(arg)
        if isinstance(given, (int, float)) and not isinstance(given, bool) and given != value:
            yield Problem(where(plan, f"experts.{arg}", "experts"),
                          f"experts.{arg} = {value:g} but model.args.{arg} = {given:g}",
                          "the experts section describes the model's MoE layers; make them "
                          "agree")


# -- tensor / zero
@check("mesh.tp", "tensor")
def _tensor(plan: Plan) -> Iterator[Problem]:
    t = plan.tensor
    if plan.mesh.tp == 1:
        for key in ("column", "row", "vocab"):
            if getattr(t, key):
                yield Problem(f"tensor.{key}", f"tensor.{key} does nothing with mesh.tp = 1",
                              "set mesh.tp > 1 to split these modules, or remove the list")
        if t.sequence_parallel:
            yield Problem("tensor.sequence_parallel",
                          "sequence_parallel does nothing with mesh.tp = 1",
                          "set mesh.tp > 1, or remove sequence_parallel")
        if t.plan in ("model", "auto"):
            yield Problem("tensor.plan", f"tensor.plan = {t.plan} does nothing with mesh.tp = 1",
                          "set mesh.tp > 1 to split the model, or remove it")
    if t.plan in ("model", "auto"):
        how = "as it declares itself" if t.plan == "model" else \
            "by the column/row pairs its graph shows"
        for key in ("column", "row", "vocab"):
            if getattr(t, key):
                yield Problem(f"tensor.{key}", f"tensor.{key} is ignored: tensor.plan = "
                              f"{t.plan} splits the model {how}",
                              "remove the list, or set tensor.plan = patterns")
    for i, pat in enumerate(t.row):
        if pat in t.column:
            yield Problem(f"tensor.row.{i}", f"'{pat}' is both column- and row-parallel",
                          "a module is split one way: keep it in one list")


# -- context parallel (the checks that need the captured graph: compiler/parallel/cp.py)
@check("mesh", "context", "data.seq_len", "experts", "sync")
def _context(plan: Plan) -> Iterator[Problem]:
    m, c = plan.mesh, plan.context
    if c is None:
        if m.cp > 1:
            yield Problem("mesh.cp", f"cp = {m.cp} but the plan has no context section",
                          "say how attention sees the whole sequence: context { method = ulysses }")
        return
    if m.cp == 1:
        yield Problem("context", "context does nothing with mesh.cp = 1",
                      "set mesh.cp > 1 to split sequences, or remove the context section")
        return
    if c.method == "ring" and plan.data.seq_len % (2 * m.cp):
        yield Problem(where(plan, "data.seq_len", "mesh.cp"),
                      f"ring attention with cp = {m.cp} cuts each sequence into 2*cp = "
                      f"{2 * m.cp} chunks, which do not divide data.seq_len = {plan.data.seq_len}",
                      "cp rank r holds chunks r and 2cp-1-r (load balancing for causal "
                      "attention): pick seq_len divisible by 2*cp")
    elif plan.data.seq_len % m.cp:
        yield Problem(where(plan, "data.seq_len", "mesh.cp"),
                      f"cp = {m.cp} does not divide data.seq_len = {plan.data.seq_len}",
                      "every context-parallel rank holds an equal slice of each sequence")
    if m.ep > 1:
        yield Problem("mesh.cp", f"cp = {m.cp} with ep = {m.ep} is not supported yet (expert "
                      "dispatch over sequence shards)", "set ep = 1 or cp = 1")
    if plan.experts is not None:
        yield Problem("experts", f"experts with cp = {m.cp} are not supported yet",
                      "set cp = 1, or drop the experts section")
    if plan.sync.mode != "every_step":
        yield Problem("sync", f"sync = {plan.sync.mode} with cp = {m.cp} is not supported yet "
                      "(an island would have to reduce over its cp ranks)",
                      "set cp = 1, or sync every step")


@check("mesh.dp", "zero")
def _zero(plan: Plan) -> Iterator[Problem]:
    if plan.zero > 0 and plan.mesh.dp == 1:
        yield Problem("zero", f"zero = {plan.zero} does nothing with mesh.dp = 1",
                      "ZeRO shards optimizer state over data-parallel ranks: set dp > 1 or "
                      "zero = 0")


# -- train
@check("train")
def _train(plan: Plan) -> Iterator[Problem]:
    t = plan.train
    if t.lr_schedule.warmup >= t.steps and t.lr_schedule.warmup > 0:
        yield Problem("train.lr_schedule.warmup",
                      f"warm-up of {t.lr_schedule.warmup} steps is not shorter than "
                      f"steps = {t.steps}", "the learning rate would never reach its peak")
    if t.lr_schedule.kind == "constant" and t.lr_schedule.min_lr:
        yield Problem("train.lr_schedule", "min_lr does nothing with a constant schedule",
                      "use cosine(...) or remove min_lr")
    if t.lr_schedule.kind == "cosine" and t.lr_schedule.min_lr > t.optimizer.lr:
        yield Problem("train.lr_schedule.min_lr",
                      f"min_lr = {t.lr_schedule.min_lr:g} is above lr = {t.optimizer.lr:g}",
                      "cosine decays from lr down to min_lr")
    opt = t.optimizer
    if opt.name == "adamw" and opt.momentum != _default(OptimizerSpec, "momentum"):
        yield Problem("train.optimizer", "momentum does nothing with adamw", "use sgd(...)")
    if opt.name == "sgd" and (opt.betas != _default(OptimizerSpec, "betas")
                              or opt.eps != _default(OptimizerSpec, "eps")):
        yield Problem("train.optimizer", "betas and eps do nothing with sgd", "use adamw(...)")
    if t.checkpoint is not None and t.checkpoint.every > t.steps:
        yield Problem("train.checkpoint.every",
                      f"checkpoint every {t.checkpoint.every} steps, but training runs "
                      f"{t.steps}: none would be written", f"use every <= {t.steps}")


# -- data vs model
@check("data", "model.args")
def _data(plan: Plan) -> Iterator[Problem]:
    d, args = plan.data, plan.model.args
    vocab, seq_len = args.get("vocab"), args.get("seq_len")
    if d.kind == "synthetic" and _is_int(vocab) and d.vocab > vocab:
        yield Problem(where(plan, "data.vocab", "data", "model.args.vocab"),
                      f"synthetic tokens go up to {d.vocab - 1} but model.args.vocab = {vocab}",
                      f"set data = synthetic(vocab = {vocab}); the default is "
                      f"{_default(type(d), 'vocab')}")
    if _is_int(seq_len) and d.seq_len > seq_len:
        yield Problem(where(plan, "data.seq_len", "data", "model.args.seq_len"),
                      f"data.seq_len = {d.seq_len} is longer than model.args.seq_len = {seq_len}",
                      f"set data = synthetic(seq_len = {seq_len}) or tokens(..., seq_len <= "
                      f"{seq_len}); the default is {_default(type(d), 'seq_len')}")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


# ---------------------------------------------------------------- running
def launcher_world_size(plan: Plan, world_size: Optional[int]) -> Iterator[Problem]:
    if world_size is not None and world_size != plan.mesh.world_size:
        m = plan.mesh
        yield Problem("mesh", f"the plan needs pp*dp*tp = {m.pp}*{m.dp}*{m.tp} = "
                              f"{m.world_size} ranks but the launcher started {world_size}",
                      f"launch {m.world_size} processes, or change the mesh to multiply to "
                      f"{world_size}")


def find_problems(plan: Plan, world_size: Optional[int] = None,
                  failed: frozenset[str] = frozenset()) -> list[Diagnostic]:
    """Every problem of every check whose inputs read cleanly, as diagnostics."""
    def skipped(c: Check) -> bool:
        return any(f == r or f.startswith(r + ".") or r.startswith(f + ".")
                   for f in failed for r in c.reads)

    problems: list[Problem] = []
    if plan.pipeline.schedule not in KINDS_TABLE:  # only a Plan built in code gets here
        failed = failed | {"pipeline.schedule"}
        problems.append(Problem("pipeline.schedule",
                                f"unknown schedule '{plan.pipeline.schedule}'",
                                "one of " + " ".join(KINDS)))
    problems += [p for c in CHECKS if not skipped(c) for p in c.run(plan)]
    if not any(f.startswith("mesh") for f in failed):
        problems += launcher_world_size(plan, world_size)
    return [Diagnostic(p.message, plan.span_of(p.key), p.hint) for p in problems]


def resolve(plan: Plan, parsed: bool = False) -> Plan:
    """Fill what the plan leaves open, from its schedule kind: the microbatch count
    (when neither count nor size is given) becomes the kind's minimum, so
    `plan.microbatches` always works; in a `parsed` plan, `virtual` (when the
    file does not say) becomes the kind's natural stages per rank (2 for zbv)."""
    p = plan.pipeline
    if p.schedule not in KINDS_TABLE:
        return plan
    if parsed and "pipeline.virtual" not in plan.spans:
        p = dataclasses.replace(p, virtual=KINDS_TABLE[p.schedule].natural_virtual)
    if p.microbatches is None and p.microbatch_size is None:
        p = dataclasses.replace(p, microbatches=min_microbatches(p.schedule, plan.mesh.pp))
    return dataclasses.replace(plan, pipeline=p)


def check_plan(plan: Plan, world_size: Optional[int] = None) -> None:
    """Semantic checks (also run by load_plan / parse_plan); raise PlanError with all problems.

    `world_size` is the launcher's, when known: the plan must use exactly that many ranks.
    """
    diagnostics = find_problems(resolve(plan), world_size)
    if diagnostics:
        raise PlanError(diagnostics, plan.source_text or None, plan.sources)
