"""Which values cross ranks around each action: a pure function of the schedule and stage specs.

The executor semantics the schedule verifier proves deadlock-free:

* before F(s) on a rank not holding stage s-1: receive stage s-1's outputs;
* after F(s), when stage s+1 sits on another rank: send stage s's outputs;
* before B/BW(s), when stage s+1 sits on another rank: receive the gradients
  of stage s's float outputs;
* after B/BW(s), when stage s-1 sits on another rank: send the gradients of
  stage s-1's float outputs (stage s's upstream inputs);
* W never communicates; values between stages on the same rank stay in memory.

A transfer crosses the boundary between stage b and b+1 and carries stage b's
outputs (all of them forward; those carrying a gradient backward) in declared order.
Every value gets its own tag from (boundary, microbatch, direction, position)
so gloo matches by tag; NCCL ignores tags and relies on each rank pair being a
FIFO channel, which the verifier proves consistent.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional, Sequence

from ...compiler.compiled import StageSpec, ValueSpec
from .stage import is_float_dtype

MAX_VALUES_PER_BOUNDARY = 64


class Direction(enum.IntEnum):
    ACTIVATION = 0  # stage b -> b+1, after F(b)
    GRADIENT = 1  # stage b+1 -> b, after B/BW(b+1)


@dataclass(frozen=True)
class Transfer:
    direction: Direction
    boundary: int  # between stage `boundary` and `boundary + 1`
    microbatch: int
    peer: int  # pipeline rank on the other side
    values: tuple[ValueSpec, ...]

    def tag(self, position: int, microbatches: int) -> int:
        base = (self.boundary * microbatches + self.microbatch) * 2 + int(self.direction)
        return base * MAX_VALUES_PER_BOUNDARY + position


@dataclass(frozen=True)
class PlannedAction:
    """One scheduled action with the receive that must precede it and the send after it."""

    action: object  # pipeplan.schedules.Action (op, stage, microbatch)
    recv: Optional[Transfer]
    send: Optional[Transfer]


def carries_grad(v: ValueSpec) -> bool:
    """Whether a gradient flows back for this boundary value (float and requiring grad)."""
    return is_float_dtype(v.dtype) and getattr(v, "requires_grad", True)


def boundary_values(stages: Sequence[StageSpec], boundary: int, direction: Direction):
    outs = stages[boundary].outputs
    if direction is Direction.GRADIENT:
        return tuple(v for v in outs if carries_grad(v))
    return tuple(outs)


def plan_rank(schedule, stages: Sequence[StageSpec], pp_rank: int) -> list[PlannedAction]:
    """The action list of `pp_rank`, each with its cross-rank receive and send."""
    where = schedule.stage_to_rank
    last = len(stages) - 1

    def transfer(direction: Direction, boundary: int, mb: int, peer: int) -> Optional[Transfer]:
        if peer == pp_rank:
            return None
        values = boundary_values(stages, boundary, direction)
        if not values:
            return None
        return Transfer(direction, boundary, mb, peer, values)

    planned = []
    for a in schedule.order[pp_rank]:
        s, mb, op = a.stage, a.microbatch, str(getattr(a.op, "value", a.op))
        recv = send = None
        if op == "F":
            if s > 0:
                recv = transfer(Direction.ACTIVATION, s - 1, mb, where[s - 1])
            if s < last:
                send = transfer(Direction.ACTIVATION, s, mb, where[s + 1])
        elif op in ("B", "BW"):
            if s < last:
                recv = transfer(Direction.GRADIENT, s, mb, where[s + 1])
            if s > 0:
                send = transfer(Direction.GRADIENT, s - 1, mb, where[s - 1])
        elif op != "W":
            raise ValueError(f"unknown schedule op {op!r}")
        planned.append(PlannedAction(a, recv, send))
    return planned


def op_name(action) -> str:
    """The op of an Action as a plain string ('F', 'B', 'W', 'BW'), enum or str."""
    return str(getattr(action.op, "value", action.op))
