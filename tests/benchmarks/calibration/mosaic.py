"""The time model on other GPUs and another parallelism: MosaicML's
published MPT training throughput (llm-foundry, scripts/train/benchmarking/README.md, the
"H100 80GB BF16" and "A100 80GB with 1600 Gbps node-node interconnect (RoCE)" tables):
fully sharded data parallelism (FSDP FULL_SHARD, i.e. ZeRO-3) on 8 to 64 GPUs, 125M to 70B
parameters, sequences of 512 to 65,536 tokens, with and without activation checkpointing.

    python -m pipeplan.tests.benchmarks.calibration.mosaic [--gpu h100|a100] [--rows N]
    python mosaic.py                                   (as a script, from its folder)

prints, per row, the published and predicted tokens per second per GPU, their ratio, the
predicted MFU and peak memory per rank; then the Spearman rank correlation, the median ratio
and the largest deviation, apart for the rows a fit saw and the rows held out. The H100
family's constants are fitted (fit.py --family h100) on the H100 table's rows at 2,048
tokens (CALIBRATION) only; its other rows are held out. The A100 table is held out from
every fit (the A100 constants are fitted on Narayanan et al. 2021 Table 1 only).

The model: MPT as these benchmarks ran it is the example GPT (examples/models/gpt.py):
learned position embeddings, pre-norm blocks with biases and LayerNorm biases, a 4x GELU
MLP, fused causal attention (FlashAttention there, scaled_dot_product_attention here), tied
embeddings, vocabulary 50,368 (parameters equal the table's NumParams column, e.g.
1,315,950,592 for "1b" at 2,048 tokens). The sizes are llm-foundry's
scripts/train/yamls/pretrain/mpt-*.yaml (d_model, n_heads, n_layers). Each row: pp 1, dp =
GPUs, ZeRO-3, the published micro-batch size and global batch (the gradient accumulation is
their quotient over dp), full recompute of every block where "Activation Checkpointing" is
True, bf16, AdamW, 8 GPUs a node.

What the comparison leaves out (a reader weighs the ratios with it): the H100 rows were
measured with 2023 software (Composer's amp_bf16: fp32 master weights, FSDP's DEFAULT mixed
precision reducing gradients in fp32, Triton FlashAttention on H100 before FlashAttention-2's
Hopper kernels); the network of the H100 cluster is not stated (DGX H100's 8 x 400 Gb/s is
assumed, the profile's); the A100 rows' network is the stated 1600 Gb/s a node (the A100
profile's 25 GB/s a GPU).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from pipeplan.dsl.ast import (DataSpec, DeviceSpec, MeshSpec, ModelSpec, PipelineSpec, Plan,
                              RecomputeRule, TrainSpec)

if __package__:
    from .table1 import spearman
else:  # run as a script: its folder on the path (as fit.py)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from table1 import spearman  # noqa: E402

GPT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))), "examples", "models", "gpt.py") + ":GPT"
VOCAB = 50368
# llm-foundry scripts/train/yamls/pretrain/mpt-<size>.yaml: d_model, n_heads, n_layers
SIZES = {"125m": (768, 12, 12), "350m": (1024, 16, 24), "760m": (1536, 12, 24),
         "1b": (2048, 16, 24), "3b": (2560, 20, 32), "7b": (4096, 32, 32),
         "13b": (5120, 40, 40), "30b": (7168, 56, 48), "70b": (8192, 64, 80)}

# The tables' columns used: Model, SeqLen, # GPUs, MicroBatchSize, GlobalBatchSize,
# Throughput (T/s/GPU), Activation Checkpointing; every row of each table, in its order.
#           model   seq    gpus mbs  gbs  tokens/s/GPU  checkpointing
H100 = (("70b",  2048, 64,  8, 2048,  1039, True),
        ("70b",  2048, 32,  2, 1024,   882, True),
        ("30b",  8192,  8,  1,  168,  1384, True),
        ("30b",  4096,  8,  1,  168,  1802, True),
        ("30b",  2048, 32, 14, 1344,  2308, True),
        ("30b",  2048, 16, 10,  480,  2263, True),
        ("30b",  2048,  8,  3,  504,  2002, True),
        ("30b",  1024,  8,  6, 1008,  2084, True),
        ("13b", 32768,  8,  1,   24,  1976, True),
        ("13b", 16384,  8,  3,   72,  2985, True),
        ("13b",  4096,  8, 10,  240,  4717, True),
        ("13b",  2048, 64,  2,  128,  4800, False),
        ("13b",  2048, 32,  2,   64,  4811, False),
        ("13b",  2048, 16,  2,   32,  4767, False),
        ("13b",  2048,  8,  2,   16,  4792, False),
        ("13b",  1024,  8, 40,  960,  5502, True),
        ("7b",  65536,  8,  1,   16,  1956, True),
        ("7b",  32768,  8,  2,   32,  3318, True),
        ("7b",   8192,  8,  8,  128,  6935, True),
        ("7b",   4096,  8, 16,  256,  8611, True),
        ("7b",   2048,  8,  6,   48, 10643, False),
        ("7b",   1024,  8, 64, 1024, 10203, True),
        ("3b",  65536,  8,  1,   16,  3262, True),
        ("3b",  32768,  8,  3,  144,  5873, True),
        ("3b",  16384,  8,  1,   48, 11152, False),
        ("3b",   8192,  8,  3,  144, 16578, False),
        ("3b",   4096,  8,  5,  240, 20964, False),
        ("3b",   2048, 64,  6, 1152, 22525, False),
        ("3b",   2048, 32,  6,  576, 23021, False),
        ("3b",   2048, 16, 10,  480, 24142, False),
        ("3b",   1024,  8, 20,  960, 27046, False),
        ("3b",    512,  8, 40, 1920, 27965, False),
        ("1b",  65536,  8,  1,   16,  5506, True),
        ("1b",  32768,  8,  1,   32, 12025, False),
        ("1b",  16384,  8,  2,   64, 19649, False),
        ("1b",   8192,  8,  3,   96, 29157, False),
        ("1b",   4096,  8,  7,  224, 38535, False),
        ("1b",   2048, 64, 20, 1280, 44402, False),
        ("1b",   2048, 32, 20,  640, 45130, False),
        ("1b",   2048, 16, 20,  320, 46037, False),
        ("1b",   2048,  8, 14,  112, 45455, False),
        ("1b",   1024,  8, 18,  576, 48910, False),
        ("1b",    512,  8, 56, 1792, 52275, False),
        ("760m", 32768, 8,  1,   16, 16291, False),
        ("760m", 16384, 8,  3,   48, 27815, False),
        ("760m",  8192, 8,  6,   96, 41825, False),
        ("760m",  4096, 8, 12,  192, 55459, False),
        ("760m",  2048, 32, 24, 768, 67971, False),
        ("760m",  2048, 16, 24, 384, 68551, False),
        ("760m",  2048, 8, 24,  384, 63147, False),
        ("760m",  1024, 8, 48,  768, 78581, False),
        ("760m",   512, 8, 96, 1536, 83749, False))
A100 = (("70b",  2048, 64,   8, 2048,    410, True),
        ("70b",  2048, 32,   2, 1024,    373, True),
        ("30b",  8192,  8,   1,  168,    574, True),
        ("30b",  4096,  8,   1,  168,    814, True),
        ("30b",  2048,  8,   3,  504,    916, True),
        ("30b",  1024,  8,   6, 1008,    946, True),
        ("30b",   512,  8,  12, 2016,    967, True),
        ("13b", 32768,  8,   1,   24,   1016, True),
        ("13b", 16384,  8,   3,   72,   1431, True),
        ("13b",  8192,  8,   5,  120,   1795, True),
        ("13b",  4096,  8,  10,  240,   2060, True),
        ("13b",  2048,  8,   2,   48,   2262, False),
        ("13b",  1024,  8,  40,  960,   2330, True),
        ("7b",  65536,  8,   1,   16,   1013, True),
        ("7b",  32768,  8,   2,   32,   1672, True),
        ("7b",  16384,  8,   4,   64,   2453, True),
        ("7b",   8192,  8,   8,  128,   3206, True),
        ("7b",   4096,  8,  16,  256,   3684, True),
        ("7b",   2048,  8,   6,   96,   4641, False),
        ("7b",   1024,  8,  64, 1024,   4357, True),
        ("3b",  65536,  8,   1,   16,   1767, True),
        ("3b",  32768,  8,   3,  144,   3029, True),
        ("3b",  16384,  8,   1,   48,   5529, False),
        ("3b",   8192,  8,   3,  144,   7695, False),
        ("3b",   4096,  8,   5,  240,   9457, False),
        ("3b",   2048,  8,  10,  160,  10811, False),
        ("3b",   1024,  8,  20,  960,  11580, False),
        ("3b",    512,  8,  40, 1920,  12127, False),
        ("1b",  65536,  8,   1,   16,   3044, True),
        ("1b",  32768,  8,   1,   32,   6275, False),
        ("1b",  16384,  8,   2,   64,   9956, False),
        ("1b",   8192,  8,   3,   96,  13814, False),
        ("1b",   4096,  8,   7,  224,  17807, False),
        ("1b",   2048,  8,  14,  448,  20513, False),
        ("1b",   1024,  8,  18,  576,  22112, False),
        ("1b",    512,  8,  56, 1792,  23148, False),
        ("760m", 65536, 8,   1,   16,   4143, True),
        ("760m", 32768, 8,   1,   16,   8802, False),
        ("760m", 16384, 8,   3,   48,  14274, False),
        ("760m",  8192, 8,   6,   96,  20933, False),
        ("760m",  4096, 8,  12,  192,  27351, False),
        ("760m",  2048, 8,  24,  384,  32434, False),
        ("760m",  1024, 8,  48,  768,  29765, False),
        ("760m",   512, 8,  96, 1536,  29446, False),
        ("350m", 65536, 8,   1,   16,   7524, False),
        ("350m", 32768, 8,   2,   32,  13652, False),
        ("350m", 16384, 8,   4,   64,  23559, False),
        ("350m",  8192, 8,   8,  128,  36569, False),
        ("350m",  4096, 8,  16,  256,  49555, False),
        ("350m",  2048, 8,  32,  512,  58782, False),
        ("350m",  1024, 8,  64, 1024,  64813, False),
        ("350m",   512, 8, 128, 2048,  69330, False),
        ("125m", 65536, 8,   1,   16,  20368, False),
        ("125m", 32768, 8,   2,   32,  36407, False),
        ("125m", 16384, 8,   4,   64,  60040, False),
        ("125m",  8192, 8,   8,  128,  90392, False),
        ("125m",  4096, 8,  16,  256, 118396, False),
        ("125m",  2048, 8,  40,  640, 142830, False),
        ("125m",  2048, 8,  32,  512, 141737, False),
        ("125m",  1024, 8,  64, 1024, 156468, False),
        ("125m",   512, 8, 128, 2048, 165681, False))
TABLES = {"h100": H100, "a100": A100}
# The H100 family's calibration set (fit.py --family h100): the rows at 2,048 tokens a
# sequence, the table's own default length; every other row here is held out.
CALIBRATION = tuple(r for r in H100 if r[1] == 2048)


def plan_of(row, gpu: str) -> Plan:
    """The row as a plan: the example GPT at the MPT size, ZeRO-3 over every GPU."""
    size, seq, gpus, mbs, gbs, _, checkpointing = row
    dim, heads, layers = SIZES[size]
    return Plan(
        model=ModelSpec(source=GPT, args={"vocab": VOCAB, "dim": dim, "layers": layers,
                                          "heads": heads, "seq_len": seq}, capture="fx"),
        data=DataSpec(seq_len=seq, vocab=VOCAB),
        mesh=MeshSpec(pp=1, dp=gpus),
        pipeline=PipelineSpec(schedule="1f1b", microbatch_size=mbs),
        recompute=(RecomputeRule("layers.*", "full"),) if checkpointing else (),
        zero=3, train=TrainSpec(global_batch=gbs, precision="bf16"),
        device=DeviceSpec(name=gpu, ranks_per_node=8),
        path=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                          f"mosaic_{gpu}_{size}_{seq}_{gpus}.plan"))


def name_of(row) -> str:
    return f"{row[0]} {row[1]} x{row[2]}"


def tokens_per_gpu(row):
    """The row's tokens per second per GPU from a predict.Prediction of its plan."""
    _, seq, gpus, _, gbs, _, _ = row
    return lambda p: gbs * seq / p.step_s / gpus


def compiled_row(row, gpu: str):
    from pipeplan.compiler.driver import compile_plan
    return compile_plan(plan_of(row, gpu))


def timing(row, gpu: str):
    """The row's predict.Timing (re-timed on any device by fit.py)."""
    return compiled_row(row, gpu).estimates.timing


def predicted(row, gpu: str):
    """(tokens per second per GPU, MFU, peak bytes per rank, compile seconds) of the row."""
    from pipeplan.compiler.estimate.device import device_model
    start = time.perf_counter()
    compiled = compiled_row(row, gpu)
    took = time.perf_counter() - start
    p = compiled.estimates.timing.time_on(device_model(compiled.plan))
    return tokens_per_gpu(row)(p), p.mfu, compiled.estimates.peak_bytes, took


def summary(label: str, pub: list, pred: list) -> str:
    ratios = [q / p for p, q in zip(pub, pred)]
    return (f"{label}, {len(ratios)} rows: Spearman {spearman(pub, pred):.3f}; ratio median "
            f"{statistics.median(ratios):.3f}, range {min(ratios):.3f}-{max(ratios):.3f}; "
            f"largest deviation {max(abs(r - 1) for r in ratios):.1%}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpu", choices=sorted(TABLES), default="h100")
    ap.add_argument("--rows", type=int, default=None, help="the first N rows only")
    args = ap.parse_args(argv)
    rows = TABLES[args.gpu][:args.rows]
    print(f"{'model':>5} {'seq':>6} {'GPUs':>4} {'mbs':>3} {'ckpt':>4} {'published':>9} "
          f"{'predicted':>9} {'ratio':>6} {'MFU':>5} {'peak GiB':>8} {'compile':>7}")
    held, fitted = ([], []), ([], [])
    for row in rows:
        tps, mfu, peak, took = predicted(row, args.gpu)
        fit = args.gpu == "h100" and row in CALIBRATION
        for into, value in zip(fitted if fit else held, (row[5], tps)):
            into.append(value)
        print(f"{row[0]:>5} {row[1]:>6} {row[2]:>4} {row[3]:>3} {'yes' if row[6] else 'no':>4} "
              f"{row[5]:>9.0f} {tps:>9.0f} {tps / row[5]:>6.3f} {mfu:>5.3f} "
              f"{peak / 2**30:>8.1f} {took:>6.1f}s{'  (fit on)' if fit else ''}", flush=True)
    from pipeplan.compiler.estimate.devices import profile
    print(f"{args.gpu}: efficiency {profile(args.gpu).efficiency}")
    if fitted[0]:
        print(summary(f"{args.gpu}, the rows fitted on", *fitted))
    if held[0]:
        print(summary(f"{args.gpu}, held out", *held))
    return 0


if __name__ == "__main__":
    sys.exit(main())
