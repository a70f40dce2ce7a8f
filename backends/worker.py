"""One rank of a run: join the process group, build this rank's stages, train, report.

Entered when the environment names a rank (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT): set by torchrun, or by pipeplan's local launcher, which starts
the same command once per rank. NCCL when CUDA is available, gloo otherwise.
"""
from __future__ import annotations

import os
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from ..dsl.ast import Plan
from ..errors import PipeplanError
from .agreement import check_agreement, compile_shared, plan_hash
from .checkpoint import Checkpointer, latest_step
from .failure import Beacon, Failure, FailureWatch, now, report_failure
from .layout import with_required_leaves
from .memory import RankMemory, memory_lines, peak_rss_bytes
from .model import own_stages
from .observe import Progress, RankTimings, bubble_report, describe_run, write_trace
from .topology import build_topology
from .trainer import PipelineTrainer
from .verify import FirstStepGrads, dump_rank


@dataclass(frozen=True)
class RunOptions:
    steps: int
    trace: Optional[str] = None
    metrics: Optional[str] = None
    timeout_s: float = 300.0
    dump_dir: Optional[str] = None  # `pipeplan verify`: each rank saves losses and parameters here
    debug: bool = False
    reset_optimizer: bool = False  # resume the weights only, with a fresh optimizer


@dataclass(frozen=True)
class RankEnv:
    rank: int
    world_size: int
    local_rank: int

    @staticmethod
    def from_environ() -> Optional["RankEnv"]:
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            return None
        return RankEnv(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
                       int(os.environ.get("LOCAL_RANK", os.environ["RANK"])))


def check_world(plan: Plan, world_size: int) -> None:
    if plan.mesh.world_size != world_size:
        m = plan.mesh
        raise PipeplanError(
            f"the plan needs pp*dp*tp = {m.pp}*{m.dp}*{m.tp} = {m.world_size} processes, "
            if m.cp == 1 else
            f"the plan needs pp*dp*cp*tp = {m.pp}*{m.dp}*{m.cp}*{m.tp} = {m.world_size} processes, "
            f"but WORLD_SIZE is {world_size}; launch {m.world_size} processes in total "
            f"(e.g. torchrun --nproc-per-node ...) or change the plan's mesh")


def _restore(plan: Plan, trainer: PipelineTrainer, opts: "RunOptions", run_hash: str,
             split_points):
    """(Checkpointer or None, steps already done): resume from the newest checkpoint,
    resharded to this plan (backends/checkpoint/)."""
    spec = plan.train.checkpoint
    if spec is None:
        return None, 0
    ckpt = Checkpointer(plan, trainer, run_hash, split_points)
    found = [latest_step(spec.dir) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(found, src=0)  # rank 0's view decides for every node
    if found[0] is None:
        return ckpt, 0
    done = ckpt.load(found[0], opts.reset_optimizer)
    trainer.resume(done)
    return ckpt, done


def _log_dir_metrics(plan: Plan) -> Optional[str]:
    """Without --metrics, train.log_dir (when set) receives metrics.jsonl."""
    if not plan.train.log_dir:
        return None
    os.makedirs(plan.train.log_dir, exist_ok=True)
    return os.path.join(plan.train.log_dir, "metrics.jsonl")


def _train(plan: Plan, trainer: PipelineTrainer, env: RankEnv, opts: RunOptions,
           where: list, run_hash: str = "", split_points=()) -> tuple[list[float], list, int]:
    """The step loop (resuming from a checkpoint); rank 0 prints and writes metrics."""
    where[0] = "resume from a checkpoint"
    checkpoints, first = _restore(plan, trainer, opts, run_hash, split_points)
    metrics = opts.metrics or _log_dir_metrics(plan)
    progress = Progress(opts.steps, metrics, append=first > 0, resumed_after=first) \
        if env.rank == 0 else None
    if progress and first:
        print(f"resumed from {plan.train.checkpoint.dir} after step {first}", flush=True)
    losses, timings = [], []
    try:
        for t in range(first, opts.steps):
            where[0] = f"step {t + 1}"
            report = trainer.step(t)
            timings.append(report.timings)
            losses.append(report.loss)
            if progress:
                progress.step(report)
            if checkpoints and (t + 1) % plan.train.checkpoint.every == 0:
                where[0] = f"checkpoint after step {t + 1}"
                checkpoints.save(t + 1)
    finally:
        if progress:
            progress.close()
    return losses, timings, first


def _report(mine: RankTimings, schedule, env: RankEnv, opts: RunOptions) -> None:
    """Gather every rank's timings on rank 0: the bubble line and the --trace file."""
    gathered = [None] * env.world_size if env.rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    if env.rank != 0:
        return
    if mine.steps:
        print(bubble_report(schedule, gathered), flush=True)
    if opts.trace:
        write_trace(opts.trace, gathered)
        print(f"trace of every rank's measured actions: {opts.trace}", flush=True)


def run_worker(plan: Plan, compile_fn, env: RankEnv, opts: RunOptions) -> int:
    """Train on this rank; returns the exit code. Failures stop every rank (see failure.py).

    `compile_fn(plan, model)` returns the CompiledPlan (compile_plan, or a
    build directory's schedule pinned onto it).
    """
    started = time.perf_counter()
    check_world(plan, env.world_size)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", env.local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads:
        torch.set_num_threads(int(threads))
    dist.init_process_group("nccl" if cuda else "gloo", rank=env.rank,
                            world_size=env.world_size, timeout=timedelta(seconds=opts.timeout_s))
    watch = FailureWatch(env.rank).start()
    where = Beacon(env.rank, "setup")  # what this rank is doing, for the failure message
    try:
        topo = build_topology(plan.mesh, "cuda" if cuda else "cpu")
        leaves = with_required_leaves(plan)
        compiled = compile_shared(leaves, compile_fn)  # on meta: no weights; rank 0 decides
        check_agreement(leaves, compiled)  # every rank runs the same, or none starts
        param_bytes = own_stages(plan, compiled, topo.coords.pp, device)  # only this rank's
        trainer = PipelineTrainer(plan, compiled, topo, device)
        trainer.executor.on_action = where.action  # the launcher names a killed rank's action
        if env.rank == 0:
            print(describe_run(compiled, env.world_size), flush=True)
        schedule = compiled.schedule
        run_hash, split_points = plan_hash(leaves, compiled), compiled.split_points
        del compiled  # other ranks' stages go with it
        grads = FirstStepGrads(trainer) if opts.dump_dir else None  # for `pipeplan verify`
        startup = (time.perf_counter() - started, peak_rss_bytes())
        losses, timings, first = _train(plan, trainer, env, opts, where, run_hash,
                                       split_points)
        where[0] = "finish"
        memory = RankMemory(env.rank, topo.coords.pp, startup[0], param_bytes, startup[1],
                            peak_rss_bytes())
        every = [None] * env.world_size if env.rank == 0 else None
        dist.gather_object(memory, every, dst=0)
        if env.rank == 0:
            print(memory_lines(every), flush=True)
        _report(RankTimings(env.rank, topo.coords.pp, topo.coords.dp, topo.coords.tp,
                            tuple(timings), first), schedule, env, opts)
        if opts.dump_dir:
            dump_rank(opts.dump_dir, env.rank, losses, trainer, grads)
        dist.barrier()
        watch.stop()
        dist.destroy_process_group()
        return 0
    except BaseException as e:  # every failure stops every rank, naming this one
        watch.stop()
        detail = str(e) if isinstance(e, PipeplanError) else f"{type(e).__name__}: {e}"
        message = f"rank {env.rank} failed in {where[0]}: {detail}"
        report_failure(Failure(env.rank, message, now()))
        if opts.debug or not isinstance(e, PipeplanError):
            traceback.print_exc()
        print(message, file=sys.stderr, flush=True)
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(1)
