"""`experts.balance = step` vs `microbatch`: what the routing pre-pass costs per step.

    PYTHONPATH=... python tests/benchmarks/bench_balance.py [--steps 6]

The example MoE plan (examples/moe_pp2_ep2_zbv.plan: pp2 x dp2 x ep2, zbv, 4
microbatches, float32) on 4 gloo CPU processes. Both trainers live in the same
processes and alternate step by step (on a loaded machine only same-process
alternation gives usable ratios: the project's FIELD-NOTES.md). Prints the
median step time of each, their ratio, and the compiler's predicted ratio
(`Estimates.step_time_s`, which holds `prepass_s`).
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from pathlib import Path

import torch

from pipeplan.compiler import compile_plan
from pipeplan.dsl import load_plan

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "moe_pp2_ep2_zbv.plan"


def plans():
    plan = load_plan(str(EXAMPLE))
    step = dataclasses.replace(plan, experts=dataclasses.replace(plan.experts, balance="step"))
    return plan, step


def _train(rank, world, steps, out):
    from pipeplan.backends.runtime.trainer import PipelineTrainer
    micro_plan, step_plan = plans()
    trainers = {"microbatch": PipelineTrainer.for_plan(micro_plan),
                "step": PipelineTrainer.for_plan(step_plan)}
    times = {k: [] for k in trainers}
    for t in range(steps + 1):
        for name, trainer in trainers.items():
            start = time.perf_counter()
            trainer.step(t)
            if t:  # step 0 warms up
                times[name].append(time.perf_counter() - start)
    if rank == 0:
        out.put(times)


def main() -> None:
    import torch.multiprocessing as mp

    from pipeplan.tests.parallel.conftest import run_workers
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    torch.set_num_threads(1)
    micro_plan, step_plan = plans()
    predicted = {k: compile_plan(p).estimates for k, p in
                 (("microbatch", micro_plan), ("step", step_plan))}
    q = mp.get_context("fork").SimpleQueue()
    run_workers(_train, micro_plan.mesh.world_size, args.steps, q, timeout=1200)
    times = q.get()
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{'balance':>10} {'median step s':>14} {'predicted s':>12}")
    for k in ("microbatch", "step"):
        print(f"{k:>10} {med[k]:>14.4f} {predicted[k].step_time_s:>12.5f}")
    print(f"measured step/microbatch {med['step'] / med['microbatch']:.3f}, predicted "
          f"{predicted['step'].step_time_s / predicted['microbatch'].step_time_s:.3f} "
          f"(pre-pass {predicted['step'].prepass_s:.5f} s)")


if __name__ == "__main__":
    main()
