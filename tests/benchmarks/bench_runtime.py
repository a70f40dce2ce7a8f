"""Runtime benchmarks, measured side by side in one process (no timed assertions).

    python tests/benchmarks/bench_runtime.py            # split backward costs
    python tests/benchmarks/bench_runtime.py --pipeline # + measured step time per schedule (spawns ranks)

1. Split backward on a 4-block GPT stage (d=256, batch 8x128): B, then W the
   simple way (walk the whole graph again) vs W reusing B's work
   (backends/runtime/split_backward.py), next to one full backward BW.
2. --pipeline: `pipeplan run` of a small GPT on pp=2 for several schedule
   kinds: mean step time after warm-up, measured and predicted bubble.
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from pipeplan.backends.runtime.split_backward import backward_input, backward_weight, plan_split
from pipeplan.examples.models.gpt import Block

REPEATS = 5


def _best(fn) -> float:
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def bench_split_backward() -> None:
    torch.manual_seed(0)
    blocks = torch.nn.Sequential(*[Block(256, 4, 1024) for _ in range(4)])
    params = list(blocks.parameters())
    x0 = torch.randn(8, 128, 256)

    def graph():
        x = x0.clone().requires_grad_(True)
        y = blocks(x)
        return x, y, torch.ones_like(y)

    def bw():
        x, y, g = graph()
        torch.autograd.grad([y], [x] + params, [g])

    def simple():
        x, y, g = graph()
        t0 = time.perf_counter()
        torch.autograd.grad([y], [x], [g], retain_graph=True)
        t1 = time.perf_counter()
        torch.autograd.grad([y], params, [g])
        return t1 - t0, time.perf_counter() - t1

    def split():
        x, y, g = graph()
        t0 = time.perf_counter()
        plan = plan_split([y], [x], params)
        backward_input(plan, [y], [g], [x])
        t1 = time.perf_counter()
        backward_weight(plan, [y], [g])
        return t1 - t0, time.perf_counter() - t1

    t_bw = _best(bw) - _best(lambda: graph())
    s = min((simple() for _ in range(REPEATS)), key=sum)
    r = min((split() for _ in range(REPEATS)), key=sum)
    print("split backward, 4 GPT blocks d=256, batch 8x128 (best of 5, seconds)")
    print(f"  BW (one full backward)        {t_bw:.4f}")
    print(f"  B + W, W walks the graph      {s[0]:.4f} + {s[1]:.4f} = {sum(s):.4f}  ({sum(s) / t_bw:.2f}x BW)")
    print(f"  B + W, W reuses B (pipeplan)  {r[0]:.4f} + {r[1]:.4f} = {sum(r):.4f}  ({sum(r) / t_bw:.2f}x BW)")
    print(f"  W alone: {s[1] / r[1]:.2f}x faster when reusing B's work")


PLAN = """
model {{
  source = "{repo}/examples/models/gpt.py:GPT"
  args = {{ vocab = 256, dim = 128, layers = 4, heads = 4, seq_len = 64 }}
  capture = fx
}}
data = synthetic(seed = 0, vocab = 256, seq_len = 64)
mesh {{
  pp = 2
}}
pipeline {{
  schedule = 1f1b
  microbatches = 8
}}
train {{
  steps = 6
  global_batch = 16
}}
"""


def bench_pipeline() -> None:
    repo = Path(__file__).resolve().parents[2]
    with tempfile.TemporaryDirectory() as tmp:
        plan = Path(tmp) / "bench.plan"
        plan.write_text(PLAN.format(repo=repo))
        print("\npp=2, 8 microbatches, GPT d=128 x 4 layers: mean step time of steps 2-6")
        for kind, virtual in (("gpipe", 1), ("1f1b", 1), ("zbh1", 1), ("zbv", 2), ("auto", 1)):
            metrics = Path(tmp) / f"{kind}.jsonl"
            r = subprocess.run([sys.executable, "-m", "pipeplan", "run", plan, "--metrics", metrics,
                                "--set", f"pipeline.schedule={kind}",
                                "--set", f"pipeline.virtual={virtual}"],
                               capture_output=True, text=True, timeout=600)
            if r.returncode:
                print(f"  {kind:6} failed: {r.stderr.strip().splitlines()[-1:]}")
                continue
            rows = [json.loads(line) for line in metrics.read_text().splitlines()][1:]
            mean = sum(row["step_time_s"] for row in rows) / len(rows)
            bubble = [line for line in r.stdout.splitlines() if line.startswith("bubble")]
            print(f"  {kind:6} {mean * 1e3:7.1f} ms/step   {bubble[0].split(': ', 1)[1] if bubble else ''}")


if __name__ == "__main__":
    torch.set_num_threads(1)
    bench_split_backward()
    if "--pipeline" in sys.argv:
        bench_pipeline()
