"""The planner's work in a forked child while this process does another (two cores): one
piece (`start`: a capture of the model, units.py, at another microbatch size or cp value; the
prediction of the `auto` candidate the search will evaluate next, search._ahead), or a
stream of them (`stream`: the fixed kinds' orders the search's stand-ins will ask for,
search._orders_ahead).

Each is a pure function of the plan: a child forked from this process (the model loaded on
meta, the same objects at the same addresses, so a unit's parameter keys agree) runs one and
hands back its result, pickled to a private temporary file (mkstemp: this user only; written
by the child, read once, removed). The results are the same as computing them here, only
sooner; a child that fails hands back nothing and the caller computes in this process,
where any error is raised as usual. Where `fork` does not exist (Windows) nothing runs in a
child.
"""
from __future__ import annotations

import atexit
import mmap
import multiprocessing
import os
import pickle
import signal
import struct
import tempfile
import time
from typing import Callable, Iterable, Optional

_LIVE: set = set()  # children not yet waited for (killed at exit)


class Child:
    """A forked child running one piece of work."""

    def __init__(self, pid: int, path: str):
        self.pid, self.path = pid, path
        self.status: Optional[int] = None  # its wait status once it has exited
        _LIVE.add(self)

    def done(self) -> bool:
        """Has it exited (so `wait` returns at once)?"""
        if self.status is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.status = status
        return self.status is not None

    def wait(self) -> Optional[dict]:
        """Its dict, or None if it failed."""
        try:
            if self.status is None:
                _, self.status = os.waitpid(self.pid, 0)
            if os.waitstatus_to_exitcode(self.status) != 0:
                return None
            with open(self.path, "rb") as f:
                return pickle.load(f)
        finally:
            self._gone()

    def cancel(self) -> None:
        """Stop it (its result is not needed)."""
        if self.status is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
        self._gone()

    def _gone(self) -> None:
        _LIVE.discard(self)
        if os.path.exists(self.path):
            os.unlink(self.path)


def start(work: Callable[[], dict]) -> Optional[Child]:
    """Run `work` in a forked child (None where this platform cannot fork)."""
    if "fork" not in multiprocessing.get_all_start_methods():
        return None
    fd, path = tempfile.mkstemp(prefix="pipeplan-capture-", suffix=".pickle")
    os.close(fd)
    pid = os.fork()
    if pid == 0:  # the child: never returns into the caller's code
        code = 1
        try:
            out = work()
            with open(path, "wb") as f:
                pickle.dump(out, f, protocol=pickle.HIGHEST_PROTOCOL)
            code = 0
        finally:
            os._exit(code)
    return Child(pid, path)


class Stream:
    """Forked children (`workers` of them) computing `work(i)` for the items `plan(wanted)`
    yields (indices below n, in the order this process is expected to ask for them;
    `wanted(i)`: nobody has started i yet), each handed back as soon as it is done.
    `take(i)` is the caller's: a child's result, or None -- then the caller computes it (and
    the children, told so through a shared flag, skip it). An item a child has started is
    waited for, not computed twice.

    Each child appends its results to its own private temporary file as length-prefixed
    pickles (it never blocks on a reader). The flags are a shared anonymous mapping, a byte
    per item for the children (which child started it) and one for this process (claimed),
    each set by the side it belongs to just before it starts the item: at worst two sides
    compute an item, never none."""

    def __init__(self, n: int, plan: Callable[[Callable[[int], bool]], Iterable[int]],
                 work: Callable[[int], object], workers: int = 1):
        self.n, self.got, self.children, self.files, self.buffers = n, {}, [], [], []
        self.flags = mmap.mmap(-1, 2 * max(n, 1))  # [i]: 1 + the child on i; [n + i]: claimed
        self.taken = 0  # items a child handed back and this process used
        if "fork" not in multiprocessing.get_all_start_methods():
            return
        for w in range(workers):
            fd, path = tempfile.mkstemp(prefix="pipeplan-stream-", suffix=".pickle")
            os.close(fd)
            pid = os.fork()
            if pid == 0:
                self._serve(w, path, plan, work)
            self.children.append(Child(pid, path))
            self.files.append(open(path, "rb"))
            self.buffers.append(b"")

    def _serve(self, w: int, path: str, plan, work) -> None:
        """A child's life: never returns into the caller's code."""
        code, n = 1, self.n
        try:
            wanted = lambda i: not (self.flags[n + i] or self.flags[i])  # noqa: E731
            with open(path, "ab") as out:
                for i in plan(wanted):
                    if not wanted(i):
                        continue
                    self.flags[i] = 1 + w
                    try:
                        done = (i, True, work(i))
                    except Exception:  # handed back as failed: the caller computes it
                        done = (i, False, None)
                    data = pickle.dumps(done, protocol=pickle.HIGHEST_PROTOCOL)
                    out.write(struct.pack("<Q", len(data)) + data)
                    out.flush()
            code = 0
        finally:
            os._exit(code)

    def take(self, i: int):
        """Item i's result from a child, or None: compute it here."""
        if not self.children:
            return None
        self.flags[self.n + i] = 1
        self._read()
        while i not in self.got and self.flags[i]:  # a child is on it
            if self.children[self.flags[i] - 1].done():
                self._read()
                break
            time.sleep(0.001)
            self._read()
        ok, out = self.got.pop(i, (False, None))
        self.taken += ok
        return out if ok else None

    def _read(self) -> None:
        for w, f in enumerate(self.files):
            buffer = self.buffers[w] + f.read()
            while len(buffer) >= 8:
                size = struct.unpack("<Q", buffer[:8])[0]
                if len(buffer) < 8 + size:
                    break
                i, ok, out = pickle.loads(buffer[8:8 + size])
                self.got[i] = ok, out
                buffer = buffer[8 + size:]
            self.buffers[w] = buffer

    def close(self) -> None:
        """Stop the children; nothing more is taken."""
        for child, f in zip(self.children, self.files):
            f.close()
            child.cancel()  # (removes its file)
        self.children, self.files, self.buffers = [], [], []


def stream(n: int, plan: Callable[[Callable[[int], bool]], Iterable[int]],
           work: Callable[[int], object], workers: int = 1) -> Stream:
    """Start a Stream (with no fork on this platform, every `take` answers None)."""
    return Stream(n, plan, work, workers)


@atexit.register
def _cancel_all() -> None:
    for child in list(_LIVE):
        child.cancel()
