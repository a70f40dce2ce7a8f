"""Costs: how long each op takes, and the point-to-point latency between ranks.

Uniform costs are for a rank's whole share of the layers: with v stages per
rank each stage's op costs F/v, B/v, W/v, so kinds with different v compare
at equal work. `per_stage` gives absolute (F, B, W) per stage instead.
A full backward BW costs B + W. `split` (optional, one number per stage of `per_stage`): the
seconds a separate W costs beyond its share of the fused BW (a runtime that splits the
backward on the host pays a call per weight-using op there; compiler/estimate/optime.py),
charged to every W and never to BW. `waiting` (optional, same shape as `per_stage`): of each
op's seconds, those its rank spends waiting on other ranks inside the action (collectives),
not computing; the simulator charges the whole op either way, only
SimResult.concurrency (ranks sharing a CPU's cores) reads it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .errors import ScheduleError
from .ir import B, BW, F, W


@dataclass(frozen=True)
class Costs:
    F: float = 1.0
    B: float = 1.0
    W: float = 1.0
    latency: float = 0.0
    per_stage: Optional[tuple[tuple[float, float, float], ...]] = None
    waiting: Optional[tuple[tuple[float, float, float], ...]] = None
    split: Optional[tuple[float, ...]] = None

    def __post_init__(self):
        values = [self.F, self.B, self.W, self.latency]
        if self.per_stage is not None:
            object.__setattr__(self, "per_stage", tuple(tuple(float(x) for x in t) for t in self.per_stage))
            for t in self.per_stage:
                if len(t) != 3:
                    raise ScheduleError(f"per-stage costs need (F, B, W) for each stage, got {t}")
                values.extend(t)
        if self.waiting is not None:
            if self.per_stage is None or len(self.waiting) != len(self.per_stage):
                raise ScheduleError("waiting times need per-stage costs, one (F, B, W) each")
            object.__setattr__(self, "waiting", tuple(
                tuple(min(float(x), float(t)) for x, t in zip(w, op))
                for w, op in zip(self.waiting, self.per_stage)))
            values.extend(x for w in self.waiting for x in w)
        if self.split is not None:
            if self.per_stage is None or len(self.split) != len(self.per_stage):
                raise ScheduleError("a split backward's costs need per-stage costs, one each")
            object.__setattr__(self, "split", tuple(float(x) for x in self.split))
            values.extend(self.split)
        if any(not (v >= 0) for v in values):  # also rejects NaN
            raise ScheduleError(f"costs must be non-negative numbers, got {self}")

    def stage_table(self, stage_to_rank: tuple[int, ...]) -> "StageCosts":
        """Resolve to absolute per-stage op times for a given placement."""
        stages = len(stage_to_rank)
        if self.per_stage is not None:
            if len(self.per_stage) != stages:
                raise ScheduleError(
                    f"per-stage costs list {len(self.per_stage)} stages but the schedule has {stages}")
            return StageCosts(self.per_stage, self.latency, self.split)
        per_rank: dict[int, int] = {}
        for r in stage_to_rank:
            per_rank[r] = per_rank.get(r, 0) + 1
        table = tuple((self.F / per_rank[r], self.B / per_rank[r], self.W / per_rank[r])
                      for r in stage_to_rank)
        return StageCosts(table, self.latency)

    def label(self) -> str:
        base = f"F={self.F:g},B={self.B:g},W={self.W:g}" if self.per_stage is None else "per-stage"
        return base + (f",c={self.latency:g}" if self.latency else "")


@dataclass(frozen=True)
class StageCosts:
    """Absolute op times per stage; `time(op, stage)` is what the simulator charges."""

    table: tuple[tuple[float, float, float], ...]
    latency: float
    split: Optional[tuple[float, ...]] = None  # per stage: what a separate W adds (Costs.split)

    def time(self, op: str, stage: int) -> float:
        f, b, w = self.table[stage]
        if op == F:
            return f
        if op == B:
            return b
        if op == W:
            return w + self.split[stage] if self.split else w
        if op == BW:
            return b + w
        raise ScheduleError(f"unknown op {op!r}")


def parse_costs(text: str, latency: float = 0.0) -> Costs:
    """'F=1,B=1.5,W=0.5' → Costs; a one-line error for anything else."""
    fields = {"F": 1.0, "B": 1.0, "W": 1.0}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        key = key.strip().upper()
        if not sep or key not in fields:
            raise ScheduleError(f"bad cost {part!r}: expected F=x,B=y,W=z")
        try:
            fields[key] = float(value)
        except ValueError:
            raise ScheduleError(f"bad cost {part!r}: {value!r} is not a number") from None
    return Costs(fields["F"], fields["B"], fields["W"], latency)
