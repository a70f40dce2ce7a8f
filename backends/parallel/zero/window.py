"""ZeRO-3's prefetch window: a stage's full parameters gathered around each of its actions."""
from __future__ import annotations

import contextlib
from typing import Protocol, Sequence


class Gathers(Protocol):
    """What the window drives (sharding.StageZero at stage 3)."""

    def gather(self, stage: int) -> None: ...
    def prefetch(self, stage: int) -> None: ...
    def release(self, stage: int, keep=None) -> None: ...


class PrefetchWindow:
    """ZeRO-3 around each action of one step, in this rank's action order.

    Before action i: its stage's parameters are gathered (waiting for the
    prefetch started one action earlier), and the gather of action i+1's
    stage is started, so it overlaps action i. After it: what action i+1 does
    not read is released. At most two stages' full parameters exist at once;
    nothing is prefetched across the optimizer step (the shards change there).
    Use as the runtime's `around(stage)` context manager, once per action.
    """

    def __init__(self, zero: Gathers, stages_in_order: Sequence[int]):
        self.zero, self.order = zero, list(stages_in_order)
        self.position = 0
        self.prefetches = 0  # how many gathers were started ahead (for tests and reports)

    @contextlib.contextmanager
    def __call__(self, stage: int):
        i = self.position
        if self.order[i] != stage:
            raise RuntimeError(f"ZeRO-3 window: action {i} runs stage {stage}, "
                               f"the schedule says stage {self.order[i]}")
        nxt = self.order[i + 1] if i + 1 < len(self.order) else None
        self.zero.gather(stage)
        if nxt is not None and nxt != stage:
            self.zero.prefetch(nxt)
            self.prefetches += 1
        try:
            yield
        finally:
            self.zero.release(stage, keep=nxt)
            self.position = (i + 1) % len(self.order)
