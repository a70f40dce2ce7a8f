"""The plan space: which candidates exist for a model on N GPUs, and the plan each one is.

A `Candidate` names every choice the search makes: mesh (pp, dp, tp, cp, ep), schedule
kind and stages per rank, microbatch size and count, sequence parallel, recompute mode,
ZeRO stage (the split follows from them: cost.balanced_split). `enumerate_space` lists
them in a fixed order under the user's constraints and the rules `pipeplan check` applies
(schedules/kinds.py for the kinds; divisibility of the batch, experts and sequence), and
says once per reason what it left out. `plan_of` turns a candidate into the Plan
(dataclasses.replace on the user's plan), which dsl/format.py writes.
"""
from __future__ import annotations

import dataclasses
import functools
import re
from dataclasses import dataclass, field
from typing import Optional

from ..dsl.ast import ContextSpec, MemoryLimit, MeshSpec, Plan, RecomputeRule, SplitSpec
from ..schedules.kinds import KINDS, KINDS_TABLE, min_microbatches

V_KINDS = tuple(k for k, kind in KINDS_TABLE.items() if kind.placement == "V")
AUTO_ACTIONS = 20_000  # schedules/gen_auto.py's BIG: above it auto keeps few variants
MAX_INTERLEAVE = 4  # interleaved: virtual 2..4 (Narayanan et al. 2021 use 2-4 chunks per rank)


@dataclass(frozen=True, order=True)
class Candidate:
    pp: int
    dp: int
    tp: int
    cp: int
    ep: int
    schedule: str
    virtual: int
    mbs: int  # sequences per microbatch
    microbatches: int  # per dp rank per step
    sp: bool
    recompute: str  # none | selective | full, on every layer
    zero: int
    split: tuple[int, ...] = ()  # filled by the cost model: unit where stages 1.. begin
    rc_ranks: int = 0  # `recompute` on the stages of pipeline ranks < rc_ranks only (the
    # ranks holding the most microbatches); 0: on every rank (search.py derives it)
    memory_limit: int = 0  # auto: at most this many microbatches' activations per rank
    # (the plan's pipeline.memory_limit, what the device holds beside the states:
    # cost.auto_memory_limit, set by the search before evaluating); 0: none

    def label(self) -> str:
        v = f" v{self.virtual}" if self.virtual > 1 else ""
        extra = "".join(f" {k}{getattr(self, k)}" for k in ("cp", "ep") if getattr(self, k) > 1)
        return (f"pp{self.pp} tp{self.tp} dp{self.dp}{extra} {self.schedule}{v} "
                f"mbs{self.mbs}x{self.microbatches}{' sp' if self.sp else ''} "
                f"rc={self.recompute}{f' on ranks<{self.rc_ranks}' if self.rc_ranks else ''} "
                f"z{self.zero}{f' mem<={self.memory_limit}' if self.memory_limit else ''}")


@dataclass(frozen=True)
class Constraints:
    """What the user fixes or limits (`pipeplan plan --set ... --max-pp ...`)."""

    fixed: dict = field(default_factory=dict)  # Candidate field -> value
    max_pp: Optional[int] = None
    schedules: tuple[str, ...] = KINDS
    no_recompute: bool = False  # must fit without recompute
    headroom: float = 0.0  # fraction of device memory left free
    tp_in_node: bool = True  # tp no larger than ranks_per_node


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def recompute_pattern(blocks: tuple[str, ...]) -> Optional[str]:
    """The layer stack's pattern (`layers.*`): the prefix most blocks share before an index."""
    prefixes = [b.rpartition(".")[0] for b in blocks if b.rpartition(".")[2].isdigit()]
    if not prefixes:
        return None
    best = max(sorted(set(prefixes)), key=prefixes.count)
    return f"{best}.*"


@functools.lru_cache(maxsize=1024)
def _numbers_masked(reason: str) -> str:
    return re.sub(r"\d+", "#", reason)


def note(not_considered: dict, reason: str, what: str) -> None:
    """List `what` (a value such as "cp=4") under `reason` in "not considered". A reason that
    differs from a listed one only in its numbers (the local length a refusal names: "holds 8
    rows" at cp = 2, 4 at cp = 4) is that reason: the value joins it, so each reason is
    listed once."""
    shape = _numbers_masked(reason)
    key = next((r for r in not_considered if _numbers_masked(r) == shape), reason)
    values = not_considered.setdefault(key, [])
    if what not in values:
        values.append(what)


def enumerate_space(plan: Plan, gpus: int, units: int, cons: Constraints,
                    ranks_per_node: int, refused: dict, has_pattern: bool,
                    not_considered: dict, measured: frozenset = frozenset()) -> list[Candidate]:
    """Every candidate in a fixed order. `units`: blocks of the model (stages ≤ units);
    `refused`: ("tp"|"cp"|"sp", value) -> the compiler's reason ("sp": sequence parallel at
    that tp); `measured`: the ("cp", value)
    pairs the compiler's checks ran on; reasons for what is left out are
    added to `not_considered` (reason -> values)."""
    def skip(reason: str, what: str) -> None:
        note(not_considered, reason, what)

    fx = cons.fixed
    gb, seq = plan.train.global_batch, plan.data.seq_len
    ex = plan.experts
    out = []
    for tp in divisors(gpus):
        if not _ok(fx, "tp", tp):
            continue
        if cons.tp_in_node and tp > ranks_per_node:
            skip(f"tp larger than the {ranks_per_node} ranks of a node", f"tp={tp}")
            continue
        if ("tp", tp) in refused:
            skip(refused[("tp", tp)], f"tp={tp}")
            continue
        for cp in divisors(gpus // tp):
            if not _ok(fx, "cp", cp):
                continue
            if cp > 1 and (("cp", cp) in refused or ("cp", cp) not in measured or ex is not None
                           or seq % cp):
                skip(refused.get(("cp", cp)) or ("cp with experts is not supported" if ex
                     else f"cp does not divide seq_len {seq}" if seq % cp else
                     "cp above 8 (not searched)"), f"cp={cp}")
                continue
            if ("tp x cp", tp, cp) in refused:
                skip(refused[("tp x cp", tp, cp)], f"tp={tp} cp={cp}")
                continue
            for pp in divisors(gpus // (tp * cp)):
                if not _ok(fx, "pp", pp):
                    continue
                if cons.max_pp is not None and pp > cons.max_pp:
                    skip(f"pipeline deeper than --max-pp {cons.max_pp}", f"pp={pp}")
                    continue
                if pp > units:
                    skip(f"more pipeline ranks than the model's {units} blocks", f"pp={pp}")
                    continue
                dp = gpus // (tp * cp * pp)
                if not _ok(fx, "dp", dp):
                    continue
                if gb % dp:
                    skip(f"global_batch {gb} not divisible by dp", f"dp={dp}")
                    continue
                out.extend(_inner(plan, fx, cons, tp, cp, pp, dp, units, has_pattern, skip,
                                  refused.get(("sp", tp))))
    return out


def _inner(plan, fx, cons, tp, cp, pp, dp, units, has_pattern, skip, no_sp=None):
    """`no_sp`: the compiler's reason for refusing sequence parallel at this tp (None: none)."""
    ex = plan.experts
    eps = [e for e in divisors(dp) if ex is not None and ex.num_experts % e == 0] or [1]
    for ep in eps:
        if not _ok(fx, "ep", ep):
            continue
        for kind, virtual in _kinds(cons, pp):
            if pp * virtual > units:
                skip("more stages (pp x virtual) than the model's blocks",
                     f"pp={pp} {kind} v{virtual}")
                continue
            if not _ok(fx, "schedule", kind) or not _ok(fx, "virtual", virtual):
                continue
            for mbs in divisors(plan.train.global_batch // dp):
                m = plan.train.global_batch // dp // mbs
                if not _ok(fx, "mbs", mbs) or not _ok(fx, "microbatches", m):
                    continue
                if m < min_microbatches(kind, pp):
                    continue  # the kinds table's minimum (dualpipev: 2 pp)
                if kind == "auto" and 3 * pp * virtual * m > AUTO_ACTIONS:
                    skip(f"schedule auto above {AUTO_ACTIONS} actions (3 x stages x "
                         "microbatches): there it runs only the fixed kinds the planner "
                         "tries itself, at seconds per run", f"pp={pp} v{virtual} m={m}")
                    continue
                for sp in ((False, True) if tp > 1 and ex is None else (False,)):
                    if sp and no_sp:
                        skip(no_sp, f"tp={tp} sp")
                        continue
                    if not _ok(fx, "sp", sp):
                        continue
                    modes = ("none",) if cons.no_recompute or not has_pattern else \
                        ("none", "selective", "full")
                    for rc in modes:
                        if not _ok(fx, "recompute", rc):
                            continue
                        for z in ((0, 1, 2, 3) if dp > 1 else (0,)):
                            if _ok(fx, "zero", z):
                                yield Candidate(pp, dp, tp, cp, ep, kind, virtual, mbs, m,
                                                sp, rc, z)


def _kinds(cons: Constraints, pp: int):
    """(kind, virtual) pairs: every allowed kind at each stages-per-rank it takes. With one
    pipeline rank the kinds coincide but for memory: 1f1b (one microbatch held), or gpipe
    (all of them, the same step) only where 1f1b is not allowed."""
    for kind in cons.schedules:
        if pp == 1 and kind != ("1f1b" if "1f1b" in cons.schedules else "gpipe"):
            continue
        rule = KINDS_TABLE[kind]
        top = rule.max_virtual if rule.max_virtual is not None else MAX_INTERLEAVE
        if kind == "gpipe" or pp == 1:
            top = 1
        for v in range(rule.min_virtual, top + 1):
            yield kind, v


def _ok(fixed: dict, key: str, value) -> bool:
    return key not in fixed or fixed[key] == value


def plan_of(plan: Plan, c: Candidate, blocks: tuple[str, ...],
            split: Optional[tuple[int, ...]] = None) -> Plan:
    """The user's plan with every choice of `c` written in (the split as block names). The
    pipeline section is the search's: a memory limit only where `c` has one (auto), and no
    measured profile or relative costs (the search estimates its own stages: a file's costs
    describe another layout's stages)."""
    split = c.split if split is None else split
    pattern = recompute_pattern(blocks)
    rules = () if c.recompute == "none" or pattern is None else \
        (RecomputeRule(pattern, c.recompute),) if not c.rc_ranks else \
        tuple(RecomputeRule(blocks[i], c.recompute) for i in recomputed_units(c, blocks, split))
    t = plan.tensor
    named = bool(t.column or t.row or t.vocab)
    # tp > 1 and no patterns: the model's own plan, as the compiler takes it, written out
    tensor = dataclasses.replace(t, plan="model" if not named and t.plan is None else t.plan) \
        if c.tp > 1 else dataclasses.replace(t, column=(), row=(), vocab=(), plan=None)
    tensor = dataclasses.replace(tensor, sequence_parallel=c.sp and c.tp > 1)
    spec = SplitSpec("points", points=tuple(blocks[i] for i in split)) if split else \
        SplitSpec("points", points=()) if c.pp * c.virtual == 1 else SplitSpec()
    return dataclasses.replace(
        plan, mesh=MeshSpec(pp=c.pp, dp=c.dp, tp=c.tp, ep=c.ep, cp=c.cp),
        pipeline=dataclasses.replace(plan.pipeline, schedule=c.schedule,
                                     microbatches=c.microbatches, microbatch_size=None,
                                     virtual=c.virtual, split=spec,
                                     memory_limit=MemoryLimit(float(c.memory_limit))
                                     if c.memory_limit else None,
                                     profile=None, costs=None),
        tensor=tensor, recompute=rules, zero=c.zero,
        context=(plan.context or ContextSpec()) if c.cp > 1 else None)


def placement(kind: str, pp: int, stages: int) -> tuple[int, ...]:
    """Stage -> pipeline rank before the schedule is generated: the V for V kinds, else the
    loop (auto decides at generation; its bound takes the lighter of the two)."""
    if kind in V_KINDS:
        return tuple(s if s < pp else 2 * pp - 1 - s for s in range(stages))
    return tuple(s % pp for s in range(stages))


def on_recompute_rank(c: Candidate, blocks: int, split: tuple[int, ...]) -> list[bool]:
    """Per unit: does `c`'s recompute apply to it (its stage on a rank < rc_ranks)?"""
    place = placement(c.schedule, c.pp, c.pp * c.virtual)
    bounds = (0,) + tuple(split) + (blocks,)
    out = [False] * blocks
    for s, (a, b) in enumerate(zip(bounds, bounds[1:])):
        for i in range(a, b):
            out[i] = not c.rc_ranks or place[s] < c.rc_ranks
    return out


def recomputed_units(c: Candidate, blocks: tuple[str, ...], split: tuple[int, ...]) -> list:
    """Indices of the layer blocks (the recompute pattern's) `c` recomputes."""
    pattern = recompute_pattern(blocks)
    stack = pattern[:-2] if pattern else None
    return [i for i, on in enumerate(on_recompute_rank(c, len(blocks), split))
            if on and blocks[i].rpartition(".")[0] == stack
            and blocks[i].rpartition(".")[2].isdigit()]
