"""Local launch: start one process per rank on this machine, each running `pipeplan ...`.

The ranks are forked from a fork server that imported torch once (forkserver.py:
each is still a fresh process, with none of the launcher's state). Each gets the
torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR=127.0.0.1, a free MASTER_PORT), so the worker path is the same
as under torchrun, and one PYTHONHASHSEED (`hash_seed`: the user's when set, else
the plan's train.seed): a model whose Python code iterates over a set (Gemma 3's
`set(config.layer_types)`) is then captured in the same node order on every rank
(backends/verify/run.py runs the reference under the same value). Everything
listens on loopback only (rank 0's store: worker.local_store; gloo:
GLOO_SOCKET_IFNAME=lo unless set). The launcher
watches them: when one exits non-zero, or 0 without reporting that it
finished, or stops beating (its heartbeat, failure.py, stands still for
`heartbeat_s`), it names the rank that failed first (one killed by a signal,
else the earliest error report; see failure.explain) with its last action,
and what the others reported as a consequence, kills the rest and returns 1.
SIGTERM to the launcher stops every rank, says which, and returns 143.
Ranks die with the launcher (even a SIGKILLed one: `_die_with_launcher`) and are
killed in a `finally`, so no process outlives a run; the temporary folder goes with it.

A decoupled DiLoCo run (`islands` given: the ranks of each dp replica) survives the
death of a whole island other than island 0: when one of its ranks dies by a signal,
the launcher kills the island's other ranks, says so, tells the coordinators through
the job's store (decoupled.py) and goes on; the failures those ranks report are
consequences. Any other failure stops every rank as above.
"""
from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys
import tempfile
import time
from typing import Optional, Sequence

from . import forkserver
from .failure import (ERROR_DIR_ENV, HEARTBEAT_S, explain, read_beacon, read_failures,
                      read_heartbeat, reported_done)

GRACE_S = 2.0  # after the first failure, how long the others may take to report theirs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _prctl(option: int, arg) -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(option, arg)
    except OSError:
        pass


RANK_NAME = "pipeplan r{rank}"  # what `ps -o comm`, `top` and /proc/PID/comm show for a rank


def _threads_per_rank(world: int) -> int:
    return max(1, (os.cpu_count() or 1) // world)


HASH_SEED_ENV = forkserver.HASH_SEED


def hash_seed(seed: int) -> str:
    """The PYTHONHASHSEED every rank (and the verify reference) runs under: the user's when
    set, else the plan's seed (folded into the range Python accepts)."""
    return os.environ.get(HASH_SEED_ENV) or str(seed % (2 ** 32 - 1) + 1)


def launch_local(main, argv: Sequence[str], world: int,
                 islands: Optional[Sequence[Sequence[int]]] = None,
                 seed: Optional[int] = None, heartbeat_s: float = HEARTBEAT_S) -> int:
    """Run `main(argv)` (the CLI's: `pipeplan *argv`) as `world` ranks, each in a process
    of its own; 0 when every rank succeeded, `main` returning 0 or None.
    `seed`: the plan's train.seed, giving every rank the same PYTHONHASHSEED (`hash_seed`).

    The ranks run in their own session, so a Ctrl-C in the terminal reaches only the
    launcher: it stops every rank at once (see `_kill_all`) and the KeyboardInterrupt
    goes on to the CLI, which prints one "interrupted" line."""
    port = free_port()
    fixed = _fixed_at_start(world, seed)
    with tempfile.TemporaryDirectory(prefix="pipeplan-errors-") as errors, \
            forkserver.serving(*fixed):
        procs: list[_Rank] = []
        previous = _on_sigterm()
        try:
            for rank in range(world):
                env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world),
                           LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                           MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
                env[ERROR_DIR_ENV] = errors
                env[LOCAL_STORE_ENV] = "1"
                env.setdefault("GLOO_SOCKET_IFNAME", LOOPBACK)
                forkserver.put(env, *fixed)
                procs.append(_Rank(forkserver.start(_as_rank, (main, list(argv)), env)))
            return _watch(procs, errors, _Islands(islands, port) if islands else None,
                          heartbeat_s)
        except _Terminated:
            live = [r for r, p in enumerate(procs) if p.poll() is None]
            _kill_all(procs)
            seen = [f"rank {r} in {w}" for r in live if (w := read_beacon(errors, r))]
            print(f"pipeplan: stopped by SIGTERM: stopped ranks {', '.join(map(str, live))}"
                  + (f" ({'; '.join(seen)})" if seen else "") + "; removed its temporary "
                  "folder", file=sys.stderr, flush=True)
            return 128 + signal.SIGTERM
        finally:
            _kill_all(procs)
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)


def rank_server(world: int, seed: Optional[int]):
    """The fork server `launch_local(main, argv, world, seed=seed)` forks its ranks from,
    started now (a command starts it before compiling, so its imports overlap that)."""
    return forkserver.serving(*_fixed_at_start(world, seed))


def _fixed_at_start(world: int, seed: Optional[int]) -> tuple:
    """The ranks' PYTHONHASHSEED and OMP_NUM_THREADS: fixed as their interpreter starts."""
    return (hash_seed(seed) if seed is not None else os.environ.get(HASH_SEED_ENV),
            os.environ.get(forkserver.THREADS) or str(_threads_per_rank(world)))


def _as_rank(main, argv: list) -> None:
    """A forked process becomes a rank: a session of its own (a Ctrl-C in the terminal
    reaches only the launcher), dying with the launcher (`_die_with_launcher`), named
    RANK_NAME (its command line is the fork server's), then `main(argv)`, ending as an
    interpreter would: its atexit functions run (trackers' and torch's, temporary folders'
    finalizers), which multiprocessing skips in the processes it starts."""
    import atexit

    sys.argv = [sys.argv[0], *argv]
    os.setsid()
    _die_with_launcher()
    if sys.platform.startswith("linux"):
        _prctl(15, RANK_NAME.format(rank=os.environ["RANK"]).encode())  # PR_SET_NAME
    try:
        code = main(argv)
    finally:
        atexit._run_exitfuncs()
    sys.exit(code)


def _die_with_launcher() -> None:
    """Kill this rank when the launcher dies, even by SIGKILL: the launcher is not its
    parent (the fork server is), so the kernel's parent-death signal cannot say it; the
    pipe multiprocessing keeps from the process that started this one (parent_process's
    sentinel) ends when that process does."""
    import multiprocessing
    import threading
    from multiprocessing.connection import wait

    launcher = multiprocessing.parent_process()

    def watch() -> None:
        wait([launcher.sentinel])
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="pipeplan-launcher-watch", daemon=True).start()


class _Rank:
    """A started rank as the watch loop sees it: subprocess.Popen's poll, send_signal and
    wait over a multiprocessing process (its exit code: negative for a signal, as Popen's)."""

    def __init__(self, process):
        self.process = process

    def poll(self) -> Optional[int]:
        return self.process.exitcode

    def send_signal(self, sig: int) -> None:
        os.kill(self.process.pid, sig)

    def wait(self) -> int:
        self.process.join()
        return self.process.exitcode


LOCAL_STORE_ENV = "PIPEPLAN_LOCAL_STORE"  # worker.local_store: rank 0's store on loopback
LOOPBACK = "lo"  # Linux's loopback interface, for gloo


class _Terminated(Exception):
    """SIGTERM reached the launcher."""


def _on_sigterm():
    """Turn SIGTERM into _Terminated (main thread only); returns the previous handler."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return None

    def stop(signum, frame):
        raise _Terminated()

    return signal.signal(signal.SIGTERM, stop)


def _watch(procs: list[_Rank], errors: str, islands: "Optional[_Islands]" = None,
           heartbeat_s: float = HEARTBEAT_S) -> int:
    beats = _Heartbeats(len(procs), errors, heartbeat_s)
    while True:
        codes = [p.poll() for p in procs]
        if islands is not None:
            islands.drop_dead(procs, codes, errors)
            codes = [0 if r in islands.dropped else c for r, c in enumerate(codes)]
        dropped = islands.dropped if islands is not None else set()
        unreported = frozenset(r for r, c in enumerate(codes) if c == 0 and r not in dropped
                               and not reported_done(errors, r))
        if all(c == 0 for c in codes) and not unreported:
            return 0
        stopped = beats.stopped(codes)
        if stopped is not None:
            _kill_all(procs)
            where = read_beacon(errors, stopped)
            print(f"pipeplan: run failed: rank {stopped} stopped responding: no heartbeat for "
                  f"{heartbeat_s:g} s" + (f" (last seen in {where})" if where else "")
                  + f"; stopped all {len(procs)} ranks", file=sys.stderr, flush=True)
            return 1
        if unreported or any(c not in (None, 0) for c in codes):
            # the others report what they saw (or stop) within the grace period
            deadline = time.monotonic() + GRACE_S
            while time.monotonic() < deadline and not _settled(procs, errors):
                time.sleep(0.05)
            dropped = islands.dropped if islands is not None else set()
            final = {r: 0 if r in dropped else p.poll() for r, p in enumerate(procs)}
            codes_then = {r: (c if c is not None else final[r]) for r, c in enumerate(codes)}
            _kill_all(procs)
            beacons = {r: read_beacon(errors, r) for r in range(len(procs))}
            for line in explain(codes_then, read_failures(errors), beacons, unreported):
                print(f"pipeplan: {line}", file=sys.stderr)
            return 1
        time.sleep(0.05)


class _Heartbeats:
    """When each running rank's heartbeat counter last moved (failure.Beacon)."""

    def __init__(self, world: int, errors: str, limit_s: float):
        self.errors, self.limit_s = errors, limit_s
        self.last: list = [None] * world  # (counter, when it was first seen at that value)

    def stopped(self, codes: list) -> Optional[int]:
        """The first running rank whose heartbeat stood still for limit_s, or None."""
        now = time.monotonic()
        for r, code in enumerate(codes):
            beat = read_heartbeat(self.errors, r) if code is None else None
            if beat is None:  # not started yet (no beacon), or exited
                continue
            if self.last[r] is None or self.last[r][0] != beat:
                self.last[r] = (beat, now)
            elif now - self.last[r][1] > self.limit_s:
                return r
        return None


def _settled(procs: list[_Rank], errors: str) -> bool:
    """Every rank has exited, or one has reported an error: the cause's own report, or
    (after a signal death) a neighbour's, which says what the death did to the others."""
    return all(p.poll() is not None for p in procs) or bool(read_failures(errors))


def _kill_all(procs: list[_Rank]) -> None:
    """Stop every live rank at once: SIGSTOP them all first (a stopped rank keeps its
    sockets open, so none sees a peer vanish and prints gloo's C++ errors), then SIGKILL.
    Ctrl-C is held off meanwhile so a second one cannot leave ranks behind."""
    live = [p for p in procs if p.poll() is None]
    previous = _hold_sigint()
    try:
        for p in live:
            _signal(p, signal.SIGSTOP)
        for p in live:
            _signal(p, signal.SIGKILL)
        for p in live:
            p.wait()
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


def _signal(p: _Rank, sig: int) -> None:
    try:
        p.send_signal(sig)
    except ProcessLookupError:
        pass


def _hold_sigint():
    import threading

    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGINT, signal.SIG_IGN)


class _Islands:
    """The islands of a decoupled DiLoCo run, and those dropped so far."""

    def __init__(self, islands: Sequence[Sequence[int]], port: int):
        self.islands = [list(i) for i in islands]
        self.port = port
        self.dropped: set[int] = set()  # ranks of lost islands

    def drop_dead(self, procs: list[_Rank], codes: list, errors: str) -> None:
        """Drop every island (but island 0) in which a rank died by a signal."""
        for i, ranks in enumerate(self.islands):
            if i == 0 or ranks[0] in self.dropped:
                continue
            killed = [r for r in ranks if codes[r] is not None and codes[r] < 0]
            if not killed:
                continue
            _kill_all([procs[r] for r in ranks])
            self.dropped.update(ranks)
            where = read_beacon(errors, killed[0])
            left = [j for j, rs in enumerate(self.islands) if rs[0] not in self.dropped]
            print(f"pipeplan: island {i} lost: rank {killed[0]} was killed by signal "
                  f"{-codes[killed[0]]}" + (f" in {where}" if where else "")
                  + f"; stopped its ranks {ranks}; the run goes on with islands {left}",
                  file=sys.stderr, flush=True)
            self._tell(i)
            for r in ranks:  # their consequences are not the run's failures
                try:
                    os.remove(os.path.join(errors, f"rank{r}.json"))
                except OSError:
                    pass

    def _tell(self, island: int) -> None:
        from datetime import timedelta

        import torch.distributed as dist

        from ..parallel.diloco.decoupled import lost_key

        try:
            store = dist.TCPStore("127.0.0.1", self.port, is_master=False,
                                  timeout=timedelta(seconds=5), wait_for_workers=False)
            store.set(lost_key(island), "1")
        except Exception as e:  # the coordinators then time the island out instead
            print(f"pipeplan: could not tell the coordinators: {e}", file=sys.stderr)
