"""Heartbeats through the job's store, for ranks no pipeplan launcher watches (torchrun).

The local launcher reads each rank's beacon file (failure.py). Under torchrun (multi-node)
there is no such launcher and no shared folder, so each rank's `StoreHeartbeat` thread
writes `pipeplan/beat/<rank>` = "<counter>\\n<what it is doing>" to the job's c10d store
every HEARTBEAT_TICK_S and watches one neighbour, rank (r + 1) mod world (each rank read by
one other: the store's load grows with the world, not its square). A neighbour whose counter
stands still for `limit_s` (stopped by SIGSTOP, its interpreter wedged) is reported as a
Failure under the job's failure key, so every rank's FailureWatch stops its process, naming
it, well before the collective timeout. A rank that ends (or fails on its own) writes
"done" first, so its exit is never taken for a stop.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Optional

from .failure import HEARTBEAT_TICK_S, Failure, _store_client, now, report_failure

BEAT_KEY = "pipeplan/beat/{}"
DONE = b"done"


class StoreHeartbeat:
    """Beat for `rank` and watch rank (rank + 1) % world. `where()`: what this rank is doing
    now; `key_of(rank)`: the failure key a stopped rank is reported under."""

    def __init__(self, rank: int, world: int, limit_s: float, where: Callable[[], str],
                 key_of: Callable[[int], str]):
        self.rank, self.world, self.limit_s = rank, world, limit_s
        self.where, self.key_of = where, key_of
        self.watched = (rank + 1) % world
        self._stop = threading.Event()
        self._store = None

    def start(self) -> "StoreHeartbeat":
        if self.world > 1 and self.limit_s > 0:
            threading.Thread(target=self._run, name="pipeplan-store-heartbeat",
                             daemon=True).start()
        return self

    def stop(self) -> None:
        """This rank ends: say so, so its neighbour's watcher does not take it for stopped."""
        self._stop.set()
        try:
            store = self._store or _store_client(timeout_s=2.0)
            if store is not None:
                store.set(BEAT_KEY.format(self.rank), DONE)
        except Exception:  # the store may be gone with rank 0: the job is ending anyway
            pass

    def _run(self) -> None:
        try:
            self._store = store = _store_client()
        except Exception:
            return
        if store is None:
            return
        beats, seen, since = 0, None, time.monotonic()
        key = BEAT_KEY.format(self.watched)
        while not self._stop.wait(HEARTBEAT_TICK_S):
            beats += 1
            try:
                store.set(BEAT_KEY.format(self.rank), f"{beats}\n{self.where()}")
                value: Optional[bytes] = store.get(key) if store.check([key]) else None
            except Exception:  # the store went away: the job is ending anyway
                return
            if value == DONE:
                return
            if value != seen:
                seen, since = value, time.monotonic()
            elif value is not None and time.monotonic() - since > self.limit_s:
                self._report(value)
                return

    def _report(self, value: bytes) -> None:
        where = value.decode("utf-8", "replace").split("\n", 1)[-1]
        report_failure(Failure(self.watched, f"rank {self.watched} stopped responding: no "
                               f"heartbeat for {self.limit_s:g} s (last seen in {where}; "
                               f"noticed by rank {self.rank})", now()),
                       self.key_of(self.watched))
