"""The measured CPU device model: what `check`/`compile` assume on a machine without CUDA when
the plan has no `device` section (not a 400 TFLOP/s accelerator).

Sustained FLOP/s = the best of a few timed float32 matmuls (512 x 512, on one
thread: the local launcher gives each rank one or a few), rounded to two
significant digits, cached per machine and torch version in
~/.cache/pipeplan/cpu_flops.json (PIPEPLAN_CACHE moves it), so every compile on
one machine — `check`, the launcher's precompile, rank 0's compile, whatever
their thread settings — sees the same number and the cost-aware schedules stay
deterministic.
"""
from __future__ import annotations

import json
import os
import platform
import time

import torch

N, REPEATS, ROUNDS = 512, 8, 5


def cache_path() -> str:
    base = os.environ.get("PIPEPLAN_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                            "pipeplan")
    return os.path.join(base, "cpu_flops.json")


def _key() -> str:
    return f"{platform.machine()} {platform.processor() or '-'} {os.cpu_count()} cpus, " \
           f"torch {torch.__version__}"


def measure_flops() -> float:
    """Best sustained one-thread float32 matmul FLOP/s over ROUNDS rounds of REPEATS."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(N, N), torch.randn(N, N)
        a @ b  # warm-up
        best = float("inf")
        for _ in range(ROUNDS):
            t = time.perf_counter()
            for _ in range(REPEATS):
                a @ b
            best = min(best, time.perf_counter() - t)
    finally:
        torch.set_num_threads(threads)
    flops = 2 * N ** 3 * REPEATS / max(best, 1e-9)
    return float(f"{flops:.2g}")


def cpu_flops() -> tuple[float, str]:
    """(FLOP/s, where it came from): the cached measurement, else a fresh one (then cached)."""
    path, key = cache_path(), _key()
    try:
        with open(path, encoding="utf-8") as f:
            cached = json.load(f)
        if cached.get("key") == key and float(cached["flops_per_s"]) > 0:
            return float(cached["flops_per_s"]), (f"measured CPU model ({key}, one thread; "
                                                  f"cached in {path})")
    except (OSError, ValueError, KeyError, TypeError):
        pass
    flops = measure_flops()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"key": key, "flops_per_s": flops}, f)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home: measured again next time
    return flops, f"measured CPU model ({key}, one thread; {N}x{N} float32 matmul probe)"
