"""verify(): prove a schedule runs exactly once per op, in dependency order, without deadlock
under the runtime's blocking point-to-point semantics, and within the activation-memory limit."""
from __future__ import annotations

from typing import Optional

from .errors import ScheduleError
from .execution import analyze
from .ir import Schedule
from .memory import peak_per_rank

TOLERANCE = 1e-9


def verify(schedule: Schedule, memory_limit: Optional[float] = None) -> None:
    """Raise ScheduleError naming the rank, action and dependency (or memory excess) that fails."""
    analyze(schedule)
    if memory_limit is not None:
        check_memory(schedule, memory_limit)


def check_memory(schedule: Schedule, memory_limit: float) -> None:
    peaks, where = peak_per_rank(schedule)
    for r, (peak, at) in enumerate(zip(peaks, where)):
        if peak > memory_limit + TOLERANCE:
            raise ScheduleError(
                f"rank {r} holds {peak:g} microbatches of activations after "
                f"{schedule.order[r][at].describe()} (position {at}), above the memory limit "
                f"{memory_limit:g}")
