"""What a rank holds: its peak resident memory, read from the OS (printed at a run's end);
and, before a local run launches, whether the compiler's estimate of it fits this machine."""
from __future__ import annotations

import ctypes
import ctypes.util
import resource
import sys
from dataclasses import dataclass

from ...compiler.capture.budget import machine_memory_bytes

_M_MMAP_THRESHOLD = -3  # glibc mallopt parameter (malloc.h)


def return_large_blocks_to_os(threshold: int = 1 << 20) -> bool:
    """CPU runs on glibc: serve every allocation of `threshold` bytes or more (weights,
    gradients, activations) from its own mapping, returned to the OS when freed.

    glibc otherwise raises its mmap threshold each time a large block is freed (up to
    32 MiB), after which tensors of that size come from the heap, whose freed holes stay
    resident: a rank's peak RSS then grows past what it holds. Fixing the threshold turns
    that adaptation off (values are unchanged: only where memory comes from). Returns
    whether it applied (False off glibc)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, threshold))
    except (OSError, AttributeError):
        return False


def peak_rss_bytes() -> int:
    """This process's peak resident set size: Linux's VmHWM (this process image only), else
    getrusage's ru_maxrss."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def held_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (None skipped; a DTensor: its local
    shard), what the rank holds for them."""
    seen = {}
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if hasattr(t, "to_local") else t
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


@dataclass(frozen=True)
class RankMemory:
    rank: int
    pp: int
    startup_s: float  # process start of the worker to the first step
    param_bytes: int  # parameters this rank materialised
    startup_peak: int  # peak RSS when the first step begins
    peak: int  # peak RSS at the end of the run
    grad_bytes: int = 0  # gradients held at the first optimizer step (measured)
    optimizer_bytes: int = 0  # optimizer state at the end of the run (measured)
    activation_bytes: int = 0  # the plan's estimate of the rank's peak saved activations
    graphs: str = ""  # compile.mode = graphs | inductor: tracing / compile seconds per stage


def graphs_note(runners) -> str:
    """compile.mode = graphs | inductor: each stage's seconds of tracing and partitioning
    (and of inductor compiling, with its cache hits); "" for eager stage runners."""
    from .inductor import COMPILES

    parts = [f"stage {s} {r.trace_seconds:.1f} s" for s, r in sorted(runners.items())
             if hasattr(r, "trace_seconds")]
    if not parts:
        return ""
    hits = sum(c.cache_hit for c in COMPILES)
    cache = f"; inductor {sum(c.seconds for c in COMPILES):.1f} s of it, cache hits " \
        f"{hits}/{len(COMPILES)}" if COMPILES else ""
    return "graphs traced: " + ", ".join(parts) + cache


def memory_lines(ranks: list[RankMemory]) -> str:
    mb = 1 << 20
    return "\n".join(
        f"rank {m.rank} (pp {m.pp}): start-up {m.startup_s:.1f} s, parameters "
        f"{m.param_bytes / mb:.1f} MiB, peak RSS {m.startup_peak / mb:.0f} MiB at start-up, "
        f"{m.peak / mb:.0f} MiB in the run" + (f"; {m.graphs}" if m.graphs else "")
        for m in ranks)


GIB = 1 << 30


def check_local_memory(plan, compiled, total: int | None = None) -> None:
    """Before a local CPU run launches: the compiler's estimate of what all its ranks hold
    (parameters, gradients, optimizer state, activations: the meta trace's shapes, nothing
    allocated) fits this machine's memory, else a PlanError at `model.args` (the values
    that scale the model). `total`: the machine's bytes (default: read from the OS)."""
    from ...dsl.errors import PlanError

    total = machine_memory_bytes() if total is None else total
    est = compiled.estimates
    if est is None or not total:
        return
    parts = {k: sum(getattr(r, f"{k}_bytes") for r in est.ranks)
             for k in ("param", "grad", "optimizer", "activation")}
    need = sum(parts.values())
    if need <= total:
        return
    raise PlanError.at(
        plan, "model.args", f"this model needs about {need / GIB:,.1f} GiB on its {len(est.ranks)} "
        f"local ranks (parameters {parts['param'] / GIB:,.1f}, gradients "
        f"{parts['grad'] / GIB:,.1f}, optimizer state {parts['optimizer'] / GIB:,.1f}, "
        f"activations {parts['activation'] / GIB:,.1f} GiB: the compiler's estimate from "
        f"the meta trace), more than this machine's {total / GIB:,.1f} GiB; nothing was "
        f"started", "make the model smaller (model.args), or run it under torchrun on "
        "machines that hold it")
