"""Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM"), Table 1: ten GPT runs on A100 80 GB, 1.7B to 1T parameters, rebuilt as plans
and predicted by pipeplan's time model.

    python -m pipeplan.tests.benchmarks.calibration.table1      # or: python table1.py

prints, per row, the published and predicted TFLOP/s per GPU, their ratio, the predicted
step breakdown of the slowest pipeline rank, and the rank correlation (Spearman) across the
rows. The efficiency constants are the stored fit (compiler/estimate/calibration.json,
written by fit.py from these rows only).

Each row: the published shapes (heads, hidden, layers; seq 2048, vocab 51200), TP, PP, GPUs
(dp = GPUs / (TP x PP)), global batch, micro-batch size, interleaving (virtual stages per
rank), full recompute of every layer, 16-bit compute (bf16 here; the paper used fp16, the
same peak on A100), the A100 profile with 8 GPUs per node. The model is the example GPT
with Megatron 2021's unfused attention core and dropout (megatron_gpt.py). Sources: the
paper's Table 1, Megatron-LM's examples/sc21/run_table_1.sh and its April-2021 scaling table.
"""
from __future__ import annotations

import os
import sys
import time

from pipeplan.dsl.ast import (DataSpec, DeviceSpec, MeshSpec, ModelSpec, PipelineSpec, Plan,
                              RecomputeRule, TensorSpec, TrainSpec)

HERE = os.path.dirname(os.path.abspath(__file__))
#        name   heads hidden layers TP PP  GPUs batch  mb virtual published TFLOP/s/GPU
ROWS = (("1.7B",   24,  2304,   24, 1,  1,   32,  512, 16, 1, 137),
        ("3.6B",   32,  3072,   30, 2,  1,   64,  512, 16, 1, 138),
        ("7.5B",   32,  4096,   36, 4,  1,  128,  512, 16, 1, 142),
        ("18B",    48,  6144,   40, 8,  1,  256, 1024,  8, 1, 135),
        ("39B",    64,  8192,   48, 8,  2,  512, 1536,  4, 1, 138),
        ("76B",    80, 10240,   60, 8,  4, 1024, 1792,  2, 3, 140),
        ("145B",   96, 12288,   80, 8,  8, 1536, 2304,  2, 2, 148),
        ("310B",  128, 16384,   96, 8, 16, 1920, 2160,  1, 2, 155),
        ("530B",  128, 20480,  105, 8, 35, 2520, 2520,  1, 3, 163),
        ("1T",    160, 25600,  128, 8, 64, 3072, 3072,  1, 1, 163))
PUBLISHED = {r[0]: r[-1] for r in ROWS}


def plan_of(row) -> Plan:
    name, heads, hidden, layers, tp, pp, gpus, batch, mb, virtual, _ = row
    pre = "layers.*."
    tensor = TensorSpec(column=tuple(pre + m for m in ("attn.q", "attn.k", "attn.v", "mlp.up")),
                        row=(pre + "attn.proj", pre + "mlp.down"),
                        vocab=("tok_emb", "lm_head")) if tp > 1 else TensorSpec()
    return Plan(
        model=ModelSpec(source=os.path.join(HERE, "megatron_gpt.py") + ":GPT",
                        args={"vocab": 51200, "dim": hidden, "layers": layers, "heads": heads,
                              "seq_len": 2048},
                        capture="fx", leaf_modules=(pre + "drop1", pre + "drop2",
                                                    pre + "attn.drop")),
        data=DataSpec(seq_len=2048, vocab=51200),
        mesh=MeshSpec(pp=pp, dp=gpus // (tp * pp), tp=tp),
        pipeline=PipelineSpec(schedule="interleaved" if virtual > 1 else "1f1b",
                              microbatch_size=mb, virtual=virtual),
        tensor=tensor, recompute=(RecomputeRule("layers.*", "full"),),
        train=TrainSpec(global_batch=batch, precision="bf16"),
        device=DeviceSpec(name="a100"), path=os.path.join(HERE, f"table1_{name}.plan"))


def timings():
    """Each row compiled once (meta, no weights): its predict.Timing, and compile seconds."""
    from pipeplan.compiler.driver import compile_plan
    out = []
    for row in ROWS:
        start = time.perf_counter()
        compiled = compile_plan(plan_of(row))
        out.append((row, compiled.estimates.timing, time.perf_counter() - start))
    return out


def spearman(a, b) -> float:
    from scipy.stats import spearmanr
    return float(spearmanr(a, b).statistic)


def main() -> int:
    from pipeplan.compiler.estimate.device import device_model
    rows = timings()
    print(f"{'row':>5} {'published':>9} {'predicted':>9} {'ratio':>6}   slowest rank: "
          "compute / exposed comm / bubble / optimizer (s)   step (s)  MFU   compile")
    pub, pred = [], []
    for row, timing, took in rows:
        p = timing.time_on(device_model(timing.plan))
        slow = max(p.ranks, key=lambda r: r.compute + r.comm)
        pub.append(row[-1])
        pred.append(p.tflops_per_gpu)
        print(f"{row[0]:>5} {row[-1]:>9.0f} {p.tflops_per_gpu:>9.1f} {p.tflops_per_gpu / row[-1]:>6.3f}"
              f"   {slow.compute:8.2f} / {slow.comm:6.2f} / {slow.bubble:6.2f} / "
              f"{slow.optimizer:5.3f}  {p.step_s:8.2f}  {p.mfu:.3f}  {took:5.1f}s")
    worst = max(abs(q / p - 1) for p, q in zip(pub, pred))
    print(f"Spearman {spearman(pub, pred):.3f}; largest deviation {worst:.1%}; "
          f"fit: {device_model(rows[0][1].plan).hardware.efficiency}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
