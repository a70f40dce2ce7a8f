"""Branch and bound over the plan space: every candidate bounded, the best evaluated in order.

1. Measure the model once per rewrite (units.measure).
2. Enumerate the space (space.enumerate_space) under the user's constraints, and for each
   candidate recomputing on every rank of a pipeline, the same recomputing only on the
   first ranks that would not fit without it (`recompute_where_it_pays`).
3. Bound every candidate (cost.lower_bound): a step time no schedule beats and the bytes its
   fullest rank holds at least. A candidate over the memory capacity is dropped here.
4. Evaluate in increasing bound order (cost.predict: schedule generated and simulated),
   keeping the K fastest that fit, and skipping a candidate whose tighter bound
   (cost.step_bound: the optimizer pass and a DP reduction added) is no better than the
   K-th best; stop when the next bound is no better than the K-th
   best (then no unevaluated candidate can enter the top K: the result is the exhaustive
   optimum of the space) or after `max_evals` evaluations (then the report says so).
Ties break on the candidate's fields, so the same input gives the same output everywhere;
nothing reads the clock (the CLI times the search from outside).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from ..compiler.estimate.device import DeviceModel
from ..dsl.ast import Plan
from ..dsl.checks import find_problems
from .cost import Prediction, held_bytes, lower_bound, predict, step_bound
from .space import Candidate, Constraints, divisors, enumerate_space, plan_of, \
    recompute_pattern
from .units import Units, measure


@dataclass(frozen=True)
class Ranked:
    candidate: Candidate
    prediction: Prediction


@dataclass
class SearchResult:
    top: list  # Ranked, fastest first
    units: Units
    enumerated: int = 0
    over_memory: int = 0  # dropped by the memory bound
    evaluated: int = 0
    pruned: int = 0  # skipped before evaluation by cost.step_bound
    over_memory_evaluated: int = 0  # evaluated, then over capacity
    refused: int = 0  # evaluated candidates `check` refuses (none expected)
    closed: bool = False  # the bound proved no unevaluated candidate enters the top K
    not_considered: dict = field(default_factory=dict)  # reason -> values
    capacity: float = 0.0
    gpus: int = 0


def search(plan: Plan, gpus: int, device: DeviceModel, capacity_bytes: float,
           cons: Optional[Constraints] = None, top_k: int = 10, max_evals: int = 2000,
           progress: bool = False, units: Optional[Units] = None) -> SearchResult:
    """The top `top_k` candidates that fit `capacity_bytes` (less the headroom). `units`: the
    model already measured for this plan (units.measure), else it is measured here."""
    cons = cons or Constraints()
    rpn = device.ranks_per_node or gpus
    tp_values = tuple(t for t in divisors(gpus) if t <= rpn or not cons.tp_in_node)
    cp_values = (1,) if cons.fixed.get("cp", 0) == 1 or plan.experts is not None else \
        tuple(c for c in divisors(gpus) if c <= 8)
    bar = _bar(progress)
    pattern = recompute_pattern(_blocks(plan))
    units = units or measure(plan, tp_values, cp_values, pattern,
                             progress=(lambda s: bar.write(s)) if bar else None)
    result = SearchResult([], units, capacity=capacity_bytes * (1 - cons.headroom), gpus=gpus)
    cands = enumerate_space(plan, gpus, len(units.blocks), cons, rpn, units.refused,
                            pattern is not None, result.not_considered,
                            frozenset(("cp", c) for c in cp_values))
    cands += recompute_where_it_pays(units, cands, device, result.capacity)
    result.enumerated = len(cands)
    bounded = []
    for c in _iter(cands, progress, "bounding"):
        lb, held = lower_bound(units, c, device)
        if held > result.capacity:
            result.over_memory += 1
        else:
            bounded.append((lb, c))
    # `auto` searches orders (the slowest to evaluate, and never slower than the fixed kinds
    # it includes): the fixed kinds first, then auto under the bound they leave
    bounded.sort(key=lambda b: (b[1].schedule == "auto", b))
    top: list[Ranked] = []
    has_auto = any(b[1].schedule == "auto" for b in bounded)
    for lb, c in _iter(bounded, progress, "evaluating", total=min(len(bounded), max_evals)):
        if len(top) >= top_k and lb >= top[-1].prediction.step_time_s:
            if c.schedule == "auto" or not has_auto:
                result.closed = True
                break
            continue  # the fixed kinds are closed; auto's turn
        if len(top) >= top_k and step_bound(units, c, device) >= \
                top[-1].prediction.step_time_s:
            result.pruned += 1  # what follows its pipeline keeps it out of the top K
            continue
        if result.evaluated >= max_evals:
            break
        result.evaluated += 1
        problems = _refusal(plan, units, c, gpus)
        if problems:
            result.refused += 1
            result.not_considered.setdefault(problems, []).append(c.label())
            continue
        p = predict(units, c, device)
        if p.peak_bytes > result.capacity:
            result.over_memory_evaluated += 1
            continue
        top.append(Ranked(dataclasses.replace(c, split=p.split), p))
        top.sort(key=lambda r: (r.prediction.step_time_s, r.candidate))
        del top[top_k:]
    else:
        result.closed = True
    result.top = top
    return result


def recompute_where_it_pays(units: Units, cands: list, device: DeviceModel,
                            capacity: float) -> list:
    """For each candidate recomputing on every rank (a fixed kind, pp > 1): the same with
    recompute on the first k pipeline ranks only, where k covers every rank that does not
    fit without recompute (1F1B-like orders hold the most microbatches on the first ranks),
    when 0 < k < pp. Its split and memory are its own (cost.shape): the search bounds and
    evaluates it like any other."""
    out = []
    for c in cands:
        if c.recompute == "none" or c.schedule == "auto" or c.pp == 1 or c.rc_ranks:
            continue
        held = held_bytes(units, dataclasses.replace(c, recompute="none"), device)
        over = [r for r, b in enumerate(held) if b > capacity]
        if over and over[-1] + 1 < c.pp:
            out.append(dataclasses.replace(c, rc_ranks=over[-1] + 1))
    return out


def _refusal(plan: Plan, units: Units, c: Candidate, gpus: int) -> Optional[str]:
    """What `pipeplan check`'s plan checks say about the candidate's plan (None: nothing)."""
    problems = list(find_problems(plan_of(plan, c, units.blocks,
                                          tuple(range(1, c.pp * c.virtual))), gpus))
    return "; ".join(sorted({p.message for p in problems})) or None


def _blocks(plan: Plan) -> tuple[str, ...]:
    from ..compiler.capture.blocks import blocks_of
    from ..compiler.capture.loading import load_model
    return tuple(blocks_of(load_model(plan, "meta")))


def _bar(progress: bool):
    if not progress:
        return None
    from tqdm import tqdm
    return tqdm


def _iter(items, progress: bool, what: str, total: Optional[int] = None):
    if not progress:
        return items
    from tqdm import tqdm
    return tqdm(items, desc=what, total=total, leave=False, mininterval=0.5)
