"""The classic fixed orders: GPipe, 1F1B (Megatron/PipeDream-flush) and interleaved 1F1B.

All use the loop placement (stage s on rank s % p) and a full backward BW.
"""
from __future__ import annotations

import dataclasses

from .costs import Costs
from .errors import ScheduleError
from .execution import analyze
from .simulate import simulate
from .gen_greedy import Policy, Stall, list_schedule
from .ir import BW, F, Action, Schedule, loop_placement


def gpipe(ranks: int, microbatches: int, virtual: int = 1) -> Schedule:
    """All forwards, then all backwards (reverse stage order per microbatch)."""
    placement = loop_placement(ranks, virtual)
    order = []
    for r in range(ranks):
        mine = [s for s, q in enumerate(placement) if q == r]
        fwd = [Action(F, s, mb) for mb in range(microbatches) for s in mine]
        bwd = [Action(BW, s, mb) for mb in range(microbatches) for s in reversed(mine)]
        order.append(tuple(fwd + bwd))
    return Schedule("gpipe", ranks, len(placement), microbatches, placement, tuple(order))


def one_f_one_b(ranks: int, microbatches: int) -> Schedule:
    """Rank r warms up with p-r-1 forwards, then alternates F and BW, then drains.

    Peak activations: min(m, p - r) microbatches on rank r.
    """
    order = []
    for r in range(ranks):
        warm = min(ranks - r - 1, microbatches)
        actions = [Action(F, r, mb) for mb in range(warm)]
        for k in range(microbatches - warm):
            actions += [Action(F, r, warm + k), Action(BW, r, k)]
        actions += [Action(BW, r, mb) for mb in range(microbatches - warm, microbatches)]
        order.append(tuple(actions))
    return Schedule("1f1b", ranks, ranks, microbatches, loop_placement(ranks, 1), tuple(order))


def interleaved(ranks: int, microbatches: int, virtual: int) -> Schedule:
    """Megatron's interleaved 1F1B over v laps of the ranks (depth-first in groups of microbatches).

    Forwards go group by group, chunk by chunk within a group; backwards mirror
    that with chunks reversed. Rank r warms up with 2(p-r-1) + (v-1)·g forwards
    (g = group size), then alternates F and BW. Groups have p microbatches; when p
    does not divide m they are m // p near-equal groups (size >= p): equal sizes keep
    the closed form (torch's rule as well); otherwise the shortest (unit costs) verified of: a
    smaller first group then groups of p (closed form), the near-equal groups'
    sequences merged by the list scheduler at unit costs under the same warm-up
    memory, one group of all m microbatches, and last GPipe's order on the same placement.
    """
    p, v, m = ranks, virtual, microbatches
    groups = _groups(m, min(p, m))
    if len({len(grp) for grp in groups}) == 1:  # torch's rule too: equal rounds of >= p microbatches
        return _interleaved_closed(p, v, m, groups)
    rem = m % p
    small_first = [range(rem)] + [range(rem + k * p, rem + (k + 1) * p) for k in range(m // p)]
    attempts = (lambda: _interleaved_closed(p, v, m, small_first),
                lambda: _interleaved_merged(p, v, m, groups),
                lambda: _interleaved_closed(p, v, m, [range(m)]),
                lambda: gpipe(p, m, v))
    valid = []
    for attempt in attempts:
        try:
            schedule = attempt()
            analyze(schedule)
        except (Stall, ScheduleError):
            continue
        valid.append((simulate(schedule).makespan, len(valid), schedule))
    if valid:
        return dataclasses.replace(min(valid)[2], name="interleaved")
    raise ScheduleError(f"interleaved: no valid order for {p} ranks, {m} microbatches, v={v}; "
                        f"use a multiple of {p} microbatches")


def _sequences(p: int, v: int, groups: list[range]):
    fwd = [tuple((r + j * p, mb) for grp in groups for j in range(v) for mb in grp) for r in range(p)]
    bwd = [tuple((r + j * p, mb) for grp in groups for j in reversed(range(v)) for mb in grp)
           for r in range(p)]
    g = max(len(grp) for grp in groups)
    warms = [min(2 * (p - r - 1) + (v - 1) * g, len(fwd[0])) for r in range(p)]
    return fwd, bwd, warms


def _interleaved_closed(p: int, v: int, m: int, groups: list[range]) -> Schedule:
    fwd_seq, bwd_seq, warms = _sequences(p, v, groups)
    order = []
    for r in range(p):
        fwd = [Action(F, s, mb) for s, mb in fwd_seq[r]]
        bwd = [Action(BW, s, mb) for s, mb in bwd_seq[r]]
        warm = warms[r]
        actions = fwd[:warm]
        for k in range(len(fwd) - warm):
            actions += [fwd[warm + k], bwd[k]]
        actions += bwd[len(fwd) - warm:]
        order.append(tuple(actions))
    return Schedule("interleaved", p, p * v, m, loop_placement(p, v), tuple(order))


def _interleaved_merged(p: int, v: int, m: int, groups: list[range]) -> Schedule:
    fwd_seq, bwd_seq, warms = _sequences(p, v, groups)
    placement = loop_placement(p, v)
    policy = Policy(split=False, limits=tuple((w + 1) / v for w in warms),
                    fwd_seq=tuple(fwd_seq), bwd_seq=tuple(bwd_seq))
    return list_schedule("interleaved", placement, m, Costs().stage_table(placement), policy)


def _groups(m: int, p: int) -> list[range]:
    """Microbatch groups of size p, or m // p near-equal groups of size >= p when p does not divide m."""
    n = max(1, m // p)
    bounds = [round(k * m / n) for k in range(n + 1)]
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]
