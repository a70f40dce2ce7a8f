"""Plan every row of Narayanan et al. 2021 Table 1 and compare with the published layout.

Each row's model is the calibration table's own (tests/benchmarks/calibration/table1.py:
the GPT with Megatron 2021's attention core and dropout, megatron_gpt.py; vocabulary 51200,
sequence 2048, bf16, A100 80 GB, 8 GPUs a node), with its GPU count and global batch as
published; the planner chooses the layout. The published layout (its tp, pp, micro-batch,
interleaving, full recompute, no ZeRO, no SP) is predicted by the same cost model. Per row:
published layout, planner's best, predicted TFLOP/s per GPU of each, where the published
layout ranks in the top 10 (or what excluded it), search seconds (wall and CPU, around
`search()`, the model's captures included), and the best plan written out and run through
`pipeplan check`'s steps (its estimate must equal the planner's).

Exit status 1 when a row breaks a claim: the best predicted slower than the published
layout, the published layout neither in the top 10 nor excluded for a stated reason, the
best plan refused by check or estimated differently by it.

    python scripts/bench_planner.py [--rows 1.7B,1T] [--max-evals N] [--no-check]
    python scripts/bench_planner.py --speed     # the 1T row and a 70B Llama: search seconds,
                                                # each in a fresh process
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import tempfile
import time

from pipeplan.compiler.estimate.device import device_model
from pipeplan.compiler.estimate.devices import profile
from pipeplan.dsl.ast import DataSpec, DeviceSpec, MeshSpec, ModelSpec, PipelineSpec, Plan, \
    TensorSpec, TrainSpec
from pipeplan.planner.cost import predict
from pipeplan.planner.report import plan_text, tflops
from pipeplan.planner.search import search
from pipeplan.planner.space import Candidate, Constraints
from pipeplan.tests.benchmarks.calibration.table1 import ROWS, plan_of

TOP = 10


def planner_input(row):
    """The row's plan with the layout taken out: the model, data, batch, bf16, the tensor
    patterns (tp 8 rows' own) and the A100 profile with 8 ranks a node."""
    plan = plan_of(_with_tp(row))
    return dataclasses.replace(
        plan, mesh=MeshSpec(), pipeline=PipelineSpec(), recompute=(),
        train=TrainSpec(global_batch=row[7], precision="bf16"),
        device=DeviceSpec(name="a100", ranks_per_node=8))


def _with_tp(row):
    """The row with tp 8, so plan_of writes the tensor section (the patterns tp may split)."""
    return row[:4] + (8,) + row[5:]


LLAMA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests",
                     "compiler", "models.py") + ":Llama"


def llama_70b_input(global_batch: int = 1024):
    """The speed target besides the 1T row: tests/compiler/models.py's Llama at its default,
    Llama-3-70B's shape (80 layers, hidden 8192, 64 heads, 8 KV heads, FFN 28672, vocabulary
    128256), sequence 4096, bf16, on H100s, 8 a node; global batch 1024 sequences (4M tokens)."""
    pre = "layers.*."
    return Plan(model=ModelSpec(source=LLAMA, capture="fx"),
                data=DataSpec(seq_len=4096, vocab=128256),
                tensor=TensorSpec(column=tuple(pre + m for m in ("attn.q", "attn.k", "attn.v",
                                                                 "gate", "up")),
                                  row=(pre + "attn.o", pre + "down"),
                                  vocab=("tok_emb", "lm_head")),
                train=TrainSpec(global_batch=global_batch, precision="bf16"),
                device=DeviceSpec(name="h100", ranks_per_node=8),
                path=os.path.join(tempfile.gettempdir(), "llama70b.plan"))


def speed(plan, gpus: int, max_evals: int) -> None:
    """One search, timed (wall and CPU): the speed goal's measurement."""
    dev = device_model(dataclasses.replace(plan, mesh=MeshSpec(pp=1, dp=gpus)))
    t0, c0 = time.perf_counter(), time.process_time()
    res = search(plan, gpus, dev, profile(plan.device.name).memory_bytes, Constraints(),
                 top_k=TOP, max_evals=max_evals)
    took, cpu = time.perf_counter() - t0, time.process_time() - c0
    best = res.top[0] if res.top else None
    print(f"{gpus} x {plan.device.name}: best {best.candidate.label() if best else 'none fits'}"
          f" ({tflops(best.prediction) if best else 0:.1f} TFLOP/s); evaluated "
          f"{res.evaluated}/{res.enumerated}{_open(res)}, model captured "
          f"{res.units.captures} times; search {took:.1f} s wall, {cpu:.1f} s CPU", flush=True)


def _open(res) -> str:
    """Why the search stopped before its bound closed ('' when it closed)."""
    return "" if res.closed else " (auto cap)" if res.auto_capped else " (budget)"


def published(row) -> Candidate:
    _, _, _, _, tp, pp, gpus, batch, mbs, virtual, _ = row
    dp = gpus // (tp * pp)
    kind = "interleaved" if virtual > 1 else "1f1b"
    return Candidate(pp, dp, tp, 1, 1, kind, virtual, mbs, batch // (dp * mbs), False, "full", 0)


def same_layout(a: Candidate, b: Candidate) -> bool:
    return dataclasses.replace(a, split=()) == dataclasses.replace(b, split=())


def check_best(plan, result, gpus: int) -> tuple[float, float]:
    """The best plan written (as `pipeplan plan -o` writes it), then `pipeplan check`'s steps
    on it (cli/check.run_check: load with the world size, the data check, the plan report,
    the model traced on meta and compiled): (its step time, CPU seconds)."""
    from pipeplan.compiler import load_model, render_summary
    from pipeplan.compiler.capture.init_rules import check_init
    from pipeplan.compiler.data import check_data
    from pipeplan.compiler.driver import compile_plan
    from pipeplan.dsl.load import load_plan
    from pipeplan.dsl.report import check_report
    c0 = time.process_time()
    peak = device_model(plan).flops_per_s
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "best.plan")
        with open(path, "w", encoding="utf-8") as f:
            f.write(plan_text(plan, result, 0, "bench_planner", peak))
        written = load_plan(path, world_size=gpus)
        check_data(written)
        check_report(written)
        model = load_model(written, "meta")
        check_init(written, model)
        compiled = compile_plan(written, model)
        render_summary(compiled)
    return compiled.estimates.step_time_s, time.process_time() - c0


def excluded(res, pub: Candidate, pred) -> str:
    """Why the published layout is not in the top 10 (a constraint, slower, or listed at
    another ZeRO stage predicted within search.ZERO_TIE of it: the planner lists one)."""
    from pipeplan.planner.search import ZERO_TIE
    for i, r in enumerate(res.top):
        if same_layout(dataclasses.replace(r.candidate, zero=pub.zero), pub):
            return (f"#{i + 1} as z{r.candidate.zero} (ZeRO stages within {ZERO_TIE:.0%} "
                    "listed once)")
    if pred.peak_bytes > res.capacity:
        return f"over memory ({pred.peak_bytes / 2**30:.1f} GiB)"
    if res.top and pred.step_time_s > res.top[-1].prediction.step_time_s:
        return (f"slower than #{len(res.top)} by "
                f"{pred.step_time_s / res.top[-1].prediction.step_time_s - 1:.2%}")
    return "not in the searched space"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="")
    ap.add_argument("--max-evals", type=int, default=2000)
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--speed", action="store_true", help="time the two speed targets only: "
                    "the 1T row on 3072 A100s and a 70B Llama on 1024 H100s, each in a "
                    "process of its own (no heap left over from the other)")
    ap.add_argument("--speed-target", choices=("1T", "70B"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.speed_target == "1T":
        speed(planner_input(ROWS[-1]), ROWS[-1][6], args.max_evals)
        return 0
    if args.speed_target == "70B":
        speed(llama_70b_input(), 1024, args.max_evals)
        return 0
    if args.speed:
        for target in ("1T", "70B"):
            done = subprocess.run([sys.executable, os.path.abspath(__file__), "--speed-target",
                                   target, "--max-evals", str(args.max_evals)])
            if done.returncode:
                return done.returncode
        return 0
    rows = [r for r in ROWS if not args.rows or r[0] in args.rows.split(",")]
    print("| row | GPUs | published layout | TFLOP/s pub. | planner's layout | TFLOP/s best "
          "| published rank | evaluated | search s (wall / cpu) | check |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    failed = []
    for row in rows:
        name, gpus = row[0], row[6]
        plan = planner_input(row)
        dev = device_model(dataclasses.replace(plan, mesh=MeshSpec(pp=1, dp=gpus)))
        t0, c0 = time.perf_counter(), time.process_time()
        res = search(plan, gpus, dev, profile("a100").memory_bytes, Constraints(), top_k=TOP,
                     max_evals=args.max_evals)
        took, cpu = time.perf_counter() - t0, time.process_time() - c0
        pub = published(row)
        p_pub = predict(res.units, pub, dev)
        rank = next((i + 1 for i, r in enumerate(res.top) if same_layout(r.candidate, pub)),
                    None)
        why = f"#{rank}" if rank else excluded(res, pub, p_pub)
        ev = f"{res.evaluated}/{res.enumerated}" + _open(res)
        best = res.top[0] if res.top else None
        checked = "-"
        if best and not args.no_check:
            step, ccpu = check_best(plan, res, gpus)
            same = abs(step / best.prediction.step_time_s - 1) < 1e-9
            checked = f"ok, same estimate ({ccpu:.0f} s)" if same else \
                f"estimate differs: {step:.6g} s vs {best.prediction.step_time_s:.6g} s"
            if not same:
                failed.append(f"{name}: check's estimate differs")
        if best is None or best.prediction.step_time_s > p_pub.step_time_s * (1 + 1e-12):
            failed.append(f"{name}: best slower than the published layout")
        if why == "not in the searched space":
            failed.append(f"{name}: published layout neither in the top {TOP} nor excluded")
        print(f"| {name} | {gpus} | {pub.label()} | {tflops(p_pub):.1f} | "
              f"{best.candidate.label() if best else 'none fits'} | "
              f"{tflops(best.prediction) if best else float('nan'):.1f} | {why} | {ev} | "
              f"{took:.1f} / {cpu:.1f} | {checked} |", flush=True)
    for f in failed:
        print("FAILED", f)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
