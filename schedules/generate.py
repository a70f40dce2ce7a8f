"""generate(): one entry point from a kind name to a verified Schedule.

Each kind's placement, stages per rank and builder are in kinds.py (one table);
`auto` (gen_auto.py) searches, comparing against every fixed kind.
"""
from __future__ import annotations

from typing import Optional

from .costs import Costs
from .errors import ScheduleError
from .gen_auto import auto
from .ir import Schedule, bulk
from .kinds import KINDS, build_fixed, check_args, default_virtual  # noqa: F401 (KINDS, default_virtual re-exported)
from .verify import verify


def generate(kind: str, ranks: int, microbatches: int, virtual: Optional[int] = None,
             costs: Optional[Costs] = None, memory_limit: Optional[float] = None) -> Schedule:
    """Build the schedule of `kind` and verify it (memory limit included) before returning it.

    `virtual=None` takes the kind's natural stages per rank (2 for V kinds and
    interleaved, else 1); `auto` then searches both. Fixed kinds' orders do not
    depend on `costs`; `auto` optimises for them (per_stage must list ranks*v stages).
    """
    with bulk():
        return _generate(kind, ranks, microbatches, virtual, costs, memory_limit)


def unverified(kind: str, ranks: int, microbatches: int, virtual: Optional[int] = None) -> Schedule:
    """A fixed kind's order as its builder makes it, not verified: for a planner bounding
    thousands of candidates by what their orders hold (each verified order costs a walk of
    its dependencies; the candidates it evaluates, and every plan that runs, go through
    generate())."""
    v = check_args(kind, ranks, microbatches, virtual)
    if kind == "auto":
        raise ScheduleError("auto has no order before its search: use generate()")
    with bulk():
        return build_fixed(kind, ranks, microbatches, v, None, verified=False)


def _generate(kind: str, ranks: int, microbatches: int, virtual: Optional[int],
              costs: Optional[Costs], memory_limit: Optional[float]) -> Schedule:
    v = check_args(kind, ranks, microbatches, virtual)
    if memory_limit is not None and not memory_limit > 0:
        raise ScheduleError(f"memory limit must be > 0 microbatches of activations, got {memory_limit!r}")
    costs = costs or Costs()
    if kind == "auto":
        schedule = auto(ranks, microbatches, virtual, costs, memory_limit)
        verify(schedule, memory_limit)
        return schedule
    if costs.per_stage is not None and len(costs.per_stage) != ranks * v:
        raise ScheduleError(f"per-stage costs list {len(costs.per_stage)} stages but {kind} with "
                            f"{ranks} ranks x {v} stages per rank has {ranks * v}")
    return build_fixed(kind, ranks, microbatches, v, memory_limit)
