"""Where a command's processes come from: forked from one server that imported torch once.

Every rank of a local run (launcher.py) and verify's single-process reference
(verify/run.py) is a fresh process: it inherits nothing of the command that starts it
(its compiled plan, DTensor's caches, its threads). Started as a new interpreter each,
they would each import torch and torch's export stack again (2.3 + 2.4 s here per
process; BENCHMARKS.md, "Where a local run's ranks come from"), on a machine with
fewer cores than ranks one after the other. Instead, multiprocessing's fork server
imports those modules once, in a new interpreter started with the run's environment,
and forks every process from it: each still starts with none of the command's state.

What the server's interpreter fixes at its start, and so keys it (`ensure`): the
PYTHONHASHSEED every rank must share (launcher.hash_seed: set iteration order in a
model's code), and OMP_NUM_THREADS (read by the BLAS and OpenMP runtimes as they load;
each rank still sets torch's thread count itself, worker.py). Each process gets its
own environment (RANK, ports, ...) before it runs anything. A command starts the server
(`serving`) before compiling its plan, so the imports overlap that work; the server
stops when the command's launch ends (it holds the terminal's streams of its start).
Nothing it imports may touch a device: a CUDA driver initialised before a fork cannot
be used after it (tests/backends/test_launch_trust.py checks PRELOAD calls none of
torch.cuda's device functions).
"""
from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.forkserver as _mp_forkserver
import os
import signal
from typing import Optional

PRELOAD = ("torch", "torch._dynamo", "torch.export", "torch.distributed",
           "pipeplan.backends.runtime.worker")  # what every rank imports before it works
HASH_SEED, THREADS = "PYTHONHASHSEED", "OMP_NUM_THREADS"  # read as an interpreter starts

_running: Optional[tuple] = None  # (hash seed, threads) of the server started here


def _server():
    return _mp_forkserver._forkserver  # the one multiprocessing keeps per process


def ensure(hash_seed: Optional[str], threads: Optional[str] = None) -> bool:
    """A fork server started with PYTHONHASHSEED = `hash_seed` and OMP_NUM_THREADS =
    `threads` (None: any running one's, else this process's own); True when this call
    started it (the caller then stops it)."""
    global _running
    if _serves(hash_seed, threads):
        return False
    stop()
    threads = threads if threads is not None else os.environ.get(THREADS)
    with _starting_with(hash_seed, threads):
        _server().set_forkserver_preload(list(PRELOAD))
        _server().ensure_running()
    _running = (hash_seed, threads)
    return True


@contextlib.contextmanager
def _starting_with(hash_seed: Optional[str], threads: Optional[str]):
    """This process's environment as a server's interpreter starts with it (multiprocessing
    starts the server with this process's environment)."""
    before = (os.environ.get(HASH_SEED), os.environ.get(THREADS))
    put(os.environ, hash_seed, threads)
    try:
        yield
    finally:
        put(os.environ, *before)


def put(env, hash_seed: Optional[str], threads: Optional[str]):
    """`env` (a dict, or os.environ) with its PYTHONHASHSEED and OMP_NUM_THREADS set to
    these (None: removed)."""
    for key, value in ((HASH_SEED, hash_seed), (THREADS, threads)):
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def _serves(hash_seed: Optional[str], threads: Optional[str]) -> bool:
    """A server started here runs with `hash_seed` and `threads` (None: any)."""
    return _running is not None and _running[0] == hash_seed and threads in (None, _running[1])


def stop() -> None:
    """Kill the server (it may still be importing: a command that fails before launching
    does not wait for that) and reap it, as multiprocessing's own tests stop it."""
    global _running
    server = _server()
    if server._forkserver_pid is not None:
        try:
            os.kill(server._forkserver_pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    server._stop()
    _running = None


@contextlib.contextmanager
def serving(hash_seed: Optional[str], threads: Optional[str] = None):
    """A server (`ensure`) for the processes the block starts; stopped after it."""
    started = ensure(hash_seed, threads)
    try:
        yield
    finally:
        if started:
            stop()


def start(target, args: tuple, environ: dict) -> multiprocessing.Process:
    """Fork `target(*args)` from the server `serving` runs for `environ`'s PYTHONHASHSEED
    (and OMP_NUM_THREADS where it names one); `environ` becomes the process's whole
    environment before `target` runs."""
    wanted = (environ.get(HASH_SEED), environ.get(THREADS))
    if not _serves(*wanted):
        raise RuntimeError(f"no fork server runs for {wanted} (started: {_running})")
    process = multiprocessing.get_context("forkserver").Process(
        target=_run, args=(target, args, environ))
    with _starting_with(*_running):  # a server that died is started again, as it was
        process.start()
    return process


def _run(target, args: tuple, environ: dict) -> None:
    os.environ.clear()
    os.environ.update(environ)
    target(*args)
