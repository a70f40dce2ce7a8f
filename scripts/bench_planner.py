"""Plan every row of Narayanan et al. 2021 Table 1 and compare with the published layout.

For each row (model, GPU count, global batch as published; A100 80 GB, fp16, seq 2048, vocab
51200; the FIELD-NOTES table, sources: the paper and Megatron-LM's examples/sc21) the planner
searches the layout; the published layout (its tp, pp, micro-batch, interleaving, full
recompute, no ZeRO, no SP) is predicted under the same model. Prints: row, published layout,
planner's best, predicted TFLOP/s per GPU of each, where the published layout ranks (or the
constraint that excluded it), search time (measured around the search here, not inside it).

    python scripts/bench_planner.py [--rows 1.7B,1T] [--max-evals N]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

from pipeplan.compiler.estimate.device import device_model
from pipeplan.dsl.load import load_plan
from pipeplan.planner.cost import predict
from pipeplan.planner.search import search
from pipeplan.planner.space import Candidate, Constraints
from pipeplan.compiler.estimate.devices import profile

# params, heads, hidden, layers, tp, pp, gpus, batch, micro-batch, virtual, TFLOP/s published
TABLE_1 = [
    ("1.7B", 24, 2304, 24, 1, 1, 32, 512, 16, None, 137),
    ("3.6B", 32, 3072, 30, 2, 1, 64, 512, 16, None, 138),
    ("7.5B", 32, 4096, 36, 4, 1, 128, 512, 16, None, 142),
    ("18B", 48, 6144, 40, 8, 1, 256, 1024, 8, None, 135),
    ("39B", 64, 8192, 48, 8, 2, 512, 1536, 4, None, 138),
    ("76B", 80, 10240, 60, 8, 4, 1024, 1792, 2, 3, 140),
    ("145B", 96, 12288, 80, 8, 8, 1536, 2304, 2, 2, 148),
    ("310B", 128, 16384, 96, 8, 16, 1920, 2160, 1, 2, 155),
    ("530B", 128, 20480, 105, 8, 35, 2520, 2520, 1, 3, 163),
    ("1T", 160, 25600, 128, 8, 64, 3072, 3072, 1, None, 163),
]
GPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                   "examples", "models", "gpt.py")


def plan_text(heads: int, hidden: int, layers: int) -> str:
    return f"""model {{
  source = "{GPT}:GPT"
  args = {{ vocab = 51200, dim = {hidden}, layers = {layers}, heads = {heads}, seq_len = 2048 }}
  inputs = {{ input_ids = int64[batch, seq] }}
  capture = fx
}}
data = synthetic(seed = 0, vocab = 51200, seq_len = 2048)
mesh {{ tp = 8 }}
tensor {{
  column = [layers.*.attn.q, layers.*.attn.k, layers.*.attn.v, layers.*.mlp.up]
  row = [layers.*.attn.proj, layers.*.mlp.down]
}}
train {{ global_batch = 8  precision = bf16 }}
device {{ name = a100  ranks_per_node = 8 }}
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="")
    ap.add_argument("--max-evals", type=int, default=400)
    args = ap.parse_args(argv)
    rows = [r for r in TABLE_1 if not args.rows or r[0] in args.rows.split(",")]
    print("| row | GPUs | published layout | TFLOP/s pub. pred. | planner's layout | TFLOP/s "
          "planner pred. | published rank | evaluated | search s (wall / cpu) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, heads, hidden, layers, tp, pp, gpus, batch, mbs, virtual, _pub in rows:
        with tempfile.NamedTemporaryFile("w", suffix=".plan", delete=False) as f:
            f.write(plan_text(heads, hidden, layers))
        plan = load_plan(f.name, [f"train.global_batch={batch}"])
        dev = device_model(plan)
        cap = profile("a100").memory_bytes
        t0, c0 = time.perf_counter(), time.process_time()
        res = search(plan, gpus, dev, cap, Constraints(), top_k=10, max_evals=args.max_evals)
        took, cpu = time.perf_counter() - t0, time.process_time() - c0
        dp = gpus // (tp * pp)
        kind = "interleaved" if virtual else "1f1b"
        pub = Candidate(pp, dp, tp, 1, 1, kind, virtual or 1, mbs, batch // (dp * mbs), False,
                        "full", 0)
        pp_pub = predict(res.units, pub, dev)
        rank = next((i + 1 for i, r in enumerate(res.top)
                     if (r.candidate.pp, r.candidate.tp, r.candidate.schedule,
                         r.candidate.virtual, r.candidate.mbs, r.candidate.recompute,
                         r.candidate.zero, r.candidate.sp) ==
                     (pp, tp, kind, virtual or 1, mbs, "full", 0, False)), None)
        ev = f"{res.evaluated}/{res.enumerated}" + ("" if res.closed else " (budget)")
        why = f"#{rank}" if rank else _excluded(res, pub, pp_pub)
        best = res.top[0] if res.top else None
        tf = lambda p: p.flops_per_gpu / p.step_time_s / 1e12  # noqa: E731
        print(f"| {name} | {gpus} | {pub.label()} | {tf(pp_pub):.0f} | "
              f"{best.candidate.label() if best else '-'} | "
              f"{tf(best.prediction):.0f} | {why} | {ev} | {took:.1f} / {cpu:.1f} |" if best else
              f"| {name} | {gpus} | {pub.label()} | {tf(pp_pub):.0f} | none fits | - | {why} | "
              f"{ev} | {took:.1f} / {cpu:.1f} |", flush=True)
        os.unlink(f.name)
    return 0


def _excluded(res, pub, pred) -> str:
    if pred.peak_bytes > res.capacity:
        return f"over memory ({pred.peak_bytes / 2**30:.1f} GiB)"
    if res.top and pred.step_time_s > res.top[-1].prediction.step_time_s:
        return "slower than the 10th"
    return "not in top 10"


if __name__ == "__main__":
    sys.exit(main())
