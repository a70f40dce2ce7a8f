"""The zero-bubble family (arXiv 2401.10241) and controllable-memory V schedules (arXiv 2405.15362).

Splitting the backward into B (input gradient, on the critical path) and W
(weight gradient, movable) lets W fill the bubbles. Memory is held from F until
W (see memory.py), so every deferred W costs activation memory; each kind is a
memory budget plus a placement:

  zbh1      loop placement, 1F1B's memory (p): 1F1B order, rank r runs W(k) after B(k+r)
  zbh2      loop placement, 2p-1 units: list-scheduled (forwards fill the warm-up bubble)
  zbv       V placement (v=2): the paper's hand-made ZB-V (torch's ScheduleZBVZeroBubble
            order), bubble (p-1)F/2 at equal costs and m >= 2p. Written for tag-matched
            receives (p units); on pipeplan's in-order channels rank r runs one more
            forward early and holds p + r/2. Under a lower memory limit, zbv_within
            list-schedules the V at the limit instead.
  vhalf     V placement, about half of 1F1B's memory: floor(p/2)+1 units
  vmin      V placement, about a third: floor(p/3)+1 units

Fixed kinds are computed at unit costs (F=B=W per stage), so a kind's order does
not change with the costs; `auto` is the kind that adapts to them.
"""
from __future__ import annotations

from .costs import Costs
from .gen_greedy import Policy, Stall, timed_run
from .ir import B, F, W, Action, Schedule, loop_placement, v_placement

UNIT = Costs()


def zbh1(ranks: int, microbatches: int) -> Schedule:
    """1F1B with the backward split; rank r defers each W by r microbatches (peak stays p)."""
    p, m = ranks, microbatches
    order = []
    for r in range(p):
        warm = min(p - r - 1, m)
        out = [Action(F, r, mb) for mb in range(warm)]
        for k in range(m):
            if warm + k < m:
                out.append(Action(F, r, warm + k))
            out.append(Action(B, r, k))
            if k - r >= 0:
                out.append(Action(W, r, k - r))
        out += [Action(W, r, k) for k in range(max(0, m - r), m)]
        order.append(tuple(out))
    return Schedule("zbh1", p, p, m, loop_placement(p, 1), tuple(order))


def zbh2_limit(ranks: int) -> float:
    return float(2 * ranks - 1)


def vhalf_limit(ranks: int) -> float:
    return float(min(ranks, ranks // 2 + 1))


def vmin_limit(ranks: int) -> float:
    return float(min(ranks, ranks // 3 + 1))


def zbh2(ranks: int, microbatches: int) -> Schedule:
    return _greedy("zbh2", loop_placement(ranks, 1), microbatches, zbh2_limit(ranks))


def zbv(ranks: int, microbatches: int) -> Schedule:
    return zbv_paper(ranks, microbatches)


def zbv_within(ranks: int, microbatches: int, limit: float) -> Schedule:
    """The V list-scheduled within `limit` activations per rank (zbv when the paper's order does not fit)."""
    return _greedy("zbv", v_placement(ranks), microbatches, limit)


def vhalf(ranks: int, microbatches: int) -> Schedule:
    return _greedy("vhalf", v_placement(ranks), microbatches, vhalf_limit(ranks))


def vmin(ranks: int, microbatches: int) -> Schedule:
    return _greedy("vmin", v_placement(ranks), microbatches, vmin_limit(ranks))


def zbv_paper(ranks: int, microbatches: int) -> Schedule:
    """The paper's hand-made ZB-V order (as torch implements it), made safe for in-order channels.

    Rank r: 2(p-r)-1 chunk-0 forwards; r x (f1, F0); (p-r) x (f1, B1, W1); then
    F0 B0 W0 f1 B1 W1 until done; cool-down r x (B0, B1), (p-r) x (B0, W0), the rest
    of the W's. On in-order channels rank r must take rank r-1's r pending activations
    before its first gradient arrives, so the F0s of the main loop's first r rounds run
    right after the first f1 of the (f1, B1, W1) phase instead, and rank r peaks at
    p + r/2, not p. In closed form; equal to `follow_fifo(zbv_tagged(...))` (tested).
    """
    return _zbv(ranks, microbatches, fifo=True)


def zbv_tagged(ranks: int, microbatches: int) -> Schedule:
    """The paper's ZB-V order exactly as torch writes it (for receives matched by tag)."""
    return _zbv(ranks, microbatches, fifo=False)


def _zbv(p: int, m: int, fifo: bool) -> Schedule:
    n = max(2 * p - 1, m)
    order = []
    for r in range(p):
        c0, c1 = r, 2 * p - 1 - r
        f0 = [Action(F, c0, k) for k in range(n)]
        f1 = [Action(F, c1, k) for k in range(n)]
        b0, w0 = [Action(B, c0, k) for k in range(n)], [Action(W, c0, k) for k in range(n)]
        b1, w1 = [Action(B, c1, k) for k in range(n)], [Action(W, c1, k) for k in range(n)]
        ops = f0[:2 * (p - r) - 1]
        nf0, nf1, nb0, nb1 = len(ops), 0, 0, 0
        early = 0  # forwards run ahead of the first gradient (in-order channels)
        for _ in range(r):
            ops += (f1[nf1], f0[nf0])
            nf1, nf0 = nf1 + 1, nf0 + 1
        for i in range(p - r):
            ops.append(f1[nf1])
            nf1 += 1
            if fifo and i == 0:
                early = min(r, n - nf0)
                ops += f0[nf0:nf0 + early]
                nf0 += early
            ops += (b1[nb1], w1[nb1])
            nb1 += 1
        nw1 = nb1
        while nf1 < nf0 or nf0 < n:
            if early:
                early -= 1  # this slot's forward ran early
            elif nf0 < n:
                ops.append(f0[nf0])
                nf0 += 1
            ops += (b0[nb0], w0[nb0], f1[nf1], b1[nb1], w1[nb1])
            nb0, nf1, nb1 = nb0 + 1, nf1 + 1, nb1 + 1
        nw0, nw1 = nb0, nb1
        for _ in range(r):
            ops += (b0[nb0], b1[nb1])
            nb0, nb1 = nb0 + 1, nb1 + 1
        for _ in range(p - r):
            ops += (b0[nb0], w0[nw0])
            nb0, nw0 = nb0 + 1, nw0 + 1
        ops += w1[nw1:nb1] + w0[nw0:nb0]
        order.append(tuple(a for a in ops if a.microbatch < m) if n > m else tuple(ops))
    return Schedule("zbv", p, 2 * p, m, v_placement(p), tuple(order))


def _greedy(name: str, placement: tuple[int, ...], microbatches: int, limit: float) -> Schedule:
    """The shorter (at unit costs) of backwards-first and forwards-first list scheduling.

    Each run is timed by its own makespan (simulate()'s; tested); the second gives up as
    soon as it cannot end strictly sooner than the first, which it then could not replace."""
    ranks = max(placement) + 1
    table = UNIT.stage_table(placement)
    best = None
    for forward_first in (False, True):
        policy = Policy(split=True, limits=(limit,) * ranks, forward_first=forward_first)
        try:
            run = timed_run(name, placement, microbatches, table, policy,
                            give_up_at=None if best is None else best.makespan - 1e-9)
        except Stall:
            continue
        if run is not None and (best is None or run.makespan < best.makespan - 1e-9):
            best = run
    if best is None:
        raise Stall(f"{name}: no list-scheduling policy finishes with {microbatches} microbatches")
    return best.schedule()
