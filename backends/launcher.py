"""Local launch: start one `python -m pipeplan ...` process per rank on this machine.

Each child gets the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR=127.0.0.1, a free MASTER_PORT), so the worker path is the same
as under torchrun. The launcher watches them: when one exits non-zero it
names the first rank that reported a failure, kills the rest and returns 1.
Children die with the launcher (PR_SET_PDEATHSIG on Linux) and are killed in
a `finally`, so no process outlives a run.
"""
from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Sequence

from .failure import ERROR_DIR_ENV, read_failures

GRACE_S = 2.0  # after the first failure, how long the others may take to report theirs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _threads_per_rank(world: int) -> int:
    return max(1, (os.cpu_count() or 1) // world)


def launch_local(argv: Sequence[str], world: int) -> int:
    """Run `python -m pipeplan *argv` as `world` ranks; 0 when every rank succeeded."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="pipeplan-errors-") as errors:
        procs: list[subprocess.Popen] = []
        try:
            for rank in range(world):
                env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world),
                           LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                           MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
                env[ERROR_DIR_ENV] = errors
                env.setdefault("OMP_NUM_THREADS", str(_threads_per_rank(world)))
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "pipeplan", *argv], env=env,
                    preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None))
            return _watch(procs, errors)
        finally:
            _kill_all(procs)


def _watch(procs: list[subprocess.Popen], errors: str) -> int:
    while True:
        codes = [p.poll() for p in procs]
        if all(c == 0 for c in codes):
            return 0
        failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            deadline = time.monotonic() + GRACE_S
            while time.monotonic() < deadline and not read_failures(errors):
                time.sleep(0.05)
            _kill_all(procs)
            reports = read_failures(errors)
            if reports:
                first = reports[0]
                print(f"pipeplan: run failed: {first.message}", file=sys.stderr)
                others = len({f.rank for f in reports if f.rank != first.rank})
                print(f"pipeplan: stopped all {len(procs)} ranks"
                      + (f" ({others} more reported errors after it)" if others else ""),
                      file=sys.stderr)
            else:
                r = failed[0]
                print(f"pipeplan: run failed: rank {r} exited with code {codes[r]} "
                      f"without reporting an error; stopped all {len(procs)} ranks",
                      file=sys.stderr)
            return 1
        time.sleep(0.05)


def _kill_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + 3.0
    for p in procs:
        try:
            p.wait(timeout=max(0.01, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
