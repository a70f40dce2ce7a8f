"""pipeplan next to torch.distributed.pipelining, in the same rank processes, step by step.

    PYTHONPATH=... python tests/benchmarks/vs_torch.py [--steps 14] [--worlds 2,4]
        [--schedules 1f1b,interleaved,zbv] [--profile DIR] [--mode eager|graphs|inductor]
        [--dim 128] [--torch-compile]

One model, split, batch and optimizer for both: the example GPT (vocab 256, dim 128, 8
layers, seq 64), an equal split of the layers over world x virtual stages (embeddings
with the first, the final norm and tied LM head with the last), 8 microbatches of 2
sequences, AdamW (the plan's, foreach off, on both sides). pipeplan runs its plan
(`PipelineTrainer`, as `pipeplan run` builds it); torch runs manual `PipelineStage`s
holding the same modules and weights, with Schedule1F1B, ScheduleInterleaved1F1B or
ScheduleZBVZeroBubble, and sums the tied embedding's gradient between the first and
last stage's ranks itself (torch has no tie support). Each rank alternates: one
pipeplan step, one torch step (which goes first alternates too), each started after a
barrier; a step's time is the
slowest rank's. The first step of each is the warm-up, measured for memory
(the rank's parameter bytes plus the peak of the tensor storages the step
allocates and keeps alive: activations, gradients, communication buffers,
optimizer state; max over ranks; not measured for a torch.compile'd side, which does not
compile under the tracking dispatch mode); the rest for time. Both must reach the same losses.

`--mode` is pipeplan's compile.mode; `--dim` the model width; `--torch-compile` runs
torch's stages through per-stage `torch.compile` (inductor; 1F1B and interleaved only:
torch's zero-bubble schedules refuse a compiled stage, so a ZBV row keeps torch eager and
says so). Compile times: pipeplan's seconds of tracing, partitioning and inductor per
rank (max over ranks, from the runners), and each side's warm-up step (which holds
torch.compile's compiles and pipeplan's first-microbatch trace).

Prints per (world, schedule): median step time of each, the ratio pipeplan/torch,
the peak memory ratio, and the floor: per timed step, pipeplan's order of the
schedule simulated with torch's own measured compute of each action (its stage
methods' wall time, the loss included) and nothing else -- transfers free and
instant, no runtime work between actions -- plus each rank's measured optimizer
step; floor/torch is the ratio a runtime with no overhead at all would reach
with the model's kernels as torch runs them (a ratio below it needs faster
kernels, not a better runtime). fastest/torch is the same bound with every
action and optimizer step at the fastest it ran in any timed step: how far the
kernels' own step-to-step jitter on this machine reaches, not a reachable time. `--profile DIR` writes each rank's cProfile of either side's
timed steps. Same-process alternation is the only comparison that means anything on a
loaded machine (separate launches vary 0.3-2.7x for identical code here).
"""
from __future__ import annotations

import argparse
import cProfile
import os
import socket
import statistics
import sys
import time
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

MODEL = {"vocab": 256, "dim": 128, "layers": 8, "heads": 4, "seq_len": 64}
TIED = {"1f1b": True, "interleaved": True, "zbv": False}
MICROBATCHES, GLOBAL_BATCH = 8, 16
SCHEDULES = {"1f1b": 1, "interleaved": 2, "zbv": 2}  # kind -> stages per rank
REPO = Path(__file__).resolve().parents[2]

PLAN = """
model {{
  source = "{repo}/examples/models/gpt.py:GPT"
  args = {{ vocab = {vocab}, dim = {dim}, layers = {layers}, heads = {heads}, seq_len = {seq_len}, tie_embeddings = {tie} }}
  capture = fx
  loss = cross_entropy
}}
data = synthetic(seed = 0, vocab = {vocab}, seq_len = {seq_len})
mesh {{
  pp = {pp}
}}
pipeline {{
  schedule = {kind}
  microbatches = {m}
  virtual = {v}
  split = [{split}]
}}
train {{
  steps = {steps}
  global_batch = {gb}
  optimizer = adamw(lr = 0.001, weight_decay = 0.1)
  seed = 0
}}
compile {{
  mode = {mode}
}}
"""


def layer_ranges(stages: int) -> list[tuple[int, int]]:
    per = MODEL["layers"] // stages
    return [(i * per, (i + 1) * per) for i in range(stages)]


def make_plan(kind: str, world: int, steps: int, mode: str = "eager"):  # (MODEL as set by --dim)
    from pipeplan.dsl.load import parse_plan
    v = SCHEDULES[kind]
    split = ", ".join(f"layers[{a}:{b}]" for a, b in layer_ranges(world * v))
    text = PLAN.format(repo=REPO, pp=world, kind=kind, m=MICROBATCHES, v=v, split=split,
                       steps=steps, gb=GLOBAL_BATCH, tie=str(TIED[kind]).lower(), mode=mode,
                       **MODEL)
    return parse_plan(text, str(REPO / "bench_vs_torch.plan"))


# ----------------------------------------------------------------- the torch side
class TorchStage(nn.Module):
    """Stage i of the GPT as a plain module: (embeddings) + layers[a:b] (+ norm and head)."""

    def __init__(self, gpt: nn.Module, index: int, stages: int, a: int, b: int):
        super().__init__()
        self.first, self.last = index == 0, index == stages - 1
        if self.first:
            self.tok_emb, self.pos_emb = gpt.tok_emb, gpt.pos_emb
        self.layers = nn.ModuleList(gpt.layers[a:b])
        if self.last:
            self.ln_f, self.lm_head = gpt.ln_f, gpt.lm_head

    def forward(self, x):
        if self.first:
            x = self.tok_emb(x) + self.pos_emb(torch.arange(x.shape[1]))
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.ln_f(x)) if self.last else x


def loss_fn(logits, targets):
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten())


class TorchSide:
    def __init__(self, kind: str, world: int, rank: int, plan, trainer, compiled: bool = False):
        from torch.distributed.pipelining import (PipelineStage, Schedule1F1B,
                                                  ScheduleInterleaved1F1B, ScheduleZBVZeroBubble)

        from pipeplan.backends.runtime.optim import build_optimizer
        from pipeplan.examples.models.gpt import GPT
        v = SCHEDULES[kind]
        stages = world * v
        gpt = GPT(**MODEL, tie_embeddings=TIED[kind])  # weights replaced below by pipeplan's (same seed, same init)
        if kind == "zbv":  # the V: rank r holds stages r and 2*world-1-r
            mine = [rank, 2 * world - 1 - rank]
        else:  # round robin
            mine = list(range(rank, stages, world))
        self.placement = {s: (s if s < world else 2 * world - 1 - s) if kind == "zbv"
                          else s % world for s in range(stages)}
        ranges = layer_ranges(stages)
        self.modules = [TorchStage(gpt, s, stages, *ranges[s]) for s in mine]
        ours = trainer.parameters_by_name()
        names: dict[int, list[str]] = {}  # the model's names of each parameter (tied: two)
        for name, p in gpt.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(name)
        with torch.no_grad():
            for m in self.modules:
                for p in m.parameters():
                    p.copy_(ours[next(n for n in names[id(p)] if n in ours)])
        self.holds_first, self.holds_last = 0 in mine, stages - 1 in mine
        runs = [torch.compile(m) if compiled else m for m in self.modules]  # (same parameters)
        pipe = [PipelineStage(m, s, stages, torch.device("cpu")) for m, s in zip(runs, mine)]
        cls = {"1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B,
               "zbv": ScheduleZBVZeroBubble}[kind]
        self.schedule = cls(pipe[0] if kind == "1f1b" else pipe, MICROBATCHES, loss_fn=loss_fn)
        params = list({id(p): p for m in self.modules for p in m.parameters()}.values())
        self.tied = gpt.lm_head.weight if TIED[kind] and self.holds_first != self.holds_last \
            else None
        ends = sorted({self.placement[0], self.placement[stages - 1]})
        self.tie_group = dist.new_group(ends) if len(ends) > 1 else None  # collective
        self.optimizer = build_optimizer(params, plan.train)
        self.plan = plan
        self.records: list = []  # per step: ([(op, stage, mb, seconds)], optimizer seconds)
        self.ops = _time_compute(pipe, self.schedule)

    def step(self, t: int) -> torch.Tensor:
        from pipeplan.backends.runtime import data
        batch = data.global_batch(self.plan, t)
        losses: list = []
        if self.holds_first and self.holds_last:
            self.schedule.step(batch.input_ids, target=batch.targets, losses=losses)
        elif self.holds_first:
            self.schedule.step(batch.input_ids)
        elif self.holds_last:
            self.schedule.step(target=batch.targets, losses=losses)
        else:
            self.schedule.step()
        if self.tied is not None:  # the embedding and the head: one parameter, two ranks
            dist.all_reduce(self.tied.grad, group=self.tie_group)
        start = time.thread_time()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.records.append((list(self.ops), time.thread_time() - start))
        self.ops.clear()
        return torch.stack(losses).mean().detach() if losses else torch.zeros(())


def _time_compute(stages, schedule) -> list:
    """Record how long torch's own compute of each action takes on this rank: forward (and
    the loss, on the last stage), backward (full, or input-only under ZBV), weight backward
    -- the CPU time of the stage methods on this thread (not the wall time: with more ranks
    than cores a rank is also descheduled), without the schedule's communication. Returns
    the list the (op, stage, microbatch, seconds) records go to."""
    ops: list = []

    def wrap(obj, name, op_of):
        inner = getattr(obj, name)

        def timed(*args, **kwargs):
            start = time.thread_time()
            out = inner(*args, **kwargs)
            op, st, mb = op_of(*args, **kwargs)
            ops.append((op, st, mb, time.thread_time() - start))
            return out
        setattr(obj, name, timed)

    wrap(schedule, "_maybe_compute_loss",
         lambda st, output, target_mbs, mb, *a, **k: ("F", st.stage_index, mb))
    for stage in stages:
        index = stage.stage_index
        wrap(stage, "forward_one_chunk", lambda mb, *a, i=index, **k: ("F", i, mb))
        wrap(stage, "backward_one_chunk",
             lambda mb, loss=None, full_backward=True, last_backward=False, i=index:
             ("BW" if full_backward else "B", i, mb))
        wrap(stage, "backward_weight_one_chunk", lambda mb, *a, i=index, **k: ("W", i, mb))
    return ops


def floor_ms(kind: str, world: int, records: list) -> list[float]:
    """Per timed step, a lower bound on any runtime's step running pipeplan's order of this
    schedule with torch's own measured compute (CPU seconds) and nothing else -- p2p free
    and instant, no runtime work -- the larger of: the schedule simulated with those times
    plus each rank's optimizer after its last action (the slowest rank's end), and all
    ranks' compute over the cores they share (`os.cpu_count()`; 4 ranks on 2 cores here).
    records[rank][step] = ([(op, stage, mb, s)], optimizer s)."""
    from pipeplan.compiler import compile_plan
    from pipeplan.schedules.costs import Costs
    from pipeplan.schedules.simulate import simulate

    schedule = compile_plan(make_plan(kind, world, 2)).schedule

    def bound(took: dict, optimizer: list[float]) -> float:
        sim = simulate(schedule, Costs(latency=0.0),
                       durations=lambda a: took[(a.op, a.stage, a.microbatch)])
        path = max(sim.end[r][-1] + optimizer[r] for r in range(world))
        work = (sum(took.values()) + sum(optimizer)) / min(world, os.cpu_count() or 1)
        return max(path, work) * 1e3

    steps = []
    for step in range(len(records[0])):
        took: dict = {}
        for rank in records:
            for op, st, mb, sec in rank[step][0]:
                took[(op, st, mb)] = took.get((op, st, mb), 0.0) + sec  # F + its loss
        steps.append((took, [records[r][step][1] for r in range(world)]))
    # every action (and optimizer) at the fastest it ran in any timed step
    best = {k: min(t[k] for t, _ in steps) for k in steps[0][0]}
    fastest = bound(best, [min(o[r] for _, o in steps) for r in range(world)])
    return [bound(t, o) for t, o in steps], fastest


# --------------------------------------------------------------------- one rank
class PeakBytes(TorchDispatchMode):
    """Peak bytes of the tensor storages created under it and still alive: activations,
    gradients, communication buffers, optimizer state (parameters are added by `_peak`)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._refs: dict = {}

    def _free(self, key, nbytes) -> None:
        self._refs.pop(key, None)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                key = st._cdata
                if key not in self._refs:
                    n = st.nbytes()
                    self._refs[key] = weakref.ref(st, lambda _, k=key, n=n: self._free(k, n))
                    self.live += n
                    self.peak = max(self.peak, self.live)
        return out


def _peak(fn, modules) -> int:
    """Parameter bytes plus the peak of what `fn` allocates (one step, from a cold start)."""
    params = {id(p): p.numel() * p.element_size() for m in modules for p in m.parameters()}
    tracker = PeakBytes()
    with tracker:
        fn()
    return sum(params.values()) + tracker.peak


def _timed(fn, prof=None) -> float:
    dist.barrier()
    if prof:
        prof.enable()
    start = time.perf_counter()
    fn()
    took = torch.tensor(time.perf_counter() - start)
    if prof:
        prof.disable()
    dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the step ends when its slowest rank does
    return float(took)


def _rank(rank: int, world: int, port: int, kind: str, steps: int, out: str,
          profile: str, mode: str = "eager", dim: int = 128, compiled: bool = False) -> None:
    from pipeplan.backends.runtime.trainer import PipelineTrainer
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    MODEL["dim"] = dim
    plan = make_plan(kind, world, steps, mode)
    ours = PipelineTrainer.for_plan(plan)
    theirs = TorchSide(kind, world, rank, plan, ours, compiled)
    mine_pp = {s for s in ours.runners}
    assert mine_pp == {s for s, r in theirs.placement.items() if r == rank}, \
        f"rank {rank}: pipeplan holds stages {sorted(mine_pp)}, torch others"
    ours_losses, theirs_losses, ours_t, theirs_t = [], [], [], []
    report = [None]

    def ours_step(t):
        report[0] = ours.step(t)
        ours_losses.append(report[0].loss)

    def theirs_step(t):
        loss = theirs.step(t)
        theirs_losses.append(loss)

    ours_modules = [r.module for r in ours.runners.values()]
    start = time.perf_counter()
    mem_ours = _peak(lambda: ours_step(0), ours_modules)
    warm_ours = time.perf_counter() - start
    start = time.perf_counter()
    if compiled:  # (under _peak's dispatch mode torch.compile would not compile: no peak)
        theirs_step(0)
        mem_theirs = float("nan")
    else:
        mem_theirs = _peak(lambda: theirs_step(0), theirs.modules)
    warm_theirs = time.perf_counter() - start
    traced = sum(getattr(r, "trace_seconds", 0.0) for r in ours.runners.values())
    from torch._dynamo.utils import counters
    dynamo_graphs = counters["stats"]["unique_graphs"]  # torch.compile's graphs on this rank
    profs = {"pipeplan": cProfile.Profile(), "torch": cProfile.Profile()} if profile else {}
    for t in range(1, steps):  # who goes first alternates too (allocator, caches)
        pair = [lambda: ours_t.append(_timed(lambda: ours_step(t), profs.get("pipeplan"))),
                lambda: theirs_t.append(_timed(lambda: theirs_step(t), profs.get("torch")))]
        for run_one in pair if t % 2 else pair[::-1]:
            run_one()
    for name, prof in profs.items():
        prof.dump_stats(os.path.join(profile, f"{name}-{kind}-w{world}-rank{rank}.prof"))
    theirs_all = torch.stack(theirs_losses).double()
    dist.all_reduce(theirs_all)  # only the last stage's rank holds them
    peaks = torch.tensor([mem_ours, mem_theirs], dtype=torch.float64)
    dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
    warm = torch.tensor([warm_ours, warm_theirs, traced, dynamo_graphs], dtype=torch.float64)
    dist.all_reduce(warm, op=dist.ReduceOp.MAX)
    records = [None] * world
    dist.all_gather_object(records, theirs.records[1:])  # the timed steps
    if rank == 0:
        torch.save({"ours_losses": ours_losses, "theirs_losses": theirs_all.tolist(),
                    "ours_t": ours_t, "theirs_t": theirs_t, "mem": peaks.tolist(),
                    "floor": floor_ms(kind, world, records), "warm": warm.tolist()}, out)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(kind: str, world: int, steps: int, tmp: str, profile: str, mode: str = "eager",
        dim: int = 128, compiled: bool = False) -> dict:
    out = os.path.join(tmp, f"{kind}-{world}.pt")
    mp.start_processes(_rank, args=(world, _free_port(), kind, steps, out, profile, mode, dim,
                                    compiled), nprocs=world, start_method="fork")
    return torch.load(out, weights_only=True)


def main() -> None:
    import tempfile
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--schedules", default="1f1b,interleaved,zbv")
    ap.add_argument("--profile", default="")
    ap.add_argument("--mode", default="eager", choices=("eager", "graphs", "inductor"),
                    help="pipeplan's compile.mode (torch's side stays eager: its zero-bubble "
                         "schedules refuse a compiled stage)")
    ap.add_argument("--dim", type=int, default=MODEL["dim"], help="the model width")
    ap.add_argument("--torch-compile", action="store_true",
                    help="torch's stages through per-stage torch.compile (not under zbv: "
                         "torch refuses a compiled stage there)")
    args = ap.parse_args()
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
    import pipeplan.backends.runtime.trainer  # noqa: F401  (imported once, before the ranks fork)
    import torch._dynamo  # noqa: F401
    print(f"GPT dim {args.dim} x {MODEL['layers']} layers, {MICROBATCHES} microbatches of "
          f"{GLOBAL_BATCH // MICROBATCHES}x{MODEL['seq_len']} tokens, AdamW, gloo, 1 thread "
          f"per rank; {args.steps - 1} timed steps each after 1 warm-up, alternating; "
          f"pipeplan compile.mode = {args.mode}, torch "
          f"{'per-stage torch.compile' if args.torch_compile else 'eager'}")
    print(f"{'world':>5} {'schedule':12} {'pipeplan ms':>11} {'torch ms':>9} {'time ratio':>10} "
          f"{'memory ratio':>12} {'floor ms':>8} {'floor/torch':>11} {'fastest/torch':>13}  "
          f"{'warm-up s ours/torch':>20} {'compile s':>9}  losses (max rel diff)")
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        for world in map(int, args.worlds.split(",")):
            for kind in args.schedules.split(","):
                compiled = args.torch_compile and kind != "zbv"
                r = run(kind, world, args.steps, tmp, args.profile, args.mode, args.dim,
                        compiled)
                ours, theirs = statistics.median(r["ours_t"]), statistics.median(r["theirs_t"])
                diff = max(abs(a - b) / abs(b) for a, b in zip(r["ours_losses"],
                                                               r["theirs_losses"]))
                same = diff < 1e-4
                failed |= not same
                floors, fastest = r["floor"]
                floor = statistics.median(floors)
                print(f"{world:>5} {kind:12} {ours * 1e3:11.1f} {theirs * 1e3:9.1f} "
                      f"{ours / theirs:10.2f} {r['mem'][0] / r['mem'][1]:12.2f} "
                      f"{floor:8.1f} {floor / (theirs * 1e3):11.2f} "
                      f"{fastest / (theirs * 1e3):13.2f}  "
                      f"{r['warm'][0]:9.1f}/{r['warm'][1]:<10.1f} {r['warm'][2]:9.1f}  "
                      f"{'same' if same else 'DIFFERENT'} ({diff:.1e})"
                      + ("  (torch eager: its ZBV refuses a compiled stage)"
                         if args.torch_compile and kind == "zbv" else "")
                      + (f"  (torch.compile graphs per rank: {r['warm'][3]:.0f})"
                         if compiled else ""), flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
