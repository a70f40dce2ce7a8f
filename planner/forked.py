"""One piece of the planner's work in a forked child while this process does another (two
cores): a capture of the model (units.py: at another microbatch size or cp value) or the
prediction of the `auto` candidate the search will evaluate next (search._ahead).

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
import multiprocessing
import os
import pickle
import signal
import tempfile
from typing import Callable, Optional

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


@atexit.register
def _cancel_all() -> None:
    for child in list(_LIVE):
        child.cancel()
