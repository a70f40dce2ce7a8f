"""The time model against a second published A100 run that no fit saw: Megatron-Turing NLG
530B ("Using DeepSpeed and Megatron to Train Megatron-Turing NLG 530B", Smith et al. 2022,
section 2.4): the same model as Table 1's 530B row (105 layers, hidden 20,480, 128 heads,
sequence 2,048), tp 8 x pp 35, a global batch of 1,920 on 280 / 350 / 420 DGX A100 nodes:

    nodes   GPUs   dp   iteration   TFLOP/s a GPU
      280   2240    8     60.1 s    126
      350   2800   10     50.2 s    121
      420   3360   12     44.4 s    113

    python -m pipeplan.tests.benchmarks.calibration.mtnlg [--microbatch 1,2,4]

The published TFLOP/s count a full recompute (Narayanan et al.'s formula: 1920 x 2048
tokens at 126 TFLOP/s on 2240 GPUs is 60.0 s, the published iteration), so they compare
with `Prediction.tflops_per_gpu` as Table 1 does. The model and its kernels are table1.py's
(megatron_gpt.py); the schedule is DeepSpeed's pipeline, 1F1B without interleaving; every
layer recomputed. Not published, so shown as a range: the micro-batch size. What the
comparison leaves out: DeepSpeed's pipeline engine (blocking point-to-point transfers;
its gradient reduction after the flush) is not pipeplan's runtime, whose timeline the
model predicts.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

from pipeplan.dsl.ast import MeshSpec, PipelineSpec, TrainSpec

from . import table1

ROWS = ((280, 126), (350, 121), (420, 113))  # (DGX A100 nodes, published TFLOP/s per GPU)
BATCH, TP, PP = 1920, 8, 35


def plan_of(nodes: int, microbatch: int):
    row = next(r for r in table1.ROWS if r[0] == "530B")
    plan = table1.plan_of(row)
    return dataclasses.replace(
        plan, mesh=MeshSpec(pp=PP, dp=nodes * 8 // (TP * PP), tp=TP),
        pipeline=PipelineSpec(schedule="1f1b", microbatch_size=microbatch),
        train=TrainSpec(global_batch=BATCH, precision="bf16"))


def main(argv=None) -> int:
    from pipeplan.compiler.driver import compile_plan
    from pipeplan.compiler.estimate.device import device_model
    ap = argparse.ArgumentParser()
    ap.add_argument("--microbatch", default="1,2,4")
    args = ap.parse_args(argv)
    print(f"{'nodes':>5} {'mb':>3} {'published':>9} {'predicted':>9} {'ratio':>6} "
          f"{'step (s)':>8} {'bubble (s)':>10} {'peak GiB':>8}")
    for mb in (int(m) for m in args.microbatch.split(",")):
        first = None
        for nodes, pub in ROWS:
            compiled = compile_plan(plan_of(nodes, mb))
            p = compiled.estimates.timing.time_on(device_model(compiled.plan))
            slow = max(p.ranks, key=lambda r: r.compute + r.comm)
            first = first or (p.tflops_per_gpu, pub)
            print(f"{nodes:>5} {mb:>3} {pub:>9} {p.tflops_per_gpu:>9.1f} "
                  f"{p.tflops_per_gpu / pub:>6.3f} {p.step_s:>8.2f} {slow.bubble:>10.2f} "
                  f"{compiled.estimates.peak_bytes / 2**30:>8.1f}", flush=True)
        print(f"      {mb:>3} 420 over 280 nodes: published {ROWS[-1][1] / ROWS[0][1]:.3f}, "
              f"predicted {p.tflops_per_gpu / first[0]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
