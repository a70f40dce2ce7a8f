"""Helpers for runtime tests: real gloo worlds with a hard timeout, and tiny plans.

`spawn(fn, world, *args, timeout=...)` forks `world` processes on 127.0.0.1
with a free port, runs `fn(rank, world, *args)` in each and returns the list
of their return values (ranks in order). The first worker exception fails
the test with its traceback; a hang is killed after `timeout` seconds.
`fresh=True` forks them from a fork server instead (`fn` importable by name), as a command
starts its ranks (backends/runtime/forkserver.py): a run that must not inherit this
process's state. (Forked runs once inherited DTensor's cached sharding decisions from a check's
fake world, with its groups: backends/parallel/pretrace.py now empties those caches.)
"""
from __future__ import annotations

import contextlib
import os
import pickle
import signal
import socket
import tempfile
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, out_dir: str, fn, args) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        result = fn(rank, world, *args)
        with open(os.path.join(out_dir, f"{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
    except BaseException:
        with open(os.path.join(out_dir, f"{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def _died(processes) -> list[str]:
    """A line per worker a signal ended (a native crash leaves no traceback: say which rank
    and which signal, before the others' tracebacks of the broken connection)."""
    return [f"rank {r} died of {signal.Signals(-p.exitcode).name}"
            for r, p in enumerate(processes) if p.exitcode is not None and p.exitcode < 0
            and -p.exitcode in signal.valid_signals() and p.exitcode != -signal.SIGTERM]


def spawn(fn, world: int, *args, timeout: float = 120.0, fresh: bool = False) -> list:
    from pipeplan.backends.runtime import forkserver

    with tempfile.TemporaryDirectory() as out_dir, \
            forkserver.serving(os.environ.get("PYTHONHASHSEED")) if fresh else \
            contextlib.nullcontext():
        ctx = mp.start_processes(_entry, args=(world, free_port(), out_dir, fn, args),
                                 nprocs=world, join=False,
                                 start_method="forkserver" if fresh else "fork")
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"distributed test did not finish in {timeout:.0f} s")
        except Exception:
            errors = [open(os.path.join(out_dir, n)).read()
                      for n in sorted(os.listdir(out_dir)) if n.endswith(".err")]
            died = _died(ctx.processes)
            if errors or died:
                raise AssertionError("worker failed:\n" + "\n".join(died) + "\n"
                                     + "\n=====\n".join(errors)) from None
            raise
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        results = []
        for r in range(world):
            with open(os.path.join(out_dir, f"{r}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        return results


@pytest.fixture(name="spawn")
def spawn_fixture():
    return spawn
