"""The zero-bubble family (arXiv 2401.10241) and controllable-memory V schedules (arXiv 2405.15362).

Splitting the backward into B (input gradient, on the critical path) and W
(weight gradient, movable) lets W fill the bubbles. Memory is held from F until
W (see memory.py), so every deferred W costs activation memory; each kind is a
memory budget plus a placement:

  zbh1      loop placement, 1F1B's memory (p): 1F1B order, rank r runs W(k) after B(k+r)
  zbh2      loop placement, 2p-1 units: list-scheduled (forwards fill the warm-up bubble)
  zbv       V placement (v=2), p units: list-scheduled
  vhalf     V placement, about half of 1F1B's memory: floor(p/2)+1 units
  vmin      V placement, about a third: floor(p/3)+1 units

Fixed kinds are computed at unit costs (F=B=W per stage), so a kind's order does
not change with the costs; `auto` is the kind that adapts to them.
"""
from __future__ import annotations

from .costs import Costs
from .gen_classic import one_f_one_b
from .gen_greedy import Policy, list_schedule
from .ir import B, F, W, Action, Schedule, loop_placement, v_placement

UNIT = Costs()


def zbh1(ranks: int, microbatches: int) -> Schedule:
    """1F1B with the backward split; rank r defers each W by r microbatches (peak stays p)."""
    base = one_f_one_b(ranks, microbatches)
    order = []
    for r, actions in enumerate(base.order):
        out = []
        for a in actions:
            if a.op == F:
                out.append(a)
                continue
            out.append(Action(B, a.stage, a.microbatch))
            if a.microbatch - r >= 0:
                out.append(Action(W, a.stage, a.microbatch - r))
        out += [Action(W, r, k) for k in range(max(0, microbatches - r), microbatches)]
        order.append(tuple(out))
    return Schedule("zbh1", ranks, ranks, microbatches, base.stage_to_rank, tuple(order))


def zbh2_limit(ranks: int) -> float:
    return float(2 * ranks - 1)


def vhalf_limit(ranks: int) -> float:
    return float(min(ranks, ranks // 2 + 1))


def vmin_limit(ranks: int) -> float:
    return float(min(ranks, ranks // 3 + 1))


def zbh2(ranks: int, microbatches: int) -> Schedule:
    return _greedy("zbh2", loop_placement(ranks, 1), microbatches, zbh2_limit(ranks))


def zbv(ranks: int, microbatches: int) -> Schedule:
    return _greedy("zbv", v_placement(ranks), microbatches, float(ranks))


def vhalf(ranks: int, microbatches: int) -> Schedule:
    return _greedy("vhalf", v_placement(ranks), microbatches, vhalf_limit(ranks))


def vmin(ranks: int, microbatches: int) -> Schedule:
    return _greedy("vmin", v_placement(ranks), microbatches, vmin_limit(ranks))


def _greedy(name: str, placement: tuple[int, ...], microbatches: int, limit: float) -> Schedule:
    ranks = max(placement) + 1
    policy = Policy(split=True, limits=(limit,) * ranks)
    return list_schedule(name, placement, microbatches, UNIT.stage_table(placement), policy)
