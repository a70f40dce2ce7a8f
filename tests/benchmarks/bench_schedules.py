"""On-demand schedule benchmark (minutes; not part of the test suite):

    PYTHONPATH=.. python tests/benchmarks/bench_schedules.py [--quick | --generation | --skip]

1. auto against torch's ScheduleZBVZeroBubble (built from torch's own class, timed by
   pipeplan as torch runs it: receives matched by tag) and the issue's closed-form
   optimum, p=4, m=8 and p=8, m=32, memory limit p, four cost settings;
2. auto under per-stage costs (first and last stage 2x, p=4, m=8, memory p);
3. generate + verify + simulate at (p, m) = (64, 1024) for every fixed kind;
4. one list-scheduling run at (64, 1024) stepped through and with its repeated periods
   skipped (greedy_period), side by side (`--skip`: this section alone);
5. auto at (16, 64).
Times are CPU seconds of this process (the machine is shared: wall time counts the
other processes too) and wall seconds.
"""
from __future__ import annotations

import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "schedules"))

import torch.distributed.pipelining.schedules as ts  # noqa: E402
from test_torch_interop import torch_csv  # noqa: E402

from pipeplan.schedules import Costs, generate, schedule_from_csv, simulate, verify  # noqa: E402
from pipeplan.schedules.gen_auto import auto_bound  # noqa: E402
from pipeplan.schedules.gen_greedy import Policy, timed_run  # noqa: E402
from pipeplan.schedules.gen_zero_bubble import vhalf_limit, vmin_limit, zbh2_limit  # noqa: E402
from pipeplan.schedules.ir import loop_placement, v_placement  # noqa: E402

SETTINGS = [("1,1,1,0", Costs()), ("1,1.5,0.5,0", Costs(1, 1.5, 0.5)), ("1,1,1,0.1", Costs(latency=0.1)),
            ("1,2,1,0", Costs(1, 2, 1))]
OPTIMUM = {(4, 8): (0.059, 0.103, 0.091, 0.086), (8, 32): (0.035, 0.066, 0.055, 0.052)}  # the table


def timed(fn):
    c0, w0 = time.process_time(), time.perf_counter()
    out = fn()
    return out, time.process_time() - c0, time.perf_counter() - w0


def auto_table(sizes) -> bool:
    ok = True
    print("| p, m | F,B,W,c | auto | bound | torch ZBV | optimum (issue) | auto CPU s | auto wall s | auto's pick |")
    print("|---|---|---|---|---|---|---|---|---|")
    for p, m in sizes:
        torch_order = schedule_from_csv(torch_csv(ts.ScheduleZBVZeroBubble, p, m))
        for (label, costs), optimum in zip(SETTINGS, OPTIMUM[(p, m)]):
            s, cpu, wall = timed(lambda: generate("auto", p, m, costs=costs, memory_limit=p))
            verify(s, memory_limit=p)
            r = simulate(s, costs)
            bound = 1 - sum(r.busy) / (p * auto_bound(p, m, None, costs, p))
            theirs = simulate(torch_order, costs, in_order=False).bubble
            good = r.bubble <= theirs + 1e-9 and r.bubble <= optimum + 0.005
            ok &= good
            print(f"| {p}, {m} | {label} | {r.bubble:.4f} | {bound:.4f} | {theirs:.4f} | {optimum:.3f} | "
                  f"{cpu:.1f} | {wall:.1f} | {s.name[5:]}{'' if good else ' (MISSES a target)'} |")
    return ok


def stage_costs_row() -> None:
    p, m = 4, 8
    table = [(0.5, 0.5, 0.5)] * (2 * p)
    table[0] = table[-1] = (1.0, 1.0, 1.0)
    costs = Costs(per_stage=tuple(table))
    s, cpu, _ = timed(lambda: generate("auto", p, m, costs=costs, memory_limit=p))
    print(f"\nstage costs 2x first/last, p=4, m=8, memory 4: auto {simulate(s, costs).bubble:.4f} "
          f"placement {s.stage_to_rank} ({s.name}), {cpu:.1f} s CPU")


def generation(p: int = 64, m: int = 1024) -> None:
    print(f"\n| kind (p={p}, m={m}) | actions | generate+verify CPU s | simulate CPU s | total CPU s | wall s |")
    print("|---|---|---|---|---|---|")
    for kind in ("gpipe", "1f1b", "interleaved", "zbh1", "zbh2", "zbv", "vhalf", "vmin", "dualpipev"):
        s = None
        gc.collect()  # each kind starts from a clean heap (the previous one's ~10^6 objects freed)
        w0 = time.perf_counter()
        s, gen_cpu, _ = timed(lambda: generate(kind, p, m))
        _, sim_cpu, _ = timed(lambda: simulate(s, Costs(1, 1.5, 0.5, latency=0.05)))
        print(f"| {kind} | {s.num_actions} | {gen_cpu:.2f} | {sim_cpu:.2f} | {gen_cpu + sim_cpu:.2f} | "
              f"{time.perf_counter() - w0:.2f} |")


def period_skip(p: int = 64, m: int = 1024) -> None:
    print(f"\n| run (p={p}, m={m}) | stepped CPU s | skipped CPU s | ratio | period (microbatches) | copies |")
    print("|---|---|---|---|---|---|")
    for kind in ("zbh2", "vhalf", "vmin"):
        placement = loop_placement(p, 1) if kind == "zbh2" else v_placement(p)
        limit = {"zbh2": zbh2_limit, "vhalf": vhalf_limit, "vmin": vmin_limit}[kind](p)
        for forward_first in (False, True):
            policy = Policy(split=True, limits=(limit,) * p, forward_first=forward_first)
            table = Costs().stage_table(placement)
            gc.collect()
            stepped, cpu_stepped, _ = timed(lambda: timed_run(kind, placement, m, table, policy, skip_periods=False))
            gc.collect()
            skipped, cpu_skipped, _ = timed(lambda: timed_run(kind, placement, m, table, policy))
            assert skipped.rows == stepped.rows and skipped.makespan == stepped.makespan
            print(f"| {kind} {'forward' if forward_first else 'backward'}-first | {cpu_stepped:.3f} | "
                  f"{cpu_skipped:.3f} | {cpu_stepped / cpu_skipped:.1f}x | {skipped.skip.shift} | "
                  f"{skipped.skip.copies} |")


def auto_16() -> None:
    for label, costs in SETTINGS[:2]:
        s, cpu, wall = timed(lambda: generate("auto", 16, 64, costs=costs, memory_limit=16))
        r = simulate(s, costs)
        bound = 1 - sum(r.busy) / (16 * auto_bound(16, 64, None, costs, 16))
        print(f"auto p=16, m=64, {label}: bubble {r.bubble:.4f}, bound {bound:.4f}, {cpu:.1f} s CPU, "
              f"{wall:.1f} s wall")


if __name__ == "__main__":
    if "--generation" in sys.argv:  # section 3 alone
        generation()
        sys.exit(0)
    if "--skip" in sys.argv:  # section 4 alone
        period_skip()
        sys.exit(0)
    quick = "--quick" in sys.argv
    ok = auto_table([(4, 8)] if quick else [(4, 8), (8, 32)])
    stage_costs_row()
    if not quick:
        generation()
        period_skip()
        auto_16()
    sys.exit(0 if ok else 1)
