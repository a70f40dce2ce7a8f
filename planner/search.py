"""Branch and bound over the plan space: every candidate bounded, the best evaluated in order.

1. Measure the model once per rewrite (units.measure): at cp = 1 now; each other cp value
   (its capture and the compiler's cp checks) when the search first reaches one of its
   candidates.
2. Enumerate the space (space.enumerate_space) under the user's constraints.
3. Drop every candidate whose state bytes alone, shared evenly over the pipeline, are
   over the memory capacity (cost.quick_held); queue the others under their quick bound
   (cost.quick_bound: the pipeline's compute shared evenly, from the unit tables alone), and for each candidate recomputing on every
   rank of a pipeline a stand-in for the same recomputing only on the first ranks that
   would not fit without it (`recompute_where_it_pays`, decided when the stand-in is
   reached).
4. Pop the least bound. A candidate under its quick bound is bounded again on its own
   stages (cost.time_bound: a step time no schedule beats; an `auto` candidate first gets
   the activations left beside its states as its memory limit, cost.auto_memory_limit,
   which its bound then reads) and queued again; popped under that bound, the bytes its
   fullest rank holds at least (cost.held_bytes: a walk of a fixed kind's order) drop it
   when over the memory capacity, else it is queued once more; a candidate under that
   bound is evaluated (cost.predict: schedule generated and simulated), keeping the K
   fastest that fit, unless its tighter bound (cost.step_bound: the optimizer pass and a DP
   reduction added) is no better than the K-th best. Each refinement only raises a bound,
   so candidates are evaluated in increasing order of lower_bound, as if every one had
   been bounded first, and most are never bounded on their stages.
5. Stop when the least bound is no better than the K-th best (then no candidate left can
   enter the top K: the result is the exhaustive optimum of the space), or after
   `max_evals` evaluations, or when only `auto` candidates are left and `max_auto` of them
   were evaluated (each is a schedule search: seconds at these depths); then the report
   says the search was not closed.
Ties break on the candidate's fields, so the same input gives the same output everywhere;
nothing reads the clock (the CLI times the search from outside). On two cores, while an
`auto` candidate is evaluated, a forked child predicts the one the search would evaluate
next (`_ahead`); its prediction is used only when the search reaches that very candidate,
so the result is the same as without it. Before that, while the fixed kinds are searched,
two forked children build the orders the stand-ins will read, in the order the search
pops them (`_orders_ahead`, forked.Stream): the search takes each from them when it asks,
or builds it itself -- the same held states either way.
"""
from __future__ import annotations

import dataclasses
import heapq
import math
from dataclasses import dataclass, field
from typing import Optional

from ..compiler.capture.blocks import blocks_of
from ..compiler.capture.loading import load_model
from ..compiler.estimate.device import DeviceModel
from ..dsl.ast import Plan
from ..dsl.checks import find_problems
from . import forked
from .cost import Prediction, auto_memory_limit, held_bytes, held_states_key, order, \
    order_held_states, predict, quick_bound, quick_held, step_bound, time_bound
from .space import Candidate, Constraints, divisors, enumerate_space, note, plan_of, \
    recompute_pattern
from .units import Units, measure


MAX_AUTO = 12  # auto evaluations at most: each is a schedule search under the memory left
# beside the states (seconds at pp 8: its local search rarely meets the bound there)
_WHERE, _QUICK, _TIMED, _BOUNDED = 0, 1, 2, 3  # how far a queued candidate is refined
_LOOKAHEAD = 64  # queued auto candidates bounded at most to find the next one to evaluate


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
    auto_evaluated: int = 0  # of `evaluated`, schedule kind auto (at most max_auto)
    auto_capped: bool = False  # stopped at max_auto with auto candidates left under the bound
    refused: int = 0  # evaluated candidates `check` refuses (none expected)
    twins: int = 0  # evaluated, the same order as a listed plan's under another kind (_twin)
    zero_ties: int = 0  # evaluated, a listed plan's layout at another ZeRO stage, as fast
    closed: bool = False  # the bound proved no unevaluated candidate enters the top K
    not_considered: dict = field(default_factory=dict)  # reason -> values
    capacity: float = 0.0
    gpus: int = 0


def search(plan: Plan, gpus: int, device: DeviceModel, capacity_bytes: float,
           cons: Optional[Constraints] = None, top_k: int = 10, max_evals: int = 2000,
           progress: bool = False, units: Optional[Units] = None,
           max_auto: int = MAX_AUTO) -> SearchResult:
    """The top `top_k` candidates that fit `capacity_bytes` (less the headroom). `units`: the
    model already measured for this plan (units.measure), else it is measured here. At most
    `max_evals` evaluations, of which at most `max_auto` of schedule kind auto."""
    cons = cons or Constraints()
    rpn = device.ranks_per_node or gpus
    tp_values = tuple(t for t in divisors(gpus) if t <= rpn or not cons.tp_in_node)
    cp_values = (1,) if cons.fixed.get("cp", 0) == 1 or plan.experts is not None else \
        tuple(c for c in divisors(gpus) if c <= 8)
    bar = _bar(progress)
    if units is None:
        model = load_model(plan, "meta")  # loaded once: its blocks, then measured
        pattern = recompute_pattern(tuple(blocks_of(model)))
        units = measure(plan, tp_values, cp_values, pattern,
                        progress=(lambda s: bar.write(s)) if bar else None,
                        check_all_cp=False, model=model)
    else:
        pattern = recompute_pattern(units.blocks)
    result = SearchResult([], units, capacity=capacity_bytes * (1 - cons.headroom), gpus=gpus)
    cands = enumerate_space(plan, gpus, len(units.blocks), cons, rpn, units.refused,
                            pattern is not None, result.not_considered,
                            frozenset(("cp", c) for c in cp_values))
    result.enumerated = len(cands)
    # (auto last, bound, how far it is refined, candidate): `auto` searches orders (the
    # slowest to evaluate, never slower than the fixed kinds it includes), so the fixed
    # kinds come first, then auto under the bound they leave
    fits = [c for c in cands if quick_held(units, c) <= result.capacity]
    result.over_memory = len(cands) - len(fits)
    heap = [(c.schedule == "auto", quick_bound(units, c, device), _QUICK, c)
            for c in _iter(fits, progress, "bounding")]
    heap += [(False, quick_bound(units, r, device), _WHERE, r)
             for r in (_where(c) for c in fits) if r is not None]
    heapq.heapify(heap)
    orders = _orders_ahead(units, heap, device, result.capacity)
    try:
        return _loop(plan, units, heap, device, result, top_k, max_evals, max_auto, gpus,
                     orders, any(c.schedule == "auto" for c in cands), bar)
    finally:
        orders.close()
        units.ahead = None


def _loop(plan: Plan, units: Units, heap: list, device: DeviceModel, result: SearchResult,
          top_k: int, max_evals: int, max_auto: int, gpus: int, orders: forked.Stream,
          has_auto: bool, bar) -> SearchResult:
    """The search proper: pop the queue's least bound; refine it one step, or evaluate it
    once fully bounded, until the K-th best is under every bound left."""
    top: list[Ranked] = []
    ahead: dict = {}  # auto candidate -> the forked child predicting it
    evaluating = bar(desc="evaluating", total=max_evals, leave=False, mininterval=0.5) \
        if bar else None
    while heap:
        is_auto, bound, level, c = heapq.heappop(heap)
        if is_auto and units.ahead is not None:  # no stand-in is left: the core is auto's
            orders.close()
            units.ahead = None
        if len(top) >= top_k and bound >= top[-1].prediction.step_time_s:
            if is_auto or not has_auto:
                result.closed = True
                break
            continue  # the fixed kinds are closed; auto's turn
        if level < _BOUNDED:  # its cp value captured and checked first (once per value)
            reason = units.refusal(c.tp, c.cp)
            if reason:
                alone = reason == units.refused.get(("cp", c.cp))
                note(result.not_considered, reason,
                     f"cp={c.cp}" if alone else f"tp={c.tp} cp={c.cp}")
                continue
        if level == _WHERE:  # recompute on the first ranks only, where it pays
            for r in recompute_where_it_pays(units, [dataclasses.replace(c, rc_ranks=0)],
                                             device, result.capacity):
                result.enumerated += 1
                heapq.heappush(heap, (False, quick_bound(units, r, device), _QUICK, r))
            continue
        if level in (_QUICK, _TIMED):
            again = _refined(units, (is_auto, bound, level, c), device, result.capacity)
            if again is None:
                result.over_memory += 1
            else:
                heapq.heappush(heap, again)
            continue
        if len(top) >= top_k and step_bound(units, c, device) >= \
                top[-1].prediction.step_time_s:
            result.pruned += 1  # what follows its pipeline keeps it out of the top K
            continue
        if result.evaluated >= max_evals:
            break
        if is_auto and result.auto_evaluated >= max_auto:
            result.auto_capped = True
            break  # only auto candidates are left
        result.evaluated += 1
        result.auto_evaluated += is_auto
        if evaluating is not None:
            evaluating.update(1)
        problems = _refusal(plan, units, c, gpus)
        if problems:
            result.refused += 1
            note(result.not_considered, problems, c.label())
            continue
        mine = ahead.pop(c, None)  # this candidate's prediction, made ahead in a child
        if is_auto:  # the next auto candidate in a forked child meanwhile (two cores)
            _ahead(units, heap, top[-1].prediction.step_time_s if len(top) >= top_k else None,
                   device, result.capacity, ahead)
        got = mine.wait() if mine is not None else None
        p = got["prediction"] if got else predict(units, c, device)
        if p.peak_bytes > result.capacity:
            result.over_memory_evaluated += 1
            continue
        if _twin(units, top, c):
            result.twins += 1
            continue
        tied = _zero_tie(units, top, c, p)
        if tied is not None:
            result.zero_ties += 1
            if not _better_of_tied(p, c, tied):
                continue
            top.remove(tied)
        top.append(Ranked(dataclasses.replace(c, split=p.split), p))
        top.sort(key=lambda r: (r.prediction.step_time_s, r.candidate))
        del top[top_k:]
    else:
        result.closed = True
    if evaluating is not None:
        evaluating.close()
    units.settle()
    for child in ahead.values():
        child.cancel()
    result.top = top
    return result


def _twin(units: Units, top: list, c: Candidate) -> bool:
    """Does the top list hold `c`'s layout under another fixed kind whose order is the same
    actions on the same ranks (ZB-H1 and ZB-H2, or 1F1B and GPipe, with too few
    microbatches to differ)? The same run then, listed once: as the kind reached first."""
    return any(r.candidate.schedule != c.schedule and _same_run(units, r.candidate, c)
               for r in top)


ZERO_TIE = 0.01  # ZeRO stages of one run predicted this close are listed once: below the
# time model's resolution (Table 1 within 6%; the CPU's ranks sharing cores 10-15% run to run)


def _zero_tie(units: Units, top: list, c: Candidate, p: Prediction) -> Optional[Ranked]:
    """The listed plan that is `c`'s run (`_same_run`) at another ZeRO stage predicted
    within ZERO_TIE of it, if any (on shared CPU cores the step is often the cores' CPU
    floor, which the stages' reduction patterns leave equal or nearly). Listed once
    (`_better_of_tied`), so the top K holds plans the prediction tells apart."""
    for r in top:
        if r.candidate.zero != c.zero and \
                math.isclose(r.prediction.step_time_s, p.step_time_s, rel_tol=ZERO_TIE) and \
                _same_run(units, dataclasses.replace(r.candidate, zero=c.zero), c):
            return r
    return None


def _better_of_tied(p: Prediction, c: Candidate, tied: Ranked) -> bool:
    """Of two ZeRO stages of one run within ZERO_TIE: the faster (never giving up predicted
    time), and exactly as fast, the one holding less memory (then the lower stage)."""
    q = tied.prediction
    if not math.isclose(p.step_time_s, q.step_time_s, rel_tol=1e-9):
        return p.step_time_s < q.step_time_s
    return (p.peak_bytes, c.zero) < (q.peak_bytes, tied.candidate.zero)


def _same_run(units: Units, o: Candidate, c: Candidate) -> bool:
    """Are `o` and `c` the same layout (their splits aside), under one fixed kind or two
    whose orders are the same actions on the same ranks?"""
    if dataclasses.replace(o, schedule=c.schedule, split=c.split) != c:
        return False
    if o.schedule == c.schedule:
        return True
    if "auto" in (o.schedule, c.schedule):
        return False
    mine, other = order(units, c), order(units, o)
    return mine.order == other.order and mine.stage_to_rank == other.stage_to_rank


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
        plain = dataclasses.replace(c, recompute="none")
        if not _reads_order(units, plain, device, capacity):
            continue
        held = held_bytes(units, plain, device)
        over = [r for r, b in enumerate(held) if b > capacity]
        if over and over[-1] + 1 < c.pp:
            out.append(dataclasses.replace(c, rc_ranks=over[-1] + 1))
    return out


def _reads_order(units: Units, plain: Candidate, device: DeviceModel, capacity: float) -> bool:
    """Does `recompute_where_it_pays` need the kind's order for this candidate without
    recompute? Not when its last rank is over with one microbatch in flight (k would be
    pp): decided without building the order."""
    return held_bytes(units, plain, device, floor=True)[-1] <= capacity


def _orders_ahead(units: Units, heap: list, device: DeviceModel,
                  capacity: float) -> forked.Stream:
    """The fixed kinds' orders the stand-ins will read (their held states), built by two
    forked children in the order the search pops the stand-ins, skipping those it decides
    without an order (`_reads_order`) and any it could not bound without a capture. The
    search takes each from the child when it asks (units.ahead; cost._held_states), or
    builds it itself: the same values, sooner."""
    stand = [e for e in heap if e[2] == _WHERE]
    index: dict = {}
    for e in stand:
        index.setdefault(held_states_key(e[3]), len(index))
    keys = list(index)

    def plan(wanted):
        units.capture = None  # (in the child: it never captures)
        for e in sorted(stand):
            c = e[3]
            if not wanted(index[held_states_key(c)]):
                continue  # (its order is built or being built: no need to bound it here)
            plain = dataclasses.replace(c, recompute="none", rc_ranks=0)
            if c.cp > 1 and (("cp", c.cp) not in units.checked or
                             units.refusal(c.tp, c.cp)):
                continue
            if not units.has(plain.mbs, plain.tp > 1, plain.sp, "none", plain.cp):
                continue
            try:
                if not _reads_order(units, plain, device, capacity):
                    continue
            except Exception:  # (left to the search, which raises it where it belongs)
                continue
            yield index[held_states_key(c)]

    stream = forked.stream(len(keys), plan, lambda i: order_held_states(keys[i]),
                           workers=2 if keys else 0)  # (no stand-in: nothing to fork for)
    units.ahead = lambda key: stream.take(index[key]) if key in index else None
    return stream


def _where(c: Candidate) -> Optional[Candidate]:
    """The stand-in for `c`'s recompute-on-the-first-ranks variants (rc_ranks -1: which
    ranks is decided when it is reached, by `recompute_where_it_pays`), or None."""
    if c.recompute == "none" or c.schedule == "auto" or c.pp == 1 or c.rc_ranks:
        return None
    return dataclasses.replace(c, rc_ranks=-1)


def _refined(units: Units, entry: tuple, device: DeviceModel, capacity: float):
    """A queued candidate bounded one step further: at _QUICK on its own stages (an auto
    candidate first gets the memory left beside its states as its limit: auto searches only
    orders that fit there), at _TIMED by the bytes its fullest rank holds. The entry to queue
    again, or None when it is over memory."""
    is_auto, bound, level, c = entry
    if level == _QUICK:
        if is_auto:
            c = dataclasses.replace(c, memory_limit=auto_memory_limit(units, c, device,
                                                                      capacity))
            if not c.memory_limit:
                return None
        return is_auto, time_bound(units, c, device), _TIMED, c
    if max(held_bytes(units, c, device)) > capacity:
        return None
    return is_auto, bound, _BOUNDED, c


def _ahead(units: Units, heap: list, worst: Optional[float], device: DeviceModel,
           capacity: float, ahead: dict) -> None:
    """While an auto candidate is evaluated here, predict in a forked child the one the
    search will evaluate next if the K-th best stays `worst`: the heap's next auto candidate
    bounded as the search bounds it (_refined, on a copy of the heap; its results are cached,
    so the search's own steps reuse them), one at a time (a guess that missed is stopped).
    Its prediction is used only if the search evaluates that very candidate: the same
    numbers, sooner."""
    for child in ahead.values():
        child.cancel()
    ahead.clear()
    queue = [e for e in heap if e[0]]
    heapq.heapify(queue)
    for _ in range(_LOOKAHEAD):
        if not queue or (worst is not None and queue[0][1] >= worst):
            return
        entry = heapq.heappop(queue)
        c = entry[3]
        if entry[2] == _BOUNDED:
            child = forked.start(lambda: {"prediction": predict(units, c, device)})
            if child is not None:
                ahead[c] = child
            return
        if (c.cp > 1 and ("cp", c.cp) not in units.checked) or units.refusal(c.tp, c.cp):
            continue  # (a cp value not checked yet: its capture is the search's to make)
        again = _refined(units, entry, device, capacity)
        if again is not None:
            heapq.heappush(queue, again)


def _refusal(plan: Plan, units: Units, c: Candidate, gpus: int) -> Optional[str]:
    """What `pipeplan check`'s plan checks say about the candidate's plan (None: nothing)."""
    problems = list(find_problems(plan_of(plan, c, units.blocks,
                                          tuple(range(1, c.pp * c.virtual))), gpus))
    return "; ".join(sorted({p.message for p in problems})) or None


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
