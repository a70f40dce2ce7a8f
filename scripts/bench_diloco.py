"""Cross-island traffic and loss: every-step data parallelism vs DiLoCo on the MoE example.

Trains examples/moe_pp2_ep2_zbv.plan with ep = 1 (with ep = 2 over the dp ranks, every-step
training's all-to-all would cross the islands, which the gradient byte counts here do not
see; DiLoCo keeps EP inside the islands only on their tp ranks, tested in
tests/backends/test_diloco_tp_ep.py) on 4 gloo ranks
(pp=2 x dp=2 islands) for N steps, once per sync mode, and prints for each the bytes rank
traffic sent across islands (measured at the all-reduce call sites: gradients every step,
or pseudo-gradients at each sync; ring all-reduce, 2(n-1)/n of each tensor), the compiler's
estimate of the same, the mean island loss of the last step, and the loss of the final
parameters (island 0's, which every island shares after the last sync) on 4 held-out batches.

    PYTHONPATH=/path/above/pipeplan python scripts/bench_diloco.py [--steps 50] [--h 10,50]
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import pickle
import socket
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
PLAN = os.path.join(HERE, "..", "examples", "moe_pp2_ep2_zbv.plan")
HELD_OUT = range(10_000, 10_004)  # data steps never trained on


def load(steps: int, sync: str):
    from pipeplan.dsl.load import load_plan

    plan = load_plan(PLAN, overrides=["mesh.ep=1", f"train.steps={steps}", f"sync={sync}"])
    return plan


def _rank(rank: int, world: int, port: int, out: str, steps: int, sync: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    from pipeplan.backends.trainer import PipelineTrainer

    plan = load(steps, sync)
    trainer = PipelineTrainer.for_plan(plan)
    start = time.perf_counter()
    losses = [trainer.step(t).loss for t in range(steps)]
    seconds = time.perf_counter() - start
    sent = trainer.diloco.bytes_sent if trainer.diloco else trainer.sync.bytes_sent
    result = dict(rank=rank, dp=trainer.topo.coords.dp, losses=losses, sent=sent,
                  seconds=seconds, params=trainer.named_parameters())
    with open(os.path.join(out, f"{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    dist.destroy_process_group()


def run(steps: int, sync: str) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_rank, args=(4, port, out, steps, sync), nprocs=4,
                           start_method="fork")
        return [pickle.load(open(os.path.join(out, f"{r}.pkl"), "rb")) for r in range(4)]


def held_out_loss(plan, results) -> float:
    from pipeplan.backends import data
    from pipeplan.backends.model import build_model, model_loss

    model = build_model(plan)
    state = {}
    for r in results:
        if r["dp"] == 0:
            state.update(r["params"])
    model.load_state_dict(state, strict=False)
    missing = [n for n, _ in model.named_parameters() if n not in state]
    assert not missing, missing
    with torch.no_grad():
        return sum(float(model_loss(plan, model(b.input_ids), b.targets))
                   for b in (data.global_batch(plan, t) for t in HELD_OUT)) / len(HELD_OUT)


def estimate_bytes(plan) -> int:
    from pipeplan.compiler.driver import compile_plan

    e = compile_plan(plan).estimates
    return max(rk.comm_bytes["dp"] for rk in e.ranks) * plan.train.steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--h", default="10,50", help="inner steps H, comma-separated")
    args = ap.parse_args()
    modes = [("every_step", "every_step")] + [
        (f"diloco(H={h})", f"diloco(inner_steps = {h}, outer_optimizer = "
                           f"nesterov(lr = 0.7, momentum = 0.9))")
        for h in map(int, args.h.split(","))]
    rows = []
    for name, sync in modes:
        plan = load(args.steps, sync)
        results = run(args.steps, sync)
        sent = max(r["sent"] for r in results)
        last = sum(r["losses"][-1] for r in results if r["rank"] in (0, 1)) / 2
        rows.append((name, sent, estimate_bytes(plan), last, held_out_loss(plan, results),
                     max(r["seconds"] for r in results)))
        print(f"{name}: done", file=sys.stderr, flush=True)
    base = rows[0][1]
    print(f"MoE example (pp=2 x dp=2 islands, ep=1), {args.steps} steps, AdamW inner")
    print(f"{'mode':<14} {'cross-island bytes/rank':>24} {'estimate':>12} {'ratio':>7} "
          f"{'last-step loss':>15} {'held-out loss':>14} {'train s':>8}")
    for name, sent, est, last, held, secs in rows:
        print(f"{name:<14} {sent:>24,} {est:>12,} {base / sent if sent else 0:>6.1f}x "
              f"{last:>15.4f} {held:>14.4f} {secs:>8.1f}")


if __name__ == "__main__":
    main()
