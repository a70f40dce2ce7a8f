"""pipeplan's own statement of what each schedule kind needs from a plan: stages per rank
and microbatches. The schedule engine generates and verifies the real orders; this table
only rejects plans that cannot work (dsl/checks.py reads it at the pipeline lines)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional


@dataclass(frozen=True)
class ScheduleRule:
    """What a schedule kind needs from the plan (the schedule engine's own limits)."""

    min_virtual: int = 1  # stages per rank
    max_virtual: Optional[int] = 1  # None: no upper bound
    natural_virtual: int = 1  # what `virtual` is when the plan does not say
    min_microbatches: Callable[[int], int] = lambda pp: 1  # as a function of pp
    why: str = ""  # what goes wrong below the minimum


_V = dict(min_virtual=2, max_virtual=2, natural_virtual=2)  # the V placement: 2 stages per rank

SCHEDULE_RULES: dict[str, ScheduleRule] = {
    "gpipe": ScheduleRule(max_virtual=None),
    # pipeplan's 1F1B-family orders clamp the warm-up (pp-r-1 forwards on rank r) to the
    # microbatches there are, so m < pp only idles ranks; it does not hang as torch's
    # fixed warm-up did (torchtitan #775). `pipeplan check` notes it.
    "1f1b": ScheduleRule(),
    "interleaved": ScheduleRule(min_virtual=2, max_virtual=None, natural_virtual=2),
    "zbh1": ScheduleRule(),
    "zbh2": ScheduleRule(),
    "zbv": ScheduleRule(**_V),
    "vhalf": ScheduleRule(**_V),
    "vmin": ScheduleRule(**_V),
    "dualpipev": ScheduleRule(
        **_V, min_microbatches=lambda pp: 2 * pp,
        why="DualPipeV feeds microbatches into both ends of the V and pairs each forward "
            "with a backward of a microbatch fed pp steps earlier from the other end; its "
            "step counts are fixed for 2*pp microbatches or more, and with fewer a rank "
            "waits for a microbatch that does not exist, blocking forever on a receive no "
            "rank will send"),
    "auto": ScheduleRule(max_virtual=2),  # the search tries 1 and 2 stages per rank
}
SCHEDULE_KINDS = tuple(SCHEDULE_RULES)


def min_microbatches(schedule: str, pp: int) -> int:
    return SCHEDULE_RULES[schedule].min_microbatches(pp) if pp > 1 else 1
