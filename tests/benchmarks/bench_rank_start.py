"""How a local run's ranks start: a new interpreter each vs forked from one fork server,
measured side by side in one run (no timed assertions).

    python tests/benchmarks/bench_rank_start.py [--ranks 4] [--rounds 3]

A: what each rank paid before runtime/forkserver.py: `--ranks` new interpreters at once,
   each importing what a rank imports before its first line of work (forkserver.PRELOAD).
B: what it pays now: one fork server started with those imports, then `--ranks`
   processes forked from it, each importing the same list (already there) and exiting.
Both until every process has exited; wall time and the CPU time of the children. The
end-to-end figure (a whole `pipeplan run`) is in BENCHMARKS.md, "Where a local run's
ranks come from".
"""
from __future__ import annotations

import argparse
import importlib
import os
import resource
import subprocess
import sys
import time

from pipeplan.backends.runtime import forkserver


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _imports() -> None:
    for name in forkserver.PRELOAD:
        importlib.import_module(name)


def new_interpreters(ranks: int) -> tuple[float, float]:
    code = "; ".join(f"import {m}" for m in forkserver.PRELOAD)
    cpu, t0 = _children_cpu(), time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(ranks)]
    assert all(p.wait() == 0 for p in procs)
    return time.perf_counter() - t0, _children_cpu() - cpu


def forked(ranks: int) -> tuple[float, float]:
    """(The server's CPU shows once it is reaped, i.e. after `serving` ends.)"""
    cpu, t0 = _children_cpu(), time.perf_counter()
    with forkserver.serving(os.environ.get("PYTHONHASHSEED")):
        procs = [forkserver.start(_imports, (), dict(os.environ)) for _ in range(ranks)]
        for p in procs:
            p.join()
        assert all(p.exitcode == 0 for p in procs)
        wall = time.perf_counter() - t0
    return wall, _children_cpu() - cpu


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    print(f"{args.ranks} ranks, {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}; "
          f"imports: {', '.join(forkserver.PRELOAD)}")
    print("round  new interpreters: wall  CPU   fork server: wall  CPU   wall ratio")
    for r in range(args.rounds):
        a_wall, a_cpu = new_interpreters(args.ranks)
        b_wall, b_cpu = forked(args.ranks)
        print(f"{r:5d}  {a_wall:21.2f} s {a_cpu:5.1f} s  {b_wall:16.2f} s {b_cpu:5.1f} s"
              f"   {a_wall / b_wall:9.2f}x")


if __name__ == "__main__":
    main()
