"""Activation memory accounting, one definition for the verifier, simulator and generators.

Unit: one microbatch's activations for a rank's whole share of the layers.
With n stages on a rank, F of one stage adds 1/n. The activations stay until
the stage's weight gradient is done: W (or BW) frees them; B frees nothing,
because autograd keeps the whole saved graph alive until the weight gradient
has used it. So a split backward trades bubble for memory held between B and W.
"""
from __future__ import annotations

from .ir import B, BW, F, W, Schedule


def stage_share(schedule: Schedule) -> tuple[float, ...]:
    """Activation units one stage's F adds: 1 / (stages on its rank)."""
    per_rank = schedule.stages_per_rank()
    return tuple(1.0 / per_rank[r] for r in schedule.stage_to_rank)


def delta(op: str, share: float) -> float:
    """Change in held activations when an op of a stage with this share runs."""
    if op == F:
        return share
    if op in (W, BW):
        return -share
    return 0.0


def peak_per_rank(schedule: Schedule) -> tuple[tuple[float, ...], tuple[int, ...]]:
    """Peak held activations per rank, and the position in the rank's list where it is first reached."""
    peaks, where = held_peaks(schedule, stage_share(schedule))
    return tuple(round(p, 9) for p in peaks), where


def held_peaks(schedule: Schedule, amounts) -> tuple[tuple[float, ...], tuple[int, ...]]:
    """Per rank, the peak of what F adds (`amounts[stage]`: a share of the rank's layers,
    or bytes: compiler/estimate/estimates.py) and W or BW frees, and the first position
    in the rank's list where it is reached."""
    peaks, where = [], []
    for actions in schedule.order:
        held, peak, at = 0.0, 0.0, -1
        for i, a in enumerate(actions):
            op = a.op
            if op == F:
                held += amounts[a.stage]
                if held > peak + 1e-9:
                    peak, at = held, i
            elif op != B:  # W or BW
                held -= amounts[a.stage]
        peaks.append(peak)
        where.append(at)
    return tuple(peaks), tuple(where)


def held_states(schedule: Schedule) -> tuple:
    """Per rank, (its stages, the microbatches of each it holds after each F that no other
    such state holds at least as many of, stage by stage): what `held_peaks` needs of the
    order, walked once, for a caller asking it of many `amounts` (the planner's memory
    bound: one order, many candidates' bytes)."""
    out = []
    for actions in schedule.order:
        stages = tuple(sorted({a.stage for a in actions}))
        if len(stages) == 1:  # one stage: its peak count is the one undominated state
            out.append((stages, ((_peak_count(actions),),)))
            continue
        at = {s: i for i, s in enumerate(stages)}
        count, seen = [0] * len(stages), set()
        for a in actions:
            op = a.op
            if op == F:
                count[at[a.stage]] += 1
                seen.add(tuple(count))
            elif op != B:  # W or BW
                count[at[a.stage]] -= 1
        top = []  # a state's dominators sort before it, so comparing with those kept suffices
        for c in sorted(seen, reverse=True):
            if not any(all(x >= y for x, y in zip(o, c)) for o in top):
                top.append(c)
        out.append((stages, tuple(sorted(top))))
    return tuple(out)


def _peak_count(actions) -> int:
    held = peak = 0
    for a in actions:
        op = a.op
        if op == F:
            held += 1
            if held > peak:
                peak = held
        elif op != B:  # W or BW
            held -= 1
    return peak


def peaks_of(states: tuple, amounts) -> tuple[float, ...]:
    """`held_peaks(schedule, amounts)[0]` from `held_states(schedule)`: the same peaks for
    nonnegative amounts (exactly, where they are whole numbers of bytes)."""
    return tuple(max((sum(n * amounts[s] for n, s in zip(c, stages)) for c in top),
                     default=0.0) if top else 0.0 for stages, top in states)


def peak_until_b(schedule: Schedule) -> tuple[float, ...]:
    """Peak per rank if activations were freed at B (BW) instead of W: the count frameworks that
    free the input-gradient graph early report; shown next to pipeplan's own (until W)."""
    share = stage_share(schedule)
    peaks = []
    for actions in schedule.order:
        held = peak = 0.0
        for a in actions:
            if a.op == F:
                held += share[a.stage]
                peak = max(peak, held)
            elif a.op != W:  # B or BW
                held -= share[a.stage]
        peaks.append(round(peak, 9))
    return tuple(peaks)
