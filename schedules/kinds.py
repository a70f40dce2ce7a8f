"""The one table of schedule kinds: each kind's placement, the stages per rank (virtual)
it allows and takes by default, the fewest microbatches it runs with, and its builder.

Read by the generator (`generate.py`), `auto` (the fixed kinds it compares against),
the plan checks (dsl/checks.py, at the pipeline lines), `pipeplan fmt` and the gallery.
The schedule engine generates and verifies the real orders; the limits here only reject
plans that cannot work, before anything is generated.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from .errors import ScheduleError
from .gen_classic import gpipe, interleaved, one_f_one_b
from .gen_dualpipev import dualpipev
from .gen_greedy import Stall
from .gen_zero_bubble import vhalf, vmin, zbh1, zbh2, zbv, zbv_within
from .ir import Schedule
from .memory import peak_per_rank
from .verify import verify

Builder = Callable[[int, int, int], Schedule]  # (ranks, microbatches, virtual) -> order


@dataclass(frozen=True)
class Kind:
    """What a schedule kind needs from the plan (the schedule engine's own limits)."""

    placement: str  # "loop" (stage s on rank s mod p) or "V" (2 stages per rank, folded)
    builder: Optional[Builder]  # None: `auto`, a search (gen_auto.py), not a fixed order
    min_virtual: int = 1  # stages per rank
    max_virtual: Optional[int] = 1  # None: no upper bound
    natural_virtual: int = 1  # what `virtual` is when the plan does not say
    min_microbatches: Callable[[int], int] = lambda pp: 1  # as a function of pp
    why: str = ""  # what goes wrong below the minimum

    def allows(self, virtual: int) -> bool:
        return virtual >= self.min_virtual and (self.max_virtual is None or virtual <= self.max_virtual)


def _v(builder: Callable[[int, int], Schedule], **kw) -> Kind:
    """A kind on the V placement: exactly 2 stages per rank."""
    return Kind("V", lambda p, m, v: builder(p, m), min_virtual=2, max_virtual=2,
                natural_virtual=2, **kw)


KINDS_TABLE: dict[str, Kind] = {
    "gpipe": Kind("loop", gpipe, max_virtual=None),
    # pipeplan's 1F1B-family orders clamp the warm-up (pp-r-1 forwards on rank r) to the
    # microbatches there are, so m < pp only idles ranks; it does not hang as torch's
    # fixed warm-up did (torchtitan #775). `pipeplan check` notes it.
    "1f1b": Kind("loop", lambda p, m, v: one_f_one_b(p, m)),
    "interleaved": Kind("loop", interleaved, min_virtual=2, max_virtual=None, natural_virtual=2),
    "zbh1": Kind("loop", lambda p, m, v: zbh1(p, m)),
    "zbh2": Kind("loop", lambda p, m, v: zbh2(p, m)),
    "zbv": _v(zbv),
    "vhalf": _v(vhalf),
    "vmin": _v(vmin),
    "dualpipev": _v(
        dualpipev, min_microbatches=lambda pp: 2 * pp,
        why="DualPipeV feeds microbatches into both ends of the V and pairs each forward "
            "with a backward of a microbatch fed pp steps earlier from the other end; its "
            "step counts are fixed for 2*pp microbatches or more, and with fewer a rank "
            "waits for a microbatch that does not exist, blocking forever on a receive no "
            "rank will send"),
    "auto": Kind("loop or V", None, max_virtual=2),  # the search tries 1 and 2 stages per rank
}
KINDS = tuple(KINDS_TABLE)
FIXED_KINDS = tuple(k for k, kind in KINDS_TABLE.items() if kind.builder is not None)


def min_microbatches(schedule: str, pp: int) -> int:
    return KINDS_TABLE[schedule].min_microbatches(pp) if pp > 1 else 1


def default_virtual(kind: str) -> int:
    return KINDS_TABLE[kind].natural_virtual if kind in KINDS_TABLE else 1


def check_args(kind: str, ranks, microbatches, virtual) -> int:
    """Validate the arguments; return the resolved v. One-line errors naming the constraint."""
    if kind not in KINDS_TABLE:
        raise ScheduleError(f"unknown schedule kind {kind!r}; choose one of {', '.join(KINDS)}")
    if not isinstance(ranks, int) or ranks < 1:
        raise ScheduleError(f"ranks must be an integer >= 1, got {ranks!r}")
    if not isinstance(microbatches, int) or microbatches < 1:
        raise ScheduleError(f"microbatches must be an integer >= 1, got {microbatches!r}")
    if virtual is None:
        return default_virtual(kind)
    if not isinstance(virtual, int) or virtual < 1:
        raise ScheduleError(f"virtual (stages per rank) must be an integer >= 1, got {virtual!r}")
    k = KINDS_TABLE[kind]
    if not k.allows(virtual):
        if kind == "interleaved":
            raise ScheduleError("interleaved needs virtual >= 2 stages per rank (virtual=1 is 1f1b)")
        if kind == "auto":
            raise ScheduleError(f"auto searches 1 or 2 stages per rank, got virtual={virtual}")
        raise ScheduleError(f"{kind} needs virtual={k.min_virtual} stages per rank, got virtual={virtual}")
    return virtual


def build_fixed(kind: str, ranks: int, microbatches: int, v: int,
                memory_limit: Optional[float], verified: bool = True) -> Schedule:
    """A fixed kind's order, within the memory limit, verified (`verified` False: as its
    builder makes it, for a caller that only counts what it holds: generate.unverified)."""
    try:
        schedule = KINDS_TABLE[kind].builder(ranks, microbatches, v)
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
    if verified:
        verify(schedule, memory_limit)
    return schedule
