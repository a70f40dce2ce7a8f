"""The time and memory model against two open models' published training runs that no fit
saw, each on transformers' own model class at the published shape (the user's model, not
pipeplan's stand-in):

    run            GPUs              tp  pp  dp  micro  batch  published
    BLOOM-176B     384 A100 80 GB     4  12   8      2   2048  ~150 TFLOP/s a GPU, ~60 GB a GPU
    GPT-NeoX-20B    96 A100 40 GB     2   4  12      4   1536   117 TFLOP/s a GPU

    python -m pipeplan.tests.benchmarks.calibration.open_models

prints, per run, the published and predicted TFLOP/s per GPU (both count a full
recompute, as Narayanan et al.'s formula does: BigScience's "4*2 coefficient", GPT-NeoX's
`ckpt_activations_factor = 4`), their ratio, the step, the largest bubble of a pipeline
rank and the peak memory per rank (BLOOM's published 60 GB a GPU beside it), BLOOM also
with its published stage boundaries.

Sources. BLOOM: BigScience's tr11-176B-ml (github.com/bigscience-workshop/bigscience,
train/tr11-176B-ml: README "Replica setup" tp 4, pp 12, dp 8, micro-batch 2, global batch
2,048 of 2,048 tokens; the slurm script: --checkpoint-activations, --bf16, ZeRO-1 as
DeepSpeed's BF16_Optimizer, Megatron's default dropout 0.1, vocabulary padded to 250,880,
`--pp-partition-method type:transformer|embedding`: the embedding counted as a block, so
stages hold 5, 6 x 10 and 5 blocks); its cluster (Jean Zay: 8 A100 80 GB a node, 4
Omni-Path 100 Gb/s links a node, i.e. 50 Gb/s a GPU between nodes); its throughput "about
150 TFLOPs" a GPU and "one copy of the model takes 48 GPUs (using 60 GB of memory on each
GPU)" (BigScience's 176B model page; the bigscience/bloom model card: "~150 TFLOP per GPU
per second"). GPT-NeoX-20B: EleutherAI's configs/20B.yml (github.com/EleutherAI/gpt-neox:
pipe-parallel-size 4, model-parallel-size 2, micro-batch 4, gradient accumulation 32 over
96 GPUs = 1,536 sequences of 2,048, checkpoint-activations, ZeRO-1, fp16, dropout 0,
rotary on 25% of each head, the parallel residual, untied embeddings); Black et al. 2022
("GPT-NeoX-20B: An Open-Source Autoregressive Language Model"): 12 nodes of 8 A100-SXM4-40GB,
four ConnectX-6 (HDR, 200 Gb/s) adapters a node, i.e. 100 Gb/s a GPU between nodes, and
"117 teraFLOPS per GPU".

Each run is compiled on the meta device, no constant fitted here: the A100 fit of Table 1
(table1.py), the a100 / a100-40gb profiles with the cluster's network written over
`inter_node`, 8 GPUs a node. The models: `BloomForCausalLM` and `GPTNeoXForCausalLM` with
eager attention (both runs predate fused attention: Megatron's fused scale-mask-softmax over
an unfused QK^T), Megatron's column/row pairs over their fused QKV and MLP projections, the
vocabulary split in the embedding and head. What the comparison leaves out: GPT-NeoX ran in
fp16 with loss scaling (bf16 here: the A100's peak is the same); both ran DeepSpeed's
pipeline engine (blocking transfers, the gradient reduction after the flush), not the
timeline pipeplan's runtime runs; the HF classes compute BLOOM's softmax in float32 where
Megatron-DeepSpeed fused it.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import time

from pipeplan.dsl.ast import (DataSpec, DeviceSpec, MeshSpec, ModelSpec, PipelineSpec, Plan,
                              RecomputeRule, SplitSpec, TensorSpec, TrainSpec)

HERE = os.path.dirname(os.path.abspath(__file__))
MODULE = "pipeplan.tests.benchmarks.calibration.open_models"  # its factories, run as a script too
GB = 1e9


def bloom(layers: int = 70, hidden: int = 14336, heads: int = 112, vocab: int = 250880,
          dropout: float = 0.1):
    """transformers' BLOOM at BLOOM-176B's shape (its config.json: 70 layers, hidden 14,336,
    112 heads; the vocabulary padded to 250,880 as trained)."""
    from transformers import BloomConfig, BloomForCausalLM
    cfg = BloomConfig(vocab_size=vocab, hidden_size=hidden, n_layer=layers, n_head=heads,
                      hidden_dropout=dropout, attention_dropout=dropout, use_cache=False,
                      attn_implementation="eager")
    return BloomForCausalLM(cfg)


def neox(layers: int = 44, hidden: int = 6144, heads: int = 64, vocab: int = 50432):
    """transformers' GPT-NeoX at GPT-NeoX-20B's shape (its config.json)."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM
    cfg = GPTNeoXConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                        num_attention_heads=heads, intermediate_size=4 * hidden,
                        rotary_pct=0.25, use_parallel_residual=True, tie_word_embeddings=False,
                        hidden_dropout=0.0, attention_dropout=0.0, use_cache=False,
                        attn_implementation="eager")
    return GPTNeoXForCausalLM(cfg)


@dataclasses.dataclass(frozen=True)
class Run:
    name: str
    factory: str  # in this module
    vocab: int
    blocks: str  # the repeated blocks' module pattern
    column: tuple[str, ...]
    row: tuple[str, ...]
    vocab_split: tuple[str, ...]
    gpus: int
    tp: int
    pp: int
    micro: int
    batch: int
    device: str
    inter_node: float  # bytes/s a GPU between nodes
    published_tflops: float
    published_bytes: float = 0.0  # memory a GPU, where published
    split: tuple[str, ...] = ()  # the published stage boundaries, where published


_B, _N = "transformer.h.*.", "gpt_neox.layers.*."
RUNS = (
    Run("BLOOM-176B", "bloom", 250880, "transformer.h.*",
        (_B + "self_attention.query_key_value", _B + "mlp.dense_h_to_4h"),
        (_B + "self_attention.dense", _B + "mlp.dense_4h_to_h"),
        ("transformer.word_embeddings", "lm_head"), gpus=384, tp=4, pp=12, micro=2,
        batch=2048, device="a100", inter_node=50e9 / 8, published_tflops=150,
        published_bytes=60 * GB,
        split=tuple(f"transformer.h.{5 + 6 * i}" for i in range(11))),
    Run("GPT-NeoX-20B", "neox", 50432, "gpt_neox.layers.*",
        (_N + "attention.query_key_value", _N + "mlp.dense_h_to_4h"),
        (_N + "attention.dense", _N + "mlp.dense_4h_to_h"),
        ("gpt_neox.embed_in", "lm_head"), gpus=96, tp=2, pp=4, micro=4, batch=1536,
        device="a100-40gb", inter_node=100e9 / 8, published_tflops=117),
)


def plan_of(run: Run, published_split: bool = False) -> Plan:
    split = SplitSpec(kind="points", points=run.split) if published_split else SplitSpec()
    return Plan(
        model=ModelSpec(source=f"{MODULE}:{run.factory}", capture="export"),
        data=DataSpec(seq_len=2048, vocab=run.vocab),
        mesh=MeshSpec(pp=run.pp, dp=run.gpus // (run.tp * run.pp), tp=run.tp),
        pipeline=PipelineSpec(schedule="1f1b", microbatch_size=run.micro, split=split),
        tensor=TensorSpec(column=run.column, row=run.row, vocab=run.vocab_split),
        recompute=(RecomputeRule(run.blocks, "full"),), zero=1,
        train=TrainSpec(global_batch=run.batch, precision="bf16"),
        device=DeviceSpec(name=run.device, inter_node=run.inter_node, ranks_per_node=8),
        path=os.path.join(HERE, f"{run.factory}.plan"))


def predicted(run: Run, published_split: bool = False):
    """(TFLOP/s per GPU with the recompute counted, the Prediction, peak bytes a rank,
    compile seconds)."""
    from pipeplan.compiler.driver import compile_plan
    from pipeplan.compiler.estimate.device import device_model
    start = time.perf_counter()
    compiled = compile_plan(plan_of(run, published_split))
    took = time.perf_counter() - start
    p = compiled.estimates.timing.time_on(device_model(compiled.plan))
    return p.tflops_per_gpu, p, compiled.estimates.peak_bytes, took


def main() -> int:
    print(f"{'run':>13} {'split':>9} {'published':>9} {'predicted':>9} {'ratio':>6} "
          f"{'step s':>7} {'bubble s':>8} {'peak GB':>8} {'published GB':>12} {'compile':>8}")
    for run in RUNS:
        for published_split in (False, True) if run.split else (False,):
            tf, p, peak, took = predicted(run, published_split)
            said = f"{run.published_bytes / GB:.0f}" if run.published_bytes else "-"
            bubble = max(r.bubble for r in p.ranks)
            print(f"{run.name:>13} {'published' if published_split else 'auto':>9} "
                  f"{run.published_tflops:>9} {tf:>9.1f} {tf / run.published_tflops:>6.3f} "
                  f"{p.step_s:>7.2f} {bubble:>8.2f} {peak / GB:>8.1f} {said:>12} "
                  f"{took:>7.1f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
