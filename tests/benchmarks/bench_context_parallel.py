"""Context parallel (Ulysses): activation memory per rank and all-to-all bytes against
sequence length, for cp = 1, 2, 4 — the compiler's numbers (`pipeplan check`), and,
measured on gloo CPU processes, the activation bytes a rank holds and the step time.

    PYTHONPATH=... python tests/benchmarks/bench_context_parallel.py [--run]

Without --run it only compiles (meta device, seconds). With --run it also trains each
(seq, cp) on cp local processes (pp1, float32, one microbatch): a warm-up step, then
STEPS measured steps. Measured activations: the bytes autograd saves for backward during
one step's forward on rank 0, counted by `torch.autograd.graph.saved_tensors_hooks`
around the step (each storage once, parameters' storage excluded); with one microbatch
that is the peak held before the backward starts. The step time is the mean of the
measured steps on rank 0.
"""
from __future__ import annotations

import argparse
import time
import warnings

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


STEPS = 2


class SavedBytes:
    """Bytes of the distinct storages autograd saves for backward while active, leaving
    out the parameters' own storage (weights a Linear saves are not activations)."""

    def __init__(self, params):
        self.params = {p.untyped_storage().data_ptr() for p in params}
        self.seen: dict[int, int] = {}

    def pack(self, t: torch.Tensor):
        storage = t.untyped_storage()
        if storage.data_ptr() not in self.params:
            self.seen[storage.data_ptr()] = storage.nbytes()
        return t

    def total(self) -> int:
        return sum(self.seen.values())


def _train(rank, world, plan, out):
    from pipeplan.backends.runtime.trainer import PipelineTrainer
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch's autograd all_to_all
    trainer = PipelineTrainer.for_plan(plan)
    trainer.step(0)  # warm-up
    saved = SavedBytes(p for r in trainer.runners.values() for p in r.module.parameters())
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
        trainer.step(1)
    start = time.perf_counter()
    for t in range(2, 2 + STEPS):
        trainer.step(t)
    if rank == 0:
        out.put(((time.perf_counter() - start) / STEPS, saved.total()))


def measure(plan) -> tuple[float, int]:
    """(seconds per step, activation bytes saved on rank 0)."""
    import torch.multiprocessing as mp

    from pipeplan.tests.parallel.conftest import run_workers
    q = mp.get_context("fork").SimpleQueue()
    run_workers(_train, plan.mesh.world_size, plan, q, timeout=600)
    return q.get()


def step_time(plan) -> float:
    """Seconds per step (bench_ring_attention.py's measure)."""
    return measure(plan)[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", action="store_true", help="also measure a step on gloo processes")
    ap.add_argument("--seqs", default="256,512,1024,2048")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"{'seq':>5} {'cp':>3} {'estimated act/rank':>19} {'vs cp=1':>8} "
          f"{'all-to-all/rank/step':>21}" + (f" {'MEASURED act/rank':>18} {'vs cp=1':>8} "
                                            f"{'step s':>7}" if args.run else ""))
    for seq in map(int, args.seqs.split(",")):
        base = measured_base = None
        for cp in (1, 2, 4):
            plan = plan_for(seq, cp)
            r = compile_plan(plan).estimates.ranks[0]
            base = base or r.activation_bytes
            line = (f"{seq:>5} {cp:>3} {r.activation_bytes / 2**20:>15.2f} MiB "
                    f"{r.activation_bytes / base:>8.3f} "
                    f"{r.comm_bytes.get('cp', 0) / 2**20:>17.2f} MiB")
            if args.run:
                seconds, saved = measure(plan)
                measured_base = measured_base or saved
                line += (f" {saved / 2**20:>14.2f} MiB {saved / measured_base:>8.3f} "
                         f"{seconds:>7.3f}")
            print(line, flush=True)


if __name__ == "__main__":
    main()
