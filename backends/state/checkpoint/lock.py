"""One writer per checkpoint folder: `DIR/.pipeplan.lock`.

The run that writes train.checkpoint.dir holds an exclusive `flock` on the
lock file for its whole life, and the file says who holds it (JSON: pid,
host, started, command). A second run on the same folder finds the lock taken
and is refused before launch, naming the holder. The kernel drops a flock
when its process dies, so a lock file left by a run that was killed
(SIGKILL, a crash, a lost node) is stale: the next run takes it over and says
whose it was. Released on exit (the file is removed).

Who holds it: `pipeplan run`'s local launcher (its ranks inherit
`PIPEPLAN_CHECKPOINT_LOCK` and do not lock again); under torchrun, rank 0.
On a network file system flock is only as good as its lock manager (NFSv4:
yes; some FUSE mounts: no).
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from typing import Optional

from ....errors import PipeplanError

LOCK = ".pipeplan.lock"
HELD_ENV = "PIPEPLAN_CHECKPOINT_LOCK"  # set for a launcher's ranks: the launcher holds it


class FolderInUse(PipeplanError):
    """Another live run holds the checkpoint folder."""


def _holder(text: str) -> str:
    try:
        h = json.loads(text)
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(h["started"])))
        return f"pid {h['pid']} on {h['host']} (started {started}: {h.get('command', '?')})"
    except (ValueError, KeyError, TypeError):
        return "an unknown process (unreadable lock file)"


class FolderLock:
    """An exclusive lock on a checkpoint folder; `with FolderLock(dir):` or acquire/release."""

    def __init__(self, folder: str):
        self.folder = folder
        self.path = os.path.join(folder, LOCK)
        self.fd: Optional[int] = None
        self.stale: Optional[str] = None  # whose stale lock was taken over

    def acquire(self) -> "FolderLock":
        os.makedirs(self.folder, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                text = os.read(fd, 4096).decode("utf-8", "replace")
                os.close(fd)
                raise FolderInUse(
                    f"checkpoint folder {self.folder} is in use by {_holder(text)}; nothing "
                    f"was started. Wait for that run or stop it, or point "
                    f"train.checkpoint.dir at another folder (lock: {self.path})") from None
            try:  # the file we locked may have been removed by its releasing holder meanwhile
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        old = os.read(fd, 4096).decode("utf-8", "replace").strip()
        if old:
            self.stale = _holder(old)
            print(f"pipeplan: took over the stale lock of {self.folder}: {self.stale} is "
                  f"gone", file=sys.stderr, flush=True)
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
              "command": " ".join(sys.argv[:3])[:200]}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        os.fsync(fd)
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            os.remove(self.path)
        except OSError:
            pass
        os.close(self.fd)
        self.fd = None

    def __enter__(self) -> "FolderLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
