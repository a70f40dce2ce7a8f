"""The measured CPU device model: what `check`/`compile` assume on a machine without CUDA when
the plan has no `device` section (not a 400 TFLOP/s accelerator).

Two numbers, both on one thread (the local launcher gives each rank one or a few):

* sustained FLOP/s: the best of a few timed float32 matmuls (512 x 512);
* host time per op: a small model runs op by op, and on a CPU each aten op costs
  dispatch, autograd bookkeeping and allocation on top of its FLOPs -- for the
  models a CPU trains that is most of the time (the README's example: 0.4 ms of
  FLOPs per stage forward at the matmul rate, ~1.5 ms measured). Timed on the
  example GPT's transformer block at width 8 (FLOPs negligible): seconds per op
  its forward dispatches, forward and backward (the same count the meta run takes
  per node, analysis.py), best of a few rounds.

Rounded to two significant digits and cached per machine and torch version in
~/.cache/pipeplan/cpu_flops.json (PIPEPLAN_CACHE moves it), so every compile on
one machine — `check`, the launcher's precompile, rank 0's compile, whatever
their thread settings — sees the same numbers and the cost-aware schedules stay
deterministic.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import platform
import time
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

N, REPEATS, ROUNDS = 512, 8, 5
WIDTH, TOKENS, BLOCKS = 8, 16, 4  # the op-time probe: FLOPs negligible, ops as a model's


@dataclass(frozen=True)
class CpuModel:
    flops_per_s: float
    op_s: float  # host seconds per aten op of a forward
    op_backward_s: float  # host seconds of backward per aten op of the forward
    origin: str


def cache_path() -> str:
    base = os.environ.get("PIPEPLAN_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                            "pipeplan")
    return os.path.join(base, "cpu_flops.json")


def _key() -> str:
    return f"{platform.machine()} {platform.processor() or '-'} {os.cpu_count()} cpus, " \
           f"torch {torch.__version__}"


def _two_digits(x: float) -> float:
    return float(f"{x:.2g}")


def _one_thread(fn):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn()
    finally:
        torch.set_num_threads(threads)


def measure_flops() -> float:
    """Best sustained one-thread float32 matmul FLOP/s over ROUNDS rounds of REPEATS."""
    def run():
        a, b = torch.randn(N, N), torch.randn(N, N)
        a @ b  # warm-up
        best = float("inf")
        for _ in range(ROUNDS):
            t = time.perf_counter()
            for _ in range(REPEATS):
                a @ b
            best = min(best, time.perf_counter() - t)
        return best
    return _two_digits(2 * N ** 3 * REPEATS / max(_one_thread(run), 1e-9))


def measure_op_times() -> tuple[float, float]:
    """(forward, backward) host seconds per op the probe's forward dispatches."""
    from ...examples.models.gpt import Block  # the example models' pre-norm block: their op mix
    from ..capture.analysis import OpCounter

    def run():
        torch.manual_seed(0)
        model = nn.Sequential(*(Block(WIDTH, 2, 4 * WIDTH) for _ in range(BLOCKS)))
        x = torch.randn(2, TOKENS, WIDTH, requires_grad=True)
        with OpCounter() as counted:
            model(x)
        for _ in range(ROUNDS):  # warm-up: the allocator's caches, lazy initialisation
            model(x).sum().backward()
        best_f = best_b = float("inf")
        for _ in range(ROUNDS * 4):
            t = time.perf_counter()
            loss = model(x).sum()
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            best_f, best_b = min(best_f, t1 - t), min(best_b, t2 - t1)
        return best_f / counted.count, best_b / counted.count
    f, b = _one_thread(run)
    return _two_digits(f), _two_digits(b)


def _cached(path: str, key: str) -> Optional[CpuModel]:
    try:
        with open(path, encoding="utf-8") as f:
            c = json.load(f)
        if c.get("key") == key and min(float(c[k]) for k in
                                       ("flops_per_s", "op_s", "op_backward_s")) > 0:
            return CpuModel(float(c["flops_per_s"]), float(c["op_s"]), float(c["op_backward_s"]),
                            f"measured CPU model ({key}, one thread; cached in {path})")
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


@contextlib.contextmanager
def _exclusive(path: str):
    """One process of the machine measures at a time (ranks compiling at once then all read
    the first one's numbers: their cost-aware schedules must agree); no lock where the
    cache folder is read-only."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        lock = open(f"{path}.lock", "a+")
    except OSError:
        yield
        return
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def cpu_model() -> CpuModel:
    """This CPU's model: the cached measurement, else a fresh one (then cached)."""
    path, key = cache_path(), _key()
    cached = _cached(path, key)
    if cached is not None:
        return cached
    with _exclusive(path):
        return _cached(path, key) or _measure_and_cache(path, key)


def _measure_and_cache(path: str, key: str) -> CpuModel:
    flops = measure_flops()
    op_s, op_backward_s = measure_op_times()
    try:
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"key": key, "flops_per_s": flops, "op_s": op_s,
                       "op_backward_s": op_backward_s}, f)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home: measured again next time
    return CpuModel(flops, op_s, op_backward_s,
                    f"measured CPU model ({key}, one thread; {N}x{N} float32 matmul and "
                    f"width-{WIDTH} transformer block probes)")
