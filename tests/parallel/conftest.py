"""Run a function on N real gloo processes (127.0.0.1, free port) with a hard timeout.

Workers are forked (no re-import of torch, and test-local functions need no
pickling); each asserts on its own, and the first worker exception fails the
test with its traceback. A hung collective is killed after `timeout` seconds.
"""
from __future__ import annotations

import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn, args) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def run_workers(fn, world: int, *args, timeout: float = 120.0) -> None:
    ctx = mp.start_processes(_entry, args=(world, free_port(), fn, args), nprocs=world,
                             join=False, start_method="fork")
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                raise TimeoutError(f"distributed test did not finish in {timeout:.0f} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()


import pytest  # noqa: E402


@pytest.fixture(name="run_workers")
def run_workers_fixture():
    return run_workers
