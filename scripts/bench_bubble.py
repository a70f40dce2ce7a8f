"""Measured vs predicted bubble on 2 ranks: profile, then run with the profile (issue 13).

For each schedule: `pipeplan profile` (warm-up + measured steps, the plan's own
processes) writes costs.json; the same plan naming `profile = "costs.json"` is
run, and its end-of-run line compares the measured whole-iteration bubble
(median over the steady-state steps) with the bubble the compiler predicted by
simulating the schedule under the profiled costs. Both count an action's slot
(compute plus the runtime's work around it) as busy (docs/runtime.md). Prints one
row per schedule and repetition (`--repeat`: profile and run again, to see the
spread a shared machine adds) and the machine's load before and after each.

    PYTHONPATH=.. python scripts/bench_bubble.py [--schedules 1f1b,zbv] [--steps 16] [--repeat 3]
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PLAN = """model {{
  source = "{gpt}:GPT"
  args = {{ vocab = 256, dim = {dim}, layers = 8, heads = 4, seq_len = 64 }}
  inputs = {{ input_ids = int64[batch, seq] }}
  loss = cross_entropy
}}
data = synthetic(seed = 0, vocab = 256, seq_len = 64)
mesh {{ pp = 2 }}
pipeline {{
  schedule = {schedule}
  microbatches = 8
  split = ["layers.{cut}"]{profile}
}}
train {{
  steps = {steps}
  global_batch = 16
  optimizer = adamw(lr = 0.01)
}}
"""
LINE = re.compile(r"measured (\d\.\d+) \(([^)]*)\), predicted (\d\.\d+)")


def _run(*args: str) -> str:
    r = subprocess.run([sys.executable, "-m", "pipeplan", *args], capture_output=True,
                       text=True, timeout=1800, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if r.returncode != 0:
        sys.exit(r.stdout + r.stderr)
    return r.stdout


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--schedules", default="1f1b,zbv")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=1, help="profile and run each schedule N times")
    args = ap.parse_args()
    print(f"load average before: {_load()}, {os.cpu_count()} cpus")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for rep, kind in ((r, k) for r in range(args.repeat) for k in args.schedules.split(",")):
            load = _load()
            # zbv puts 4 stages on 2 ranks: split the 8 layers in 4; 1f1b in 2
            stages = 4 if kind in ("zbv", "interleaved", "vhalf", "vmin", "dualpipev") else 2
            cut = ", ".join(f'"layers.{i}"' for i in range(8 // stages, 8, 8 // stages))
            fill = dict(gpt=REPO / "examples/models/gpt.py", dim=args.dim, schedule=kind,
                        steps=args.steps)
            plain = Path(tmp, f"{kind}.plan")
            plain.write_text(PLAN.format(**fill, cut="", profile="").replace(
                '["layers."]', f"[{cut}]"))
            costs = Path(tmp, f"{kind}.json")
            _run("profile", str(plain), "-o", str(costs), "--steps", str(args.steps),
                 "--warmup", "2")
            profiled = Path(tmp, f"{kind}_profiled.plan")
            profiled.write_text(plain.read_text().replace(
                "]\n}", f']\n  profile = "{costs}"\n}}', 1))
            out = _run("run", str(profiled))
            m = LINE.search(out)
            rows.append((kind, rep + 1, float(m.group(1)), float(m.group(3)), m.group(2),
                         f"{load} -> {_load()}"))
            print(out.splitlines()[-1], flush=True)
    print(f"load average after: {_load()}")
    print("| schedule | run | measured bubble | predicted (profiled costs) | difference (points) "
          "| steps | load 1/5/15 min (before -> after) |")
    print("|---|---|---|---|---|---|---|")
    for kind, rep, meas, pred, steps, load in rows:
        print(f"| {kind} | {rep} | {meas:.3f} | {pred:.3f} | {100 * (meas - pred):+.1f} | {steps} "
              f"| {load} |")


def _load() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


if __name__ == "__main__":
    main()
