"""Ulysses vs ring attention side by side: the compiler's context-parallel bytes per rank
and step (`pipeplan check`'s cp column) and, with --run, the measured step time of the
same plan under each method on cp gloo CPU processes (pp1, float32).

    PYTHONPATH=... python tests/benchmarks/bench_ring_attention.py [--run] [--seqs 256,1024]

Model: bench_context_parallel's RopeLM (8 heads, 4 KV heads, dim 128, 4 layers), so the
predicted ratio ring/Ulysses bytes is 3 * cp * H_kv / (2 * (H + H_kv)) = cp / 2
(docs/parallelism.md, "Ulysses vs ring").
"""
from __future__ import annotations

import argparse

import torch

from pipeplan.compiler import compile_plan
from pipeplan.dsl import parse_plan

from pipeplan.tests.benchmarks.bench_context_parallel import PLAN, step_time


def plan_for(seq: int, cp: int, method: str):
    return parse_plan(PLAN.format(seq=seq, cp=cp, context=f"context {{ method = {method} }}"),
                      f"{method}.plan")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", action="store_true", help="also measure a step on gloo processes")
    ap.add_argument("--seqs", default="256,512,1024,2048")
    ap.add_argument("--cps", default="2,4")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"{'seq':>5} {'cp':>3} {'activ/rank MiB':>15} {'ulysses MiB':>12} {'ring MiB':>9} "
          f"{'ring/uly':>9}" + (f" {'ulysses s':>10} {'ring s':>8} {'ring/uly':>9}"
                                if args.run else ""))
    for seq in map(int, args.seqs.split(",")):
        for cp in map(int, args.cps.split(",")):
            plans = [plan_for(seq, cp, m) for m in ("ulysses", "ring")]
            est = [compile_plan(p).estimates.ranks[0] for p in plans]
            nbytes = [e.comm_bytes["cp"] for e in est]
            line = (f"{seq:>5} {cp:>3} {est[1].activation_bytes / 2**20:>15.2f} "
                    f"{nbytes[0] / 2**20:>12.2f} {nbytes[1] / 2**20:>9.2f} "
                    f"{nbytes[1] / nbytes[0]:>9.3f}")
            if args.run:
                times = [step_time(p) for p in plans]
                line += f" {times[0]:>10.3f} {times[1]:>8.3f} {times[1] / times[0]:>9.3f}"
            print(line, flush=True)


if __name__ == "__main__":
    main()
