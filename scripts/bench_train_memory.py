"""Where a pipeline rank's resident memory goes during training, phase by phase.

Runs a GPT plan (1f1b, SGD without state, as the heavy memory test) with one gloo process
per pipeline rank, built as `pipeplan run` builds them (`PipelineTrainer.for_plan`, glibc's
mmap threshold fixed), and records on each rank, from /proc/self/status: the resident set
(VmRSS) after each phase and the peak during it (VmHWM, reset before the phase by writing 5
to /proc/self/clear_refs), next to what the rank holds in tensors: parameters, `.grad`s,
and the microbatches whose activations are alive. Phases: start-up, then every action of the
step (F / B / W / BW with its microbatch), each stage's gradients done (the data-parallel
all-reduces launched), the gradient sync, the optimizer step.

    PYTHONPATH=.. python scripts/bench_train_memory.py [--layers 8] [--dim 1024] [--seq 64]
        [--pp 4] [--dp 1] [--zero 0] [--microbatches 4] [--steps 2] [--ranks 0,1]

The default (~0.45 GB of fp32 weights over pp=4) is the 2 GB heavy test scaled down
(tests/benchmarks/test_scale_memory.py: layers 40). BENCHMARKS.md holds the numbers.
"""
from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import os
import socket
import sys
import tempfile
import time

MIB = 1 << 20
PLAN = """
model {{
  source = "pipeplan.examples.models.gpt:GPT"
  args = {{ vocab = {vocab}, dim = {dim}, layers = {layers}, heads = 16, seq_len = {seq} }}
  inputs = {{ input_ids = int64[batch, seq] }}
  capture = fx
  loss = cross_entropy
}}
data = synthetic(seed = 0, vocab = {vocab}, seq_len = {seq})
mesh {{ pp = {pp}, dp = {dp} }}
zero = {zero}
pipeline {{ schedule = 1f1b  microbatches = {microbatches} }}
train {{ steps = {steps}  global_batch = {batch}  optimizer = sgd(lr = 0.01)  seed = 0 }}
"""


def status() -> tuple[int, int]:
    """(VmRSS, VmHWM) in bytes."""
    got = {}
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                got[line[:5]] = int(line.split()[1]) * 1024
    return got["VmRSS"], got["VmHWM"]


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                                "usmblks", "fsmblks", "uordblks", "fordblks",
                                                "keepcost")]


def heap() -> tuple[int, int]:
    """glibc's (bytes in use on the heap, free bytes the heap keeps) over all arenas; (0, 0)
    where mallinfo2 is missing."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallinfo2.restype = _Mallinfo2
        m = libc.mallinfo2()
        return m.uordblks, m.fordblks
    except (OSError, AttributeError):
        return 0, 0


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


class Probe:
    """Records (phase, RSS after, peak during, grads held, microbatches alive)."""

    def __init__(self, trainer):
        self.trainer, self.rows = trainer, []

    def held(self) -> tuple[int, int]:
        grads, alive = 0, 0
        for r in self.trainer.runners.values():
            grads += sum(p.grad.numel() * p.grad.element_size()
                         for p in r.params if p.grad is not None)
            alive += len(r.pending_microbatches)
        return grads, alive

    def record(self, phase: str) -> None:
        rss, peak = status()
        grads, alive = self.held()
        self.rows.append((phase, rss, peak, grads, alive) + heap())

    def wrap(self, obj, name: str, label) -> None:
        original = getattr(obj, name)

        def probed(*args, **kwargs):
            reset_peak()
            out = original(*args, **kwargs)
            self.record(label(*args))
            return out
        setattr(obj, name, probed)


def _rank(rank: int, world: int, port: int, plan_path: str, steps: int, out_dir: str,
          mmap_threshold: int = 1 << 20) -> None:
    import pickle

    import torch
    import torch.distributed as dist

    from pipeplan.backends.runtime.memory import return_large_blocks_to_os
    from pipeplan.backends.runtime.trainer import PipelineTrainer
    from pipeplan.dsl.load import load_plan

    return_large_blocks_to_os(mmap_threshold)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    base = status()[0]
    started = time.perf_counter()
    trainer = PipelineTrainer.for_plan(load_plan(plan_path))
    probe = Probe(trainer)
    probe.record("start-up")
    for s, runner in trainer.runners.items():
        probe.wrap(runner, "forward", lambda mb, *_, s=s: f"F s{s} mb{mb}")
        probe.wrap(runner, "backward_input", lambda mb, *_, s=s: f"B s{s} mb{mb}")
        probe.wrap(runner, "backward_weight", lambda mb, *_, s=s: f"W s{s} mb{mb}")
        probe.wrap(runner, "backward_full", lambda mb, *_, s=s: f"BW s{s} mb{mb}")
    probe.wrap(trainer.executor, "on_stage_done", lambda s: f"stage {s} done")  # DP launch
    probe.wrap(trainer.sync, "finish", lambda *_: "grad sync")
    probe.wrap(trainer.optimizer, "step", lambda *_: "optimizer step")
    step_s = []
    for t in range(steps):
        probe.record(f"-- step {t}")
        begin = time.perf_counter()
        trainer.step(t)
        step_s.append(time.perf_counter() - begin)
    with open(os.path.join(out_dir, f"{rank}.pkl"), "wb") as f:
        pickle.dump({"base": base, "startup_s": time.perf_counter() - started,
                     "params": trainer.param_bytes, "rows": probe.rows, "step_s": step_s,
                     "peak": status()[1]}, f)
    dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--zero", type=int, default=0)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--mmap-threshold", type=int, default=1 << 20,
                    help="glibc's mmap threshold on the ranks (bytes; memory.py's default 1 MiB)")
    ap.add_argument("--ranks", default=None, help="print these ranks only (default all)")
    args = ap.parse_args(argv)
    import pickle

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        plan = os.path.join(tmp, "gpt.plan")
        with open(plan, "w") as f:
            f.write(PLAN.format(batch=args.microbatches * args.dp, **vars(args)))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        world = args.pp * args.dp
        mp.start_processes(_rank, args=(world, port, plan, args.steps, tmp, args.mmap_threshold), nprocs=world,
                           start_method="spawn")
        results = [pickle.load(open(os.path.join(tmp, f"{r}.pkl"), "rb")) for r in range(world)]
    show = range(world) if args.ranks is None else [int(r) for r in args.ranks.split(",")]
    for r in show:
        res = results[r]
        print(f"\nrank {r}: parameters {res['params'] / MIB:.1f} MiB, process before the "
              f"trainer {res['base'] / MIB:.0f} MiB, start-up {res['startup_s']:.1f} s, "
              f"peak over the run {res['peak'] / MIB:.0f} MiB (VmHWM since the last phase's "
              f"reset), step times {', '.join(f'{x:.2f}' for x in res['step_s'])} s, peak "
              f"during the step {max(r[2] for r in res['rows']) / MIB:.0f} MiB")
        print(f"{'phase':<16}{'RSS after':>11}{'peak during':>13}{'grads':>9}{'alive mb':>10}"
              f"{'RSS - params - grads':>22}{'heap used':>11}{'heap free':>11}")
        for phase, rss, peak, grads, alive, used, free in res["rows"]:
            rest = (rss - res["params"] - grads) / MIB
            print(f"{phase:<16}{rss / MIB:>11.0f}{peak / MIB:>13.0f}{grads / MIB:>9.0f}"
                  f"{alive:>10}{rest:>22.0f}{used / MIB:>11.0f}{free / MIB:>11.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
