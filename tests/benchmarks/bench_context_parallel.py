"""Context parallel (Ulysses): activation memory per rank and all-to-all bytes against
sequence length, for cp = 1, 2, 4 — the compiler's numbers (`pipeplan check`), and one
measured step time per configuration on gloo CPU processes.

    PYTHONPATH=... python tests/benchmarks/bench_context_parallel.py [--run]

Without --run it only compiles (meta device, seconds). With --run it also trains 2 steps
of each (seq, cp) on cp local processes (pp1, float32) and prints the mean step time.
"""
from __future__ import annotations

import argparse
import time

import torch

from pipeplan.compiler import compile_plan
from pipeplan.dsl import parse_plan

PLAN = """\
model {{
  source = "pipeplan.tests.parallel.cp_models:RopeLM"
  args = {{ vocab = 256, dim = 128, heads = 8, kv_heads = 4, layers = 4 }}
  inputs {{ input_ids = int64[batch, seq], position_ids = int64[batch, seq] }}
}}
data = synthetic(seed = 0, vocab = 256, seq_len = {seq}, inputs = {{ position_ids = positions }})
mesh {{ cp = {cp} }}
{context}
pipeline {{ microbatches = 1 }}
train {{ global_batch = 2, steps = 2 }}
"""


def plan_for(seq: int, cp: int):
    context = "context { method = ulysses }" if cp > 1 else ""
    return parse_plan(PLAN.format(seq=seq, cp=cp, context=context), "bench.plan")


def _train(rank, world, plan, out):
    from pipeplan.backends.trainer import PipelineTrainer
    trainer = PipelineTrainer.for_plan(plan)
    trainer.step(0)  # warm-up
    start = time.perf_counter()
    trainer.step(1)
    if rank == 0:
        out.put(time.perf_counter() - start)


def step_time(plan) -> float:
    import torch.multiprocessing as mp

    from pipeplan.tests.parallel.conftest import run_workers
    q = mp.get_context("fork").SimpleQueue()
    run_workers(_train, plan.mesh.world_size, plan, q, timeout=600)
    return q.get()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", action="store_true", help="also measure a step on gloo processes")
    ap.add_argument("--seqs", default="256,512,1024,2048")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"{'seq':>5} {'cp':>3} {'activations/rank':>17} {'vs cp=1':>8} "
          f"{'all-to-all/rank/step':>21}" + (f" {'step s':>8}" if args.run else ""))
    for seq in map(int, args.seqs.split(",")):
        base = None
        for cp in (1, 2, 4):
            plan = plan_for(seq, cp)
            r = compile_plan(plan).estimates.ranks[0]
            base = base or r.activation_bytes
            line = (f"{seq:>5} {cp:>3} {r.activation_bytes / 2**20:>13.2f} MiB "
                    f"{r.activation_bytes / base:>8.3f} "
                    f"{r.comm_bytes.get('cp', 0) / 2**20:>17.2f} MiB")
            if args.run:
                line += f" {step_time(plan):>8.3f}"
            print(line, flush=True)


if __name__ == "__main__":
    main()
