"""The measured CPU profile against `pipeplan profile`: per stage, the time model's F, B, W
(compiler/estimate/optime.py on the CPU profile of cpu_probe.py) next to what the plan's own
processes measured on this machine.

    python tests/benchmarks/bench_cpu_model.py [--cached] [--repeat 3] [PLAN ...]
    python tests/benchmarks/bench_cpu_model.py [--cached] --alone [PLAN ...]

(default: the three example plans). The CPU profile is probed afresh as the run starts, into
a temporary cache its profiles share (`--cached`: the one ~/.cache/pipeplan holds, probed
whenever it was): this VM's speed moves with its host over hours, and a profile probed
hours before measures another machine (the example GPT's CPU times at 1.16-1.33 of the
prediction on a probe 8.5 hours old, 0.89-0.97 on one probed a minute before, stop 58).

Each plan is profiled `--repeat` times (`pipeplan profile`, `--warmup` (2) + 4 measured steps,
its ranks as local gloo processes; per stage and op the median of the runs: one run's slots
move 10-15% from the next on a quiet 2-core machine) and compiled without a device section
(the measured CPU); prints predicted and measured seconds per microbatch per stage and their
ratio (goal: within 15%), twice: the slots' wall time against the prediction with the ranks
sharing the cores, and the slots' CPU time on each rank's thread (the profile's `cpu`: the
action's compute and the posting of its transfers) against the prediction for a rank alone
less its waits in collectives (Costs.waiting: gloo blocks, the thread spends no CPU there),
plus each action's resume of its core where the ranks outnumber the cores (predict.resumed:
caches refilled after each handoff) and posting as the probe measured it among the ranks
(the fair share of the cores is waiting, not computing): the per-op model without the
scheduler's time slices. Then a line per plan: the predicted
step and, the ranks sharing the cores, the CPU seconds per step of all their processes that
the floor counts (predict.shared_floor), beside the run's own (its "CPU on ..." line: the
processes' CPU seconds per step, the step, the cores' busy share; median over the runs). On
a loaded shared machine the measurement moves with the load: report what you get.

`--warmup 40` for a dropless MoE (the MoE example): each expert's row count changes from
call to call, and torch's CPU GELU (oneDNN) compiles a kernel, forward and backward, for
each row count it has not met (a 256 KiB code buffer, mapped and faulted in: 30-130 page
faults and 0.6-2.2 ms of system time per F or B in the first steps, gone after ~40 steps
when its cache holds them; gdb on `mmap`, stop 62). The time model predicts the steady
state; fixed shapes (the dense examples) are compiled once in the first step.

`--alone`: no pipeline and no other ranks. Each stage runs F and its backward as the plan's
schedule runs it (BW, or B then W) in this one process, one thread (under tensor or expert
parallelism in its tp or ep group's processes, the stage rewritten as the runtime rewrites
it), on random weights (the runtime's StageRunner), timed in thread CPU time (median of 25
after 5), beside the model's prediction for one rank alone (no sharing) less its waits in
collectives: the per-op model checked without the machine's scheduling. Plans without cp
and not both tp and ep (dp does not change a stage). The stages are timed one after another
in the same processes: this VM's speed moves 10-20% within a minute (the MoE example's
stage 1 timed first, then again after stage 0: F 3.90 then 4.45 ms), so a stage timed later
may read slower for that alone.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PLANS = ("examples/gpt_pp4_1f1b.plan", "examples/hybrid_pp2_dp2_tp2.plan",
         "examples/moe_pp2_ep2_zbv.plan")


CPU_LINE = re.compile(r"^CPU on .*: the ranks' processes ([0-9.]+) ms per step .* the step "
                      r"([0-9.]+) ms: the cores busy ([0-9.]+) of it$", re.M)


def measured(plan: str, out: str, warmup: int = 2) -> dict:
    """The cost file of a `pipeplan profile` run (`warmup` steps before the 4 it measures),
    with the run's CPU line (its processes' CPU seconds per step, the step's seconds, the
    cores' busy share) as "machine"."""
    run = subprocess.run([sys.executable, "-m", "pipeplan", "profile", plan, "-o", out,
                          "--steps", "4", "--warmup", str(warmup)], check=True, cwd=REPO,
                         stdout=subprocess.PIPE, text=True)
    with open(out, encoding="utf-8") as f:
        costs = json.load(f)
    found = CPU_LINE.search(run.stdout)
    if found:
        cpu, step, busy = map(float, found.groups())
        costs["machine"] = {"cpu": cpu / 1e3, "step": step / 1e3, "busy": busy}
    return costs


def host_speed() -> float:
    """This machine's host time per op now (the CPU probe's op-time blocks and fit, three
    runs, cpu_probe.probe_blocks) over the cached probe's: above 1 the VM runs slower than
    when it was probed (its speed moved 30-50% within minutes here), and every prediction
    with it. Printed beside the ratios, never applied to them."""
    from pipeplan.compiler.estimate import cpu_probe
    cached = cpu_probe.cpu_model(1)
    op_s = cpu_probe.fit_host(cpu_probe.probe_blocks(), cached.flops_per_s, cached.attention)[0]
    return op_s / cached.op_s


def median_of(runs: list[dict]) -> dict:
    """The first run's cost file with each stage's slot and CPU times the median over the
    runs (per stage and op)."""
    import statistics

    def med(values):
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None
    out = dict(runs[0])
    out["stages"] = []
    machines = [r["machine"] for r in runs if "machine" in r]
    if machines:
        out["machine"] = {k: med([m[k] for m in machines]) for k in machines[0]}
    for i, st in enumerate(runs[0]["stages"]):
        row = dict(st)
        for op in ("F", "B", "W", "BW"):
            row[op] = med([r["stages"][i].get(op) for r in runs])
        row["cpu"] = {op: med([(r["stages"][i].get("cpu") or {}).get(op) for r in runs])
                      for op in ("F", "B", "W", "BW")}
        out["stages"].append(row)
    return out


def compiled_alone(plan_path: str, ranks_alone: bool = False):
    """The plan compiled as if each rank had a core of its own: the time model's CPU time of
    a rank, its speed alone x what the plan's ranks measured beyond their fair share of the
    cores (caches, switching) plus posting its transfers as measured among them, without
    the fair share itself (waiting for a core is not CPU time). `ranks_alone`: one rank's
    speeds, nothing shared, nothing posted (a stage run by itself, `--alone`)."""
    import importlib

    from pipeplan.compiler import compile_plan
    from pipeplan.compiler.estimate import cpu_probe
    from pipeplan.dsl import load_plan

    device = importlib.import_module("pipeplan.compiler.estimate.device")
    measure, cores = cpu_probe.cpu_model, device.cores
    if ranks_alone:
        cpu_probe.cpu_model = lambda processes=1: measure(1)
    device.cores = lambda: 1 << 16  # a core for every rank: no fair share
    try:
        return compile_plan(load_plan(os.path.join(REPO, plan_path)))
    finally:
        cpu_probe.cpu_model, device.cores = measure, cores


def alone(plan_path: str) -> None:
    """Each stage by itself (`--alone`), in one process, or under tensor or expert
    parallelism in its tp or ep group's processes (gloo on 127.0.0.1, the stage rewritten
    as the runtime does)."""
    compiled = compiled_alone(plan_path, ranks_alone=True)
    mesh = compiled.plan.mesh
    if mesh.cp > 1 or (mesh.tp > 1 and mesh.ep > 1):
        raise SystemExit(f"{plan_path}: --alone runs a stage under tp or ep, not cp or both")
    world = max(mesh.tp, mesh.ep)
    print(f"{plan_path}: {'one process' if world == 1 else f'{world} processes'}"
          ", one thread each (CPU time predicted: the actions less their waits in collectives)")
    if world == 1:
        time_stages(compiled, 0, None)
        return
    import socket

    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_group_alone, args=(world, port, compiled), nprocs=world,
                       start_method="fork")


def _group_alone(rank: int, world: int, port: int, compiled) -> None:
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        time_stages(compiled, rank, dist.group.WORLD)
    finally:
        dist.destroy_process_group()


def time_stages(compiled, rank: int, group) -> None:
    """Each stage's F and its backward as the plan's schedule runs it (BW, or B then W) on
    random weights (the runtime's StageRunner; `group`: its tensor-parallel rewrite over that
    group), in thread CPU time (median of 25 after 5), beside the model's prediction for a
    rank alone less its waits; rank 0 prints."""
    import statistics
    import time

    import torch

    from pipeplan.backends.parallel import ParallelGroups, parallelize_stage
    from pipeplan.backends.runtime.stage import StageRunner

    torch.set_num_threads(1)
    predicted = op_table(compiled.estimates.simulation.costs, less_waits=True)
    split = any(a.op == "W" for row in compiled.schedule.order for a in row)
    outputs = {v.name: v for st in compiled.stages for v in st.outputs}
    plan = compiled.plan
    groups = None if group is None else ParallelGroups(
        plan.mesh, tp=group if plan.mesh.tp > 1 else None, ep=group if plan.mesh.ep > 1 else None)
    for spec, ops in zip(compiled.stages, predicted):
        module = spec.module.to_empty(device="cpu")
        torch.manual_seed(0)
        with torch.no_grad():
            for p in module.parameters():
                p.normal_(0, 0.02)
        if groups is not None:  # the runtime's own rewrite of the stage for its group
            parallelize_stage(module, plan, groups, compiled.experts, compiled.tp_rewrites)
        last = spec.index == len(compiled.stages) - 1
        runner = StageRunner(spec, module, last)
        runner.check_grads = False  # the hot path: the executor asks once per step
        rows = plan.train.global_batch // (plan.mesh.dp * plan.microbatches)
        vocab = plan.data.vocab or 2  # every token of the vocabulary: a router sees them all
        inputs = [torch.randint(0, vocab, (rows, plan.data.seq_len)) if r.source == "batch" else
                  torch.randn(outputs[r.name].shape) for r in spec.inputs]
        grads = None if last else [torch.randn(v.shape) for v in spec.outputs]
        steps = (("F", lambda: runner.forward(0, inputs)),) + (
            (("B", lambda: runner.backward_input(0, grads)),
             ("W", lambda: runner.backward_weight(0))) if split else
            (("BW", lambda: runner.backward_full(0, grads)),))
        times: dict = {op: [] for op, _ in steps}
        for i in range(30):
            for op, run in steps:
                t = time.thread_time()
                run()
                if i >= 5:
                    times[op].append(time.thread_time() - t)
        if rank == 0:
            print(f"stage {spec.index}: " + "; ".join(
                f"{op} predicted {ops[op] * 1e3:.3f} ms, measured "
                f"{statistics.median(times[op]) * 1e3:.3f} "
                f"({ops[op] / statistics.median(times[op]):.3f})" for op, _ in steps))


def step(estimates, machine) -> None:
    """The step against the run's: predicted seconds and, ranks sharing the cores, the CPU
    seconds per step the floor counts (predict.shared_floor) beside the measured ones."""
    p = estimates.prediction
    line = f"step: predicted {estimates.step_time_s * 1e3:.1f} ms"
    if p.cpu_s:
        line += f" (CPU {p.cpu_s * 1e3:.1f} ms per step over the cores: no step shorter)"
    if machine:
        line += (f"; measured {machine['step'] * 1e3:.1f} ms, CPU {machine['cpu'] * 1e3:.1f} "
                 f"ms per step (the cores busy {machine['busy']:.2f}); predicted / measured: "
                 f"step {estimates.step_time_s / machine['step']:.3f}")
        if p.cpu_s:
            line += f", CPU {p.cpu_s / machine['cpu']:.3f}"
    print(line)


def op_table(costs, less_waits: bool = False) -> list[dict]:
    """Per stage, each op's predicted seconds as the simulator charges them (StageCosts.time:
    a separate W with its calls, Costs.split); `less_waits`: less its waits in collectives."""
    from pipeplan.schedules.costs import StageCosts
    stages = len(costs.per_stage)
    table = costs.stage_table(tuple(range(stages)))
    waits = StageCosts(costs.waiting or ((0.0, 0.0, 0.0),) * stages, 0.0)
    return [{op: table.time(op, s) - (waits.time(op, s) if less_waits else 0.0)
             for op in ("F", "B", "W", "BW")} for s in range(stages)]


def main(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("plans", nargs="*", metavar="PLAN", help="plan files (default: the three "
                   "example plans; --alone: the first)")
    p.add_argument("--cached", action="store_true", help="the CPU profile ~/.cache/pipeplan "
                   "holds, not one probed afresh")
    p.add_argument("--alone", action="store_true", help="each stage timed alone, in one process")
    p.add_argument("--repeat", type=int, default=3, help="profiles per plan (default 3)")
    p.add_argument("--warmup", type=int, default=2, help="steps each profile runs before the "
                   "4 it measures (default 2; a dropless MoE's kernels need ~40, see above)")
    args = p.parse_args(argv)
    if not args.cached:  # probed afresh by the first compile or host_speed, the profiles too
        os.environ["PIPEPLAN_CACHE"] = tempfile.mkdtemp(prefix="bench_cpu_probe_")
    if args.alone:
        for plan_path in args.plans or PLANS[:1]:
            alone(plan_path)
        return 0
    from pipeplan.compiler import compile_plan
    from pipeplan.compiler.estimate.device import device_model
    from pipeplan.compiler.estimate.optime import takes_input_grads
    from pipeplan.dsl import load_plan
    repeat = args.repeat
    worst, worst_cpu = 0.0, 0.0
    for plan_path in args.plans or PLANS:
        speeds = [host_speed()]
        with tempfile.TemporaryDirectory() as tmp:
            costs = median_of([measured(plan_path, os.path.join(tmp, f"costs{k}.json"),
                                        args.warmup) for k in range(repeat)])
        speeds.append(host_speed())
        shared = compile_plan(load_plan(os.path.join(REPO, plan_path)))
        table = op_table(shared.estimates.simulation.costs)
        alone_compiled = compiled_alone(plan_path)
        # a rank's CPU time: its actions less their waits in collectives (Costs.waiting),
        # each action's resume of its core where the ranks outnumber the cores
        own = op_table(alone_compiled.estimates.simulation.costs, less_waits=True)
        model = device_model(load_plan(os.path.join(REPO, plan_path)))
        r = model.hardware.resume_s if model.sharing is not None and model.sharing.resume \
            else 0.0
        for st, ops in zip(alone_compiled.stages, own):
            ops["F"] += r
            ops["B"] += r if takes_input_grads(st) else 0.0
            ops["W"] += r
            ops["BW"] += r
        print(f"{plan_path}  ({costs.get('device')}; median of {repeat} profiles after "
              f"{args.warmup} warm-up steps each; CPU time "
              f"predicted: alone + each action's resume ({r * 1e3:.2f} ms) + posting as "
              f"measured shared)")
        print("stage  op | slot: predicted (ms)  measured (ms)  ratio | CPU time: predicted "
              "(ms)  measured (ms)  ratio")
        for st, p_ops, a_ops in zip(costs["stages"], table, own):
            cpu = st.get("cpu") or {}
            ops = ("F", "BW") if st.get("BW") is not None else ("F", "B", "W")
            for op in ops:
                p, m, pa = p_ops[op], st[op], a_ops[op]
                worst = max(worst, abs(p / m - 1))
                line = f"{st['index']:>5}  {op:<3}| {p * 1e3:>19.3f} {m * 1e3:>14.3f} {p / m:>6.3f} |"
                c = cpu.get(op)
                if c:
                    worst_cpu = max(worst_cpu, abs(pa / c - 1))
                    line += f" {pa * 1e3:>20.3f} {c * 1e3:>14.3f} {pa / c:>6.3f}"
                print(line)
        step(shared.estimates, costs.get("machine"))
        print(f"host time per op now over the probe's: {speeds[0]:.2f} before the profiles, "
              f"{speeds[1]:.2f} after (the machine's drift since it was probed)")
    print(f"largest deviation: slots (wall, shared cores) {worst:.1%}; CPU time (each rank's "
          f"own compute) {worst_cpu:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
