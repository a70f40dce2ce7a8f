"""generate(): one entry point from a kind name to a verified Schedule.

Each kind fixes a placement and its number of stages per rank (v):
  gpipe (any v, loop), 1f1b (v=1), interleaved (v>=2, loop), zbh1, zbh2 (v=1),
  zbv, vhalf, vmin, dualpipev (v=2, V placement), auto (v=1 or 2; searched when not given).
"""
from __future__ import annotations

from typing import Callable, Optional

from .costs import Costs
from .errors import ScheduleError
from .gen_classic import gpipe, interleaved, one_f_one_b
from .gen_dualpipev import dualpipev
from .gen_greedy import Stall
from .gen_zero_bubble import vhalf, vmin, zbh1, zbh2, zbv, zbv_within
from .ir import Schedule, bulk
from .memory import peak_per_rank
from .verify import verify

KINDS = ("gpipe", "1f1b", "interleaved", "zbh1", "zbh2", "zbv", "vhalf", "vmin", "dualpipev", "auto")

# kind -> (allowed v values or None for any, default v, builder(p, m, v))
_FIXED: dict[str, tuple[Optional[tuple[int, ...]], int, Callable[[int, int, int], Schedule]]] = {
    "gpipe": (None, 1, lambda p, m, v: gpipe(p, m, v)),
    "1f1b": ((1,), 1, lambda p, m, v: one_f_one_b(p, m)),
    "interleaved": (None, 2, lambda p, m, v: interleaved(p, m, v)),
    "zbh1": ((1,), 1, lambda p, m, v: zbh1(p, m)),
    "zbh2": ((1,), 1, lambda p, m, v: zbh2(p, m)),
    "zbv": ((2,), 2, lambda p, m, v: zbv(p, m)),
    "vhalf": ((2,), 2, lambda p, m, v: vhalf(p, m)),
    "vmin": ((2,), 2, lambda p, m, v: vmin(p, m)),
    "dualpipev": ((2,), 2, lambda p, m, v: dualpipev(p, m)),
}


def default_virtual(kind: str) -> int:
    return _FIXED[kind][1] if kind in _FIXED else 1


def check_args(kind: str, ranks, microbatches, virtual) -> int:
    """Validate the arguments; return the resolved v. One-line errors naming the constraint."""
    if kind not in KINDS:
        raise ScheduleError(f"unknown schedule kind {kind!r}; choose one of {', '.join(KINDS)}")
    if not isinstance(ranks, int) or ranks < 1:
        raise ScheduleError(f"ranks must be an integer >= 1, got {ranks!r}")
    if not isinstance(microbatches, int) or microbatches < 1:
        raise ScheduleError(f"microbatches must be an integer >= 1, got {microbatches!r}")
    if virtual is None:
        return default_virtual(kind)
    if not isinstance(virtual, int) or virtual < 1:
        raise ScheduleError(f"virtual (stages per rank) must be an integer >= 1, got {virtual!r}")
    if kind == "interleaved" and virtual < 2:
        raise ScheduleError("interleaved needs virtual >= 2 stages per rank (virtual=1 is 1f1b)")
    if kind == "auto" and virtual > 2:
        raise ScheduleError(f"auto searches 1 or 2 stages per rank, got virtual={virtual}")
    allowed = _FIXED[kind][0] if kind in _FIXED else None
    if allowed is not None and virtual not in allowed:
        raise ScheduleError(f"{kind} needs virtual={allowed[0]} stages per rank, got virtual={virtual}")
    return virtual


def generate(kind: str, ranks: int, microbatches: int, virtual: Optional[int] = None,
             costs: Optional[Costs] = None, memory_limit: Optional[float] = None) -> Schedule:
    """Build the schedule of `kind` and verify it (memory limit included) before returning it.

    `virtual=None` takes the kind's natural stages per rank (2 for V kinds and
    interleaved, else 1); `auto` then searches both. Fixed kinds' orders do not
    depend on `costs`; `auto` optimises for them (per_stage must list ranks*v stages).
    """
    with bulk():
        return _generate(kind, ranks, microbatches, virtual, costs, memory_limit)


def _generate(kind: str, ranks: int, microbatches: int, virtual: Optional[int],
              costs: Optional[Costs], memory_limit: Optional[float]) -> Schedule:
    v = check_args(kind, ranks, microbatches, virtual)
    if memory_limit is not None and not memory_limit > 0:
        raise ScheduleError(f"memory limit must be > 0 microbatches of activations, got {memory_limit!r}")
    costs = costs or Costs()
    if kind == "auto":
        from .gen_auto import auto  # auto compares against every fixed kind
        schedule = auto(ranks, microbatches, virtual, costs, memory_limit)
        verify(schedule, memory_limit)
        return schedule
    if costs.per_stage is not None and len(costs.per_stage) != ranks * v:
        raise ScheduleError(f"per-stage costs list {len(costs.per_stage)} stages but {kind} with "
                            f"{ranks} ranks x {v} stages per rank has {ranks * v}")
    try:
        schedule = _FIXED[kind][2](ranks, microbatches, v)
        if kind == "zbv" and memory_limit is not None and max(peak_per_rank(schedule)[0]) > memory_limit + 1e-9:
            schedule = zbv_within(ranks, microbatches, memory_limit)  # the paper's order holds p + r/2
    except Stall as e:
        raise ScheduleError(f"{kind}: no order found for {ranks} ranks, {microbatches} microbatches ({e})") from None
    if memory_limit is not None:
        peak = max(peak_per_rank(schedule)[0])
        if peak > memory_limit + 1e-9:
            raise ScheduleError(
                f"{kind} needs {peak:g} microbatches of activations per rank, above the memory limit "
                f"{memory_limit:g} (try vhalf, vmin or auto)")
    verify(schedule, memory_limit)
    return schedule
