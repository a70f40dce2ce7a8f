"""What a rank holds: its peak resident memory, read from the OS (printed at a run's end)."""
from __future__ import annotations

import resource
import sys
from dataclasses import dataclass


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


@dataclass(frozen=True)
class RankMemory:
    rank: int
    pp: int
    startup_s: float  # process start of the worker to the first step
    param_bytes: int  # parameters this rank materialised
    startup_peak: int  # peak RSS when the first step begins
    peak: int  # peak RSS at the end of the run


def memory_lines(ranks: list[RankMemory]) -> str:
    mb = 1 << 20
    return "\n".join(
        f"rank {m.rank} (pp {m.pp}): start-up {m.startup_s:.1f} s, parameters "
        f"{m.param_bytes / mb:.1f} MiB, peak RSS {m.startup_peak / mb:.0f} MiB at start-up, "
        f"{m.peak / mb:.0f} MiB in the run" for m in ranks)
