"""A held-out check of the time model: Korthikanti et al. 2022 ("Reducing Activation
Recomputation in Large Transformer Models"), Tables 3 and 5, four GPT runs on A100 80 GB
(22B to 1T, TP 8, no data parallelism), each measured twice: full recompute of every layer
without sequence parallelism, and sequence parallelism with selective recompute.

    python -m pipeplan.tests.benchmarks.calibration.korthikanti    # or: python korthikanti.py

prints, per row and setting, the published and predicted iteration time, their ratio and
the MFU, then the predicted and published speed-up of the second setting over the first.
Nothing here is fitted: the efficiency constants are the stored fit on Narayanan et al.
2021 Table 1 (table1.py, fit.py); these eight times are never shown to the fit.

Rows (Table 3): heads, hidden, layers, PP, GPUs (TP 8, dp 1), global batch, micro-batch
size; sequence 2048, vocabulary 51200; interleaving with 3 stages per rank for 175B and
530B (the paper's section 6); mixed precision (bf16 here: the same A100 peak). Published
iteration times (Table 5, seconds): full recompute / present work.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import time

from pipeplan.dsl.ast import RecomputeRule

if __package__:
    from .table1 import plan_of, spearman
else:  # run as a script: its folder on the path (as fit.py)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from table1 import plan_of, spearman  # noqa: E402

#        name   heads hidden layers PP GPUs batch mb virtual  full (s) present (s)
ROWS = (("22B",   64,  6144,   48,  1,   8,    4, 4, 1,   1.42,  1.10),
        ("175B",  96, 12288,   96,  8,  64,   64, 1, 3,  18.13, 13.75),
        ("530B", 128, 20480,  105, 35, 280,  280, 1, 3,  49.05, 37.83),
        ("1T",   160, 25600,  128, 64, 512,  512, 1, 1,  94.42, 71.49))
MFU = {"22B": 0.415, "175B": 0.514, "530B": 0.560, "1T": 0.563}  # Table 5, present work
SETTINGS = ("full recompute", "sp + selective")


def plan_for(row, setting: str):
    name, heads, hidden, layers, pp, gpus, batch, mb, virtual = row[:9]
    base = plan_of((name, heads, hidden, layers, 8, pp, gpus, batch, mb, virtual, 0))
    if setting == "full recompute":
        return base
    return dataclasses.replace(
        base, tensor=dataclasses.replace(base.tensor, sequence_parallel=True),
        recompute=(RecomputeRule("layers.*", "selective"),))


def main() -> int:
    from pipeplan.compiler.driver import compile_plan
    from pipeplan.compiler.estimate.device import device_model
    print(f"{'row':>5} {'setting':>15} {'published':>9} {'predicted':>9} {'ratio':>6} "
          f"{'MFU':>6} {'compile':>8}")
    worst, pub, pred, speedups, mfu = 0.0, [], [], [], []
    for row in ROWS:
        times = []
        for setting, published in zip(SETTINGS, row[9:]):
            start = time.perf_counter()
            compiled = compile_plan(plan_for(row, setting))
            took = time.perf_counter() - start
            p = compiled.estimates.timing.time_on(device_model(compiled.plan))
            times.append(p.step_s)
            worst = max(worst, abs(p.step_s / published - 1))
            pub.append(published)
            pred.append(p.step_s)
            print(f"{row[0]:>5} {setting:>15} {published:>9.2f} {p.step_s:>9.2f} "
                  f"{p.step_s / published:>6.3f} {p.mfu:>6.3f} {took:>7.1f}s")
        speedups.append((row[0], times[0] / times[1], row[9] / row[10]))
        mfu.append((row[0], p.mfu, MFU[row[0]]))
    for name, predicted, published in speedups:
        print(f"{name:>5} speed-up of sp + selective over full recompute: predicted "
              f"{predicted:.3f}, published {published:.3f}")
    for name, predicted, published in mfu:
        print(f"{name:>5} MFU with sp + selective: predicted {predicted:.3f}, published "
              f"{published:.3f}")
    print(f"Spearman of the eight times {spearman(pub, pred):.3f}; of the four MFUs "
          f"{spearman([m[2] for m in mfu], [m[1] for m in mfu]):.3f}; largest deviation "
          f"{worst:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
