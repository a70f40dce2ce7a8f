"""Side-by-side measurements for per-stage parallelism (a script, not a test).

    python tests/parallel/bench_parallel.py

1. MoE layer forward+backward: the dense reference (every expert on every
   token, gates mix them) against pipeplan's dispatching layer on one process
   (each expert only on its routed tokens): same math, k/E of the expert FLOPs.
2. Per-rank bytes of parameters, gradients and AdamW states of a GPT's
   parameters under ZeRO 0-3 over dp = 4 (zero_layout.expected_memory, the formula the
   tests check against measured tensors).
"""
from __future__ import annotations

import copy
import time

import torch

from pipeplan.backends.parallel.ep.experts import ExpertParallelMoE
from pipeplan.compiler.parallel.zero import expected_memory
from pipeplan.examples.models.gpt import GPT
from pipeplan.examples.models.moe_gpt import MoE


def _time(fn, repeats: int = 5) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def bench_moe(dim=256, hidden=512, experts=8, top_k=2, tokens=2048) -> None:
    torch.manual_seed(0)
    dense = MoE(dim, hidden, experts, top_k)
    routed = ExpertParallelMoE(copy.deepcopy(dense))
    x = torch.randn(1, tokens, dim)

    def step(layer):
        def run():
            out, aux = layer(x)
            (out.square().mean() + aux).backward()
        return run

    t_dense, t_routed = _time(step(dense)), _time(step(routed))
    print(f"MoE fwd+bwd, d={dim} h={hidden} E={experts} k={top_k} T={tokens}: "
          f"dense {t_dense * 1e3:.1f} ms, dispatched {t_routed * 1e3:.1f} ms, "
          f"speed-up x{t_dense / t_routed:.2f}")


def bench_zero_memory(dp=4) -> None:
    numel = sum(p.numel() for p in GPT(vocab=256, dim=256, layers=4, heads=4).parameters())
    print(f"GPT ({numel} params) per-rank bytes over dp={dp} (params / grads / AdamW states):")
    for stage in range(4):
        m = expected_memory(numel, dp, stage)
        total = m.params + m.grads + m.optimizer
        print(f"  zero {stage}: {m.params:>9} / {m.grads:>9} / {m.optimizer:>9}  total {total:>9}")


if __name__ == "__main__":
    torch.set_num_threads(1)
    bench_moe()
    bench_zero_memory()
