"""Start-up time and peak RSS of one pipeline rank: owned-only materialisation vs building the
whole model first (the path before issue 11), for GPTs of about 0.25, 1 and 2 GB of fp32
weights over pp=4. Each measurement runs in a fresh process (peak RSS is per process).

    PYTHONPATH=.. python scripts/bench_startup.py [--sizes 0.25,1,2] [--rank 1]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

LAYERS = {0.25: 5, 1.0: 20, 2.0: 40}  # GPT dim 1024: 12.6M parameters (50 MB) per block


def plan_for(gb: float):
    from pipeplan.dsl.ast import DataSpec, MeshSpec, ModelSpec, PipelineSpec, Plan, TrainSpec
    args = {"vocab": 8192, "dim": 1024, "layers": LAYERS[gb], "heads": 16, "seq_len": 64}
    return Plan(model=ModelSpec("pipeplan.examples.models.gpt:GPT", args=args, capture="fx"),
                data=DataSpec(seq_len=64, vocab=8192, seed=0), mesh=MeshSpec(pp=4),
                pipeline=PipelineSpec(schedule="1f1b", microbatches=4),
                train=TrainSpec(steps=1, global_batch=4, seed=0))


def measure(gb: float, mode: str, rank: int) -> dict:
    import time

    import torch

    from pipeplan.backends.runtime.memory import peak_rss_bytes
    from pipeplan.backends.state.model import build_model, own_stages
    from pipeplan.compiler.driver import compile_plan
    torch.set_num_threads(1)
    plan = plan_for(gb)
    start = time.perf_counter()
    if mode == "owned":
        compiled = compile_plan(plan)
        own_stages(plan, compiled, rank)
    else:  # before: the whole model under the seed, compiled with it, other stages dropped
        compiled = compile_plan(plan, build_model(plan))
    held = sum(p.numel() * 4 for s in compiled.stages_of_rank(rank)
               for p in s.module.parameters())
    total = sum(p.numel() * 4 for p in {id(p): p for s in compiled.stages
                                        for p in s.module.parameters()}.values())
    return {"seconds": time.perf_counter() - start, "peak": peak_rss_bytes(),
            "held": held, "total": total}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="0.25,1,2")
    ap.add_argument("--rank", type=int, default=1)
    ap.add_argument("--one", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(measure(float(a.one[0]), a.one[1], a.rank)))
        return
    print("| model fp32 | rank holds | owned: start-up / peak RSS | build-all: start-up / "
          "peak RSS | RSS ratio |")
    print("|---|---|---|---|---|")
    for gb in (float(x) for x in a.sizes.split(",")):
        r = {m: json.loads(subprocess.run(
            [sys.executable, __file__, "--one", str(gb), m, "--rank", str(a.rank)],
            check=True, capture_output=True, text=True).stdout.splitlines()[-1])
            for m in ("owned", "build-all")}
        o, b = r["owned"], r["build-all"]
        g = 1 << 30
        print(f"| {o['total'] / g:.2f} GiB | {o['held'] / g:.2f} GiB | {o['seconds']:.1f} s / "
              f"{o['peak'] / g:.2f} GiB | {b['seconds']:.1f} s / {b['peak'] / g:.2f} GiB | "
              f"{b['peak'] / o['peak']:.1f}x |", flush=True)


if __name__ == "__main__":
    main()
