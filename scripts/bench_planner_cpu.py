"""CPU end-to-end: plan the example GPT on 4 local ranks, run the planner's top 3, compare orders.

`pipeplan plan` (this CPU's measured device model, no device section) writes its top 3 plans;
each runs under `pipeplan run` (gloo processes on this machine) for a few steps, the three
alternating round by round so drift hits them alike; the median measured step time per
plan (warm-up steps dropped) is printed beside the prediction, with the load average
before and after (how quiet the machine was).

    python scripts/bench_planner_cpu.py [--rounds 2] [--steps 6] [--memory-gb 2]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLAN = os.path.join(HERE, "examples", "gpt_pp4_1f1b.plan")


def pipeplan(*args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "pipeplan", *args], capture_output=True,
                         text=True, timeout=1800)
    if out.returncode:
        raise SystemExit(f"pipeplan {' '.join(args)} failed:\n{out.stdout}\n{out.stderr}")
    return out.stdout


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--memory-gb", type=float, default=2.0)
    args = ap.parse_args(argv)
    load0 = os.getloadavg()
    work = tempfile.mkdtemp(prefix="planner_cpu_")
    plans, predicted = [], []
    for pick in (1, 2, 3):
        out = os.path.join(work, f"top{pick}.plan")
        text = pipeplan("plan", PLAN, "--gpus", "4", "--memory", str(args.memory_gb),
                        "--top", "3", "--pick", str(pick), "-o", out, "--no-progress",
                        "--no-verify")
        row = [ln for ln in text.splitlines() if ln.startswith(f"  {pick}  ")][0]
        predicted.append(float(row.split()[-6]))  # step s, then 5 more columns
        plans.append(out)
        if pick == 1:
            print(text)
    measured = {p: [] for p in plans}
    for _ in range(args.rounds):
        for p in plans:
            metrics = p + ".jsonl"
            pipeplan("run", p, "--steps", str(args.steps), "--metrics", metrics)
            with open(metrics) as f:
                steps = [json.loads(line)["step_time_s"] for line in f if line.strip()]
            measured[p].extend(steps[2:])  # the first steps warm up
    load1 = os.getloadavg()
    print(f"load average before {load0[0]:.1f}, after {load1[0]:.1f} "
          f"({os.cpu_count()} cores)")
    print("| # | predicted step s | measured median step s | measured steps |")
    print("|---|---|---|---|")
    med = []
    for i, p in enumerate(plans):
        m = statistics.median(measured[p])
        med.append(m)
        print(f"| {i + 1} | {predicted[i]:.4g} | {m:.4g} | {len(measured[p])} |")
    same = sorted(range(3), key=lambda i: predicted[i]) == sorted(range(3), key=lambda i: med[i])
    print(f"measured order {'matches' if same else 'differs from'} the predicted order")
    return 0


if __name__ == "__main__":
    sys.exit(main())
