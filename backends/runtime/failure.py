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

A rank killed by a signal reports nothing, so each rank also keeps a `Beacon`:
a small memory-mapped file in $PIPEPLAN_ERROR_DIR holding what it is doing
now ("step 21: F s1 mb0"), rewritten per action (a memory write, no syscall).
It survives the process, so the launcher can name a dead rank's last action.
Its last 8 bytes are a heartbeat: a counter a daemon thread of the rank bumps
every HEARTBEAT_TICK_S, also while the rank waits in a collective. A rank whose
counter stands still (stopped, or its interpreter wedged) for --heartbeat
seconds is named by the launcher well before the collective timeout.

A rank that finishes says so (`report_done`: `rank<N>.done`); one that exits
without it, even with code 0 (os._exit at model import, a C-level exit), is a
failure, named with where it was.
"""
from __future__ import annotations

import json
import mmap
import os
import struct
import sys
import threading
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Optional

ERROR_DIR_ENV = "PIPEPLAN_ERROR_DIR"
HEARTBEAT_S = 30.0  # a local rank without a heartbeat this long is stopped (--heartbeat)
HEARTBEAT_TICK_S = 0.5
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


def island_key(island: Optional[int]) -> str:
    """Where a rank reports its failure in the store: the job's key, or in a decoupled
    DiLoCo run an island's own key for islands other than 0 (the launcher decides whether
    such a failure stops the run, see launcher.py; watchers read both keys)."""
    return STORE_KEY if not island else f"{STORE_KEY}/island{island}"


def report_failure(failure: Failure, key: str = STORE_KEY) -> None:
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
        if store is not None and not store.check([key]):
            store.set(key, failure.to_json())
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

    def __init__(self, rank: int, interval_s: float = 0.5, keys: tuple = (STORE_KEY,)):
        self.rank, self.keys = rank, keys
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
                key = next((k for k in self.keys if store.check([k])), None)
                if key is None:
                    continue
                failure = Failure.from_json(store.get(key).decode())
            except Exception:  # the store went away: the job is ending anyway
                return
            if failure.rank != self.rank and not self._stop.is_set():
                print(f"rank {self.rank}: stopping because rank {failure.rank} failed: "
                      f"{failure.message}", file=sys.stderr, flush=True)
                os._exit(1)


def now() -> float:
    return time.time()


BEACON_BYTES = 256
TEXT_BYTES = BEACON_BYTES - 8  # then the heartbeat counter (little-endian uint64)


class Beacon:
    """What this rank is doing, readable by the launcher after the rank is gone.

    Indexed like the one-element list the worker used before (`where[0] = "step 3"`);
    `action(label)` adds the action inside the current phase.
    """

    def __init__(self, rank: int, phase: str):
        self.phase, self._map, self._beats, self.text = phase, None, 0, phase
        folder = os.environ.get(ERROR_DIR_ENV)
        if folder:
            try:
                with open(os.path.join(folder, f"rank{rank}.where"), "w+b") as f:
                    f.write(b"\0" * BEACON_BYTES)
                    f.flush()
                    self._map = mmap.mmap(f.fileno(), BEACON_BYTES)
            except (OSError, ValueError):
                self._map = None
        self._write(phase)

    def __getitem__(self, i: int) -> str:
        return self.phase

    def __setitem__(self, i: int, phase: str) -> None:
        self.phase = phase
        self._write(phase)

    def action(self, label: str) -> None:
        self._write(f"{self.phase}: {label}")

    def _write(self, text: str) -> None:
        self.text = text  # for the store heartbeat (heartbeat.py)
        if self._map is not None:
            data = text.encode("utf-8", "replace")[:TEXT_BYTES - 1]
            self._map[:len(data) + 1] = data + b"\0"

    def start_heartbeat(self) -> "Beacon":
        """Bump the heartbeat counter every HEARTBEAT_TICK_S from a daemon thread."""
        if self._map is not None:
            threading.Thread(target=self._beat, name="pipeplan-heartbeat", daemon=True).start()
        return self

    def _beat(self) -> None:
        while True:
            self._beats += 1
            self._map[TEXT_BYTES:] = struct.pack("<Q", self._beats)
            time.sleep(HEARTBEAT_TICK_S)


def read_heartbeat(folder: str, rank: int) -> Optional[int]:
    """Rank `rank`'s heartbeat counter (None: no beacon yet, or no heartbeat started)."""
    try:
        with open(os.path.join(folder, f"rank{rank}.where"), "rb") as f:
            raw = f.read(BEACON_BYTES)[TEXT_BYTES:]
    except OSError:
        return None
    beats = struct.unpack("<Q", raw)[0] if len(raw) == 8 else 0
    return beats or None


def report_done(rank: int) -> None:
    """Tell the local launcher this rank finished its run (it exits 0 next)."""
    folder = os.environ.get(ERROR_DIR_ENV)
    if folder:
        with open(os.path.join(folder, f"rank{rank}.done"), "w"):
            pass


def reported_done(folder: str, rank: int) -> bool:
    return os.path.exists(os.path.join(folder, f"rank{rank}.done"))


def read_beacon(folder: str, rank: int) -> Optional[str]:
    """The last thing rank `rank` said it was doing, if it kept a beacon."""
    try:
        with open(os.path.join(folder, f"rank{rank}.where"), "rb") as f:
            text = f.read(TEXT_BYTES).split(b"\0", 1)[0].decode("utf-8", "replace")
    except OSError:
        return None
    return text or None


def _signal_name(code: int) -> str:
    import signal

    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def explain(codes: dict[int, Optional[int]], reports: list[Failure],
            beacons: dict[int, Optional[str]], unreported: frozenset = frozenset()) -> list[str]:
    """The launcher's lines about a failed run: the rank that failed first, then the rest.

    The cause is, in order: a rank that died by a signal (it cannot report, and every
    report after it is a consequence: a neighbour's "connection closed"); else one that
    exited 0 without reporting that it finished (`unreported`: os._exit, a C-level exit;
    no rank stops that way because of another); else the earliest report by time; else
    a rank that exited non-zero without a report.
    `codes`: each rank's exit code when the launcher decided (None: still running,
    negative: killed by that signal); `beacons`: each rank's last recorded action.
    """
    world = len(codes)
    killed = [r for r, c in codes.items() if c is not None and c < 0]
    silent = [r for r, c in codes.items() if c is not None and (c > 0 or r in unreported)
              and r not in {f.rank for f in reports}]
    silent = [r for r in silent if r in unreported] + [r for r in silent if r not in unreported]
    if killed:
        cause = killed[0]
        where = beacons.get(cause)
        lines = [f"run failed: rank {cause} was killed by {_signal_name(codes[cause])}"
                 + (f" in {where}" if where else "") + " (it reported no error)"]
    elif reports and not (silent and silent[0] in unreported):
        cause, lines = reports[0].rank, [f"run failed: {reports[0].message}"]
    elif silent:
        cause = silent[0]
        where = beacons.get(cause)
        lines = [f"run failed: rank {cause} exited with code {codes[cause]} during "
                 f"{where or 'startup'} without reporting "
                 + ("an error" if codes[cause] else "that it finished (a silent exit is no "
                    "success)")]
    else:
        return [f"run failed; stopped all {world} ranks"]
    after = [f for f in reports if f.rank != cause]
    if after:
        first = after[0]
        more = len({f.rank for f in after}) - 1
        lines.append(f"consequence: {_short(first.message)}"
                     + (f" (and {more} more rank{'s' if more > 1 else ''})" if more else ""))
    lines.append(f"stopped all {world} ranks")
    return lines


def _short(message: str, limit: int = 240) -> str:
    line = message.strip().splitlines()[0] if message.strip() else message
    return line if len(line) <= limit else line[:limit - 3] + "..."
