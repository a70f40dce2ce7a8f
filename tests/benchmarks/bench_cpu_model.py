"""The measured CPU profile against `pipeplan profile`: per stage, the time model's F, B, W
(compiler/estimate/optime.py on the CPU profile of cpu_probe.py) next to what the plan's own
processes measured on this machine.

    python tests/benchmarks/bench_cpu_model.py [PLAN ...]   (default: the example plans)

Each plan is profiled (`pipeplan profile`, 2 warm-up + 4 measured steps, its ranks as local
gloo processes) and compiled without a device section (the measured CPU); prints predicted
and measured seconds per microbatch per stage and their ratio (goal: within 15%). On a
loaded shared machine the measurement moves with the load: report what you get.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PLANS = ("examples/gpt_pp4_1f1b.plan", "examples/hybrid_pp2_dp2_tp2.plan")


def measured(plan: str, out: str) -> dict:
    subprocess.run([sys.executable, "-m", "pipeplan", "profile", plan, "-o", out,
                    "--steps", "4", "--warmup", "2"], check=True, cwd=REPO,
                   stdout=subprocess.DEVNULL)
    with open(out, encoding="utf-8") as f:
        return json.load(f)


def main(argv: list[str]) -> int:
    from pipeplan.compiler import compile_plan
    from pipeplan.dsl import load_plan
    worst = 0.0
    for plan_path in argv or PLANS:
        with tempfile.TemporaryDirectory() as tmp:
            costs = measured(plan_path, os.path.join(tmp, "costs.json"))
        compiled = compile_plan(load_plan(os.path.join(REPO, plan_path)))
        table = compiled.estimates.simulation.costs.per_stage
        print(f"{plan_path}  ({costs.get('device')})")
        print("stage  op   predicted (ms)  measured (ms)  predicted/measured")
        for st, (f, b, w) in zip(costs["stages"], table):
            pairs = [("F", f, st["F"])]
            pairs += [("BW", b + w, st["BW"])] if st.get("BW") is not None else \
                [("B", b, st["B"]), ("W", w, st["W"])]
            for op, p, m in pairs:
                worst = max(worst, abs(p / m - 1))
                print(f"{st['index']:>5}  {op:<3} {p * 1e3:>15.3f} {m * 1e3:>14.3f} {p / m:>19.3f}")
    print(f"largest deviation {worst:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
