"""How one rank's failure stops every rank, with the failing rank and action named.

A failing worker (an exception in an action, a non-finite loss) records
`Failure(rank, message, time)` twice before it exits:

* as a JSON file in $PIPEPLAN_ERROR_DIR, which the local launcher reads to
  name the first failing rank and then kills the rest;
* under a key in the job's TCP store (MASTER_ADDR:MASTER_PORT), which a
  watchdog thread in every other rank polls, so ranks blocked in a receive
  exit promptly under torchrun too (multi-node), where no pipeplan launcher
  watches them.

torch.distributed's own timeout (`--timeout`) stays as the last backstop.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Optional

ERROR_DIR_ENV = "PIPEPLAN_ERROR_DIR"
STORE_KEY = "pipeplan/failure"


@dataclass(frozen=True)
class Failure:
    rank: int
    message: str
    time: float

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def from_json(text: str) -> "Failure":
        d = json.loads(text)
        return Failure(int(d["rank"]), str(d["message"]), float(d["time"]))


def _store_client(timeout_s: float = 10.0):
    import torch.distributed as dist

    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port:
        return None
    return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def report_failure(failure: Failure) -> None:
    """Tell the launcher and the other ranks; never raises (we are already failing)."""
    folder = os.environ.get(ERROR_DIR_ENV)
    if folder:
        try:
            with open(os.path.join(folder, f"rank{failure.rank}.json"), "w") as f:
                f.write(failure.to_json())
        except OSError:
            pass
    try:
        store = _store_client(timeout_s=2.0)
        if store is not None and not store.check([STORE_KEY]):
            store.set(STORE_KEY, failure.to_json())
    except Exception:  # the store may be gone with rank 0
        pass


def read_failures(folder: str) -> list[Failure]:
    """Every reported failure, earliest first (the earliest is the cause)."""
    out = []
    for name in os.listdir(folder):
        if name.endswith(".json"):
            try:
                with open(os.path.join(folder, name)) as f:
                    out.append(Failure.from_json(f.read()))
            except (OSError, ValueError, KeyError):
                continue
    return sorted(out, key=lambda f: f.time)


class FailureWatch:
    """A daemon thread: exit this process when another rank reports a failure."""

    def __init__(self, rank: int, interval_s: float = 0.5):
        self.rank = rank
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> "FailureWatch":
        self._thread = threading.Thread(target=self._run, name="pipeplan-failure-watch",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        try:
            store = _store_client()
        except Exception:
            return
        if store is None:
            return
        while not self._stop.wait(self.interval_s):
            try:
                if not store.check([STORE_KEY]):
                    continue
                failure = Failure.from_json(store.get(STORE_KEY).decode())
            except Exception:  # the store went away: the job is ending anyway
                return
            if failure.rank != self.rank and not self._stop.is_set():
                print(f"rank {self.rank}: stopping because rank {failure.rank} failed: "
                      f"{failure.message}", file=sys.stderr, flush=True)
                os._exit(1)


def now() -> float:
    return time.time()
