"""Cross-island traffic and loss: every-step data parallelism vs DiLoCo on the MoE example.

Trains examples/moe_pp2_ep2_zbv.plan on 4 gloo ranks for N steps, once per sync mode:

* default: with ep = 1 (pp=2 x dp=2 islands);
* `--ep`: with its ep = 2 at pp=1 x dp=2 x tp=2 (attention tensor-parallel, 1f1b). Under
  every-step sync EP re-divides the dp ranks, so its all-to-all crosses the islands every
  step; under DiLoCo EP stays on each island's tp ranks (dsl/layout.py).

It prints for each mode the bytes the busiest rank sent across islands, counted at the
call sites: gradient all-reduces every step or pseudo-gradients at each sync (ring
all-reduce, 2(n-1)/n of each tensor), and with `--ep` under every-step sync the rows the
expert all-to-alls send to the other island (their split sizes); the compiler's estimate
of the same (dp bytes, plus the EP all-to-all estimate, which assumes even routing); the
mean island loss of the last step; and the loss of the final parameters (island 0's,
which every island shares after the last sync) on 4 held-out batches.

    PYTHONPATH=/path/above/pipeplan python scripts/bench_diloco.py [--steps 50] [--h 10,50] [--ep]
"""
from __future__ import annotations

import argparse
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


# --ep: the example's ep = 2 kept, inside the islands' tp ranks under DiLoCo
EP_MESH = ["mesh.pp=1", "mesh.tp=2", "pipeline.schedule=1f1b", "pipeline.virtual=1",
           "pipeline.split=auto", "tensor.column=[layers.*.attn.q, layers.*.attn.k, "
           "layers.*.attn.v]", "tensor.row=[layers.*.attn.proj]"]


def load(steps: int, sync: str, ep: bool = False):
    from pipeplan.dsl.load import load_plan

    mesh = EP_MESH if ep else ["mesh.ep=1"]
    return load_plan(PLAN, overrides=mesh + [f"train.steps={steps}", f"sync={sync}"])


class CrossIslandAllToAll:
    """Counts the bytes this rank's all_to_all_single calls on `group` send to other ranks
    (every-step sync with EP over the dp ranks: each of those crosses islands)."""

    def __init__(self, group):
        self.group, self.bytes = group, 0
        self._call = dist.all_to_all_single

    def __enter__(self):
        def counted(output, input, output_split_sizes=None, input_split_sizes=None,
                    group=None, async_op=False):
            if group is self.group:
                n, me = dist.get_world_size(group), dist.get_rank(group)
                rows = input.shape[0]
                splits = input_split_sizes or [rows // n] * n
                self.bytes += (rows - splits[me]) * input[:1].numel() * input.element_size()
            return self._call(output, input, output_split_sizes, input_split_sizes,
                              group=group, async_op=async_op)
        dist.all_to_all_single = counted
        return self

    def __exit__(self, *exc):
        dist.all_to_all_single = self._call


def _rank(rank: int, world: int, port: int, out: str, steps: int, sync: str, ep: bool) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    from pipeplan.backends.runtime.trainer import PipelineTrainer

    plan = load(steps, sync, ep)
    trainer = PipelineTrainer.for_plan(plan)
    groups = trainer.layout.groups
    crossing = groups.ep if groups is not None and not plan.mesh.islands else None
    start = time.perf_counter()
    with CrossIslandAllToAll(crossing) as a2a:
        losses = [trainer.step(t).loss for t in range(steps)]
    seconds = time.perf_counter() - start
    sent = trainer.diloco.bytes_sent if trainer.diloco else trainer.sync.bytes_sent
    sent += a2a.bytes if crossing is not None else 0
    result = dict(rank=rank, dp=trainer.topo.coords.dp, losses=losses, sent=sent,
                  seconds=seconds, params=trainer.named_parameters())
    with open(os.path.join(out, f"{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    dist.destroy_process_group()


def run(steps: int, sync: str, ep: bool) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_rank, args=(4, port, out, steps, sync, ep), nprocs=4,
                           start_method="fork")
        return [pickle.load(open(os.path.join(out, f"{r}.pkl"), "rb")) for r in range(4)]


def held_out_loss(plan, results) -> float:
    from pipeplan.backends.runtime import data
    from pipeplan.backends.state.model import build_model, model_loss

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
    """dp bytes (pseudo-gradients under DiLoCo), plus the EP all-to-all when it crosses the
    islands (every-step sync with EP over the dp ranks)."""
    from pipeplan.compiler.driver import compile_plan
    from pipeplan.dsl.layout import ep_across_tp

    e = compile_plan(plan).estimates
    crossing = plan.mesh.ep > 1 and not ep_across_tp(plan.mesh)
    return max(rk.comm_bytes["dp"] + (rk.comm_bytes.get("ep", 0) if crossing else 0)
               for rk in e.ranks) * plan.train.steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--h", default="10,50", help="inner steps H, comma-separated")
    ap.add_argument("--ep", action="store_true",
                    help="keep the example's ep = 2, at pp=1 x dp=2 x tp=2 (see above)")
    args = ap.parse_args()
    modes = [("every_step", "every_step")] + [
        (f"diloco(H={h})", f"diloco(inner_steps = {h}, outer_optimizer = "
                           f"nesterov(lr = 0.7, momentum = 0.9))")
        for h in map(int, args.h.split(","))]
    rows = []
    for name, sync in modes:
        plan = load(args.steps, sync, args.ep)
        results = run(args.steps, sync, args.ep)
        sent = max(r["sent"] for r in results)
        firsts = {}  # each island's loss, from its first rank
        for r in results:
            firsts.setdefault(r["dp"], r["losses"][-1])
        last = sum(firsts.values()) / len(firsts)
        rows.append((name, sent, estimate_bytes(plan), last, held_out_loss(plan, results),
                     max(r["seconds"] for r in results)))
        print(f"{name}: done", file=sys.stderr, flush=True)
    base = rows[0][1]
    print("MoE example (" + ("pp=1 x dp=2 islands x tp=2, ep=2" if args.ep
                             else "pp=2 x dp=2 islands, ep=1") + f"), {args.steps} steps, AdamW inner")
    print(f"{'mode':<14} {'cross-island bytes/rank':>24} {'estimate':>12} {'ratio':>7} "
          f"{'last-step loss':>15} {'held-out loss':>14} {'train s':>8}")
    for name, sent, est, last, held, secs in rows:
        print(f"{name:<14} {sent:>24,} {est:>12,} {base / sent if sent else 0:>6.1f}x "
              f"{last:>15.4f} {held:>14.4f} {secs:>8.1f}")


if __name__ == "__main__":
    main()
