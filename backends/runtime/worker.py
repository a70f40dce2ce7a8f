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

from ...dsl.ast import Plan
from ...errors import PipeplanError
from .agreement import check_agreement, compile_shared, plan_hash
from .collector import between_steps
from ..state.checkpoint import Checkpointer
from ..state.checkpoint.lock import HELD_ENV, FolderLock
from ..state.checkpoint.verify import resume_choice
from .failure import (ERROR_DIR_ENV, HEARTBEAT_S, STORE_KEY, Beacon, Failure, FailureWatch,
                      island_key, now, report_done, report_failure)
from .heartbeat import StoreHeartbeat
from .launcher import LOCAL_STORE_ENV
from .memory import (RankMemory, graphs_note, memory_lines, peak_rss_bytes,
                     return_large_blocks_to_os)
from ..observe.progress import Progress, describe_run
from ..observe.timings import RankTimings, check_bubble, cpu_lines, format_bubble, machine
from .topology import Coords, build_topology
from ..observe.trace import write_trace
from .trainer import PipelineTrainer
from ..verify.run import FirstStepGrads, dump_rank


@dataclass(frozen=True)
class RunOptions:
    steps: int
    trace: Optional[str] = None
    metrics: Optional[str] = None
    timeout_s: float = 300.0
    dump_dir: Optional[str] = None  # `pipeplan verify`: each rank saves losses and parameters here
    debug: bool = False
    reset_optimizer: bool = False  # resume the weights only, with a fresh optimizer
    profile_out: Optional[str] = None  # `pipeplan profile`: rank 0 writes the cost file here
    warmup: int = 1  # steps left out of the steady-state bubble and the profile
    resume_from: Optional[str] = None  # a step_N folder (--resume-from), else the newest intact
    resume_verified: bool = False  # the launcher chose and verified it (None: start fresh)
    heartbeat_s: float = HEARTBEAT_S  # under torchrun: a neighbour silent this long is stopped


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


def local_store(env: RankEnv, timeout: timedelta):
    """Under pipeplan's local launcher, the job's TCP store listening on 127.0.0.1 only
    (c10d's own binds every interface); None otherwise (torchrun's rendezvous as configured).
    The launcher also sets GLOO_SOCKET_IFNAME=lo, so gloo's listeners are loopback too."""
    if os.environ.get(LOCAL_STORE_ENV) != "1":
        return None
    import socket

    port = int(os.environ["MASTER_PORT"])
    if env.rank != 0:
        return dist.TCPStore("127.0.0.1", port, env.world_size, False, timeout)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(max(128, env.world_size))
    return dist.TCPStore("127.0.0.1", port, env.world_size, True, timeout,
                         wait_for_workers=False, master_listen_fd=listener.detach())


def rank_device(env: RankEnv) -> tuple[torch.device, str]:
    """(device, process-group backend) of this rank: `cuda:LOCAL_RANK` and NCCL when CUDA is
    available, else the CPU and gloo. NCCL refuses two ranks on one GPU, so a LOCAL_RANK
    without its own visible device is refused here, before the process group forms."""
    if not torch.cuda.is_available():
        return torch.device("cpu"), "gloo"
    count = torch.cuda.device_count()
    if env.local_rank >= count:
        raise PipeplanError(
            f"rank {env.rank} has LOCAL_RANK {env.local_rank}, but this node shows {count} CUDA "
            f"device(s): launch at most one process per GPU (--nproc-per-node {count}), or "
            "hide the GPUs (CUDA_VISIBLE_DEVICES=) to run on CPU with gloo")
    return torch.device("cuda", env.local_rank), "nccl"


def _restore(plan: Plan, trainer: PipelineTrainer, opts: "RunOptions", run_hash: str,
             split_points):
    """(Checkpointer or None, steps already done): resume from the newest checkpoint,
    resharded to this plan (backends/state/checkpoint/)."""
    spec = plan.train.checkpoint
    if spec is None:
        return None, 0
    ckpt = Checkpointer(plan, trainer, run_hash, split_points)
    found = [None]
    if dist.get_rank() == ckpt.leader:
        # the leader's view (rank 0, or under decoupled DiLoCo the island's first rank)
        # decides for every node of its group: a decoupled island resumes its own series
        found[0] = resume_choice(ckpt.folder, opts.resume_from, opts.resume_verified)
    dist.broadcast_object_list(found, src=ckpt.leader, group=ckpt.group)
    if found[0] is None:
        return ckpt, 0
    done = ckpt.load(found[0], opts.reset_optimizer, verified=True)
    trainer.resume(done)
    return ckpt, done


def _folder_lock(plan: Plan, env: RankEnv):
    """Under torchrun (no pipeplan launcher holds it), rank 0 locks train.checkpoint.dir for
    the run (backends/state/checkpoint/lock.py); None otherwise."""
    spec = plan.train.checkpoint
    if spec is None or env.rank != 0 or HELD_ENV in os.environ:
        return None
    return FolderLock(spec.dir).acquire()


def _log_dir_metrics(plan: Plan) -> Optional[str]:
    """Without --metrics, train.log_dir (when set, and train.log names jsonl) receives
    metrics.jsonl."""
    if not plan.train.log_dir or "jsonl" not in plan.train.log:
        return None
    os.makedirs(plan.train.log_dir, exist_ok=True)
    return os.path.join(plan.train.log_dir, "metrics.jsonl")


def _train(plan: Plan, trainer: PipelineTrainer, env: RankEnv, opts: RunOptions,
           where: list, run_hash: str = "", split_points=(), trackers=None
           ) -> tuple[list[float], list, int]:
    """The step loop (resuming from a checkpoint), with train.eval's held-out loss after
    every N-th step; rank 0 prints and writes metrics (and to `trackers`, opened here)."""
    where[0] = "resume from a checkpoint"
    checkpoints, first = _restore(plan, trainer, opts, run_hash, split_points)
    if env.rank == 0 and trackers is not None:
        trackers.open(first)
    metrics = opts.metrics or _log_dir_metrics(plan)
    progress = Progress(opts.steps, metrics, append=first > 0, resumed_after=first,
                        trackers=trackers) if env.rank == 0 else None
    if progress and first:
        print(f"resumed from {plan.train.checkpoint.dir} after step {first}", flush=True)
    losses, timings, spans, cpu = [], [], [], []
    evaluate = plan.train.eval
    try:
        with between_steps() as collect:  # collector.py: never inside a step
            for t in range(first, opts.steps):
                where[0] = f"step {t + 1}"
                report = trainer.step(t)
                timings.append(report.timings)
                spans.append(report.spans)
                cpu.append((report.cpu_time, report.step_time))
                losses.append(report.loss)
                held = None
                if evaluate is not None and (t + 1) % evaluate.every == 0:
                    where[0] = f"eval after step {t + 1}"
                    held = trainer.evaluate(evaluate.batches)
                if progress:
                    progress.step(report, held)
                elif report.sync_events and plan.sync.decoupled and trainer.topo.coords.pp == 0 \
                        and trainer.topo.coords.tp == 0:  # each decoupled island's first rank
                    for e in report.sync_events:
                        print(f"island {trainer.topo.coords.dp}: {e.describe()}", flush=True)
                if checkpoints and (t + 1) % plan.train.checkpoint.every == 0:
                    where[0] = f"checkpoint after step {t + 1}"
                    checkpoints.save(t + 1)
                collect()
    finally:
        if progress:
            progress.close()
    return losses, (tuple(timings), tuple(spans), tuple(cpu)), first


def _report(mine: RankTimings, memory: list, run: "_RunFacts", env: RankEnv,
            opts: RunOptions):
    """Gather every rank's timings on rank 0: the bubble line, the --trace file, the cost
    file (`pipeplan profile`) and, with train.log_dir, the run directory's files
    (`pipeplan report` reads them). Returns rank 0's BubbleCheck (None elsewhere)."""
    gathered = [None] * env.world_size if env.rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    if env.rank != 0 or not mine.steps:
        return None
    check = check_bubble(run.schedule, gathered, run.planned, run.planned_source, opts.warmup)
    print(format_bubble(check), flush=True)
    for line in cpu_lines(gathered, opts.warmup):
        print(line, flush=True)
    try:  # checked writable before launch (outputs.py); a disk that fills is said plainly
        _write_outputs(gathered, memory, run, opts, check)
    except OSError as e:
        raise PipeplanError(f"cannot write {e.filename or 'an output'}: {e.strerror or e} "
                            "(the training itself finished)") from None
    return check


def _write_outputs(gathered, memory, run: "_RunFacts", opts: RunOptions, check) -> None:
    from ..observe.run_dir import write_run_files

    if opts.trace:
        write_trace(opts.trace, gathered, check.planned, run.predicted)
        also = " and the time model's (check's)" if run.predicted is not None else ""
        print(f"trace of every rank's measured actions and the planned timeline{also}: "
              f"{opts.trace}", flush=True)
    if opts.profile_out:
        from ..observe.profiling import profile_of, write_profile

        write_profile(opts.profile_out, profile_of(run.plan, run.schedule, run.split_points,
                                                   run.specs, gathered, opts.warmup))
        print(f"cost file (per-stage F, B, W, BW, p2p latency): {opts.profile_out}", flush=True)
    if run.plan.train.log_dir:
        write_run_files(run.plan.train.log_dir, gathered, memory, check)


def _trackers(plan: Plan):
    """Rank 0's trackers beyond metrics.jsonl (train.log), or None."""
    if not any(name != "jsonl" for name in plan.train.log):
        return None
    from ..observe.trackers import Trackers

    name = os.path.splitext(os.path.basename(plan.path))[0] or "pipeplan"
    return Trackers([n for n in plan.train.log if n != "jsonl"], plan.train.log_dir, name)


@dataclass(frozen=True)
class _RunFacts:
    """What the end-of-run reports need from the compiled plan (which is freed before training)."""

    plan: Plan
    schedule: object
    split_points: tuple
    specs: list
    planned: object  # the compiler's simulation under the plan's profile, or None
    planned_source: str
    predicted: object = None  # ... under its time model (what `check` printed), or None


def _facts(plan: Plan, compiled, specs) -> _RunFacts:
    planned, source, predicted = None, "", None
    if plan.pipeline.profile and compiled.estimates is not None:
        planned = compiled.estimates.simulation
        source = f"the plan's profile {plan.pipeline.profile}"
    elif compiled.estimates is not None:
        predicted = compiled.estimates.simulation
    return _RunFacts(plan, compiled.schedule, compiled.split_points, specs, planned, source,
                     predicted)


def _finish_decoupled(plan: Plan, env: RankEnv, opts: RunOptions, trainer, losses,
                      watch, lock=None) -> int:
    """A decoupled DiLoCo run ends without collectives (an island may be lost): no
    memory and bubble report; rank 0 waits for the islands still running (decoupled.py)."""
    from ...dsl.layout import mesh_layout
    from ..parallel.diloco.decoupled import finish

    if opts.dump_dir:
        dump_rank(opts.dump_dir, env.rank, losses, trainer, None)
    finish(env.rank, env.world_size, {c.rank: c.dp for c in mesh_layout(plan.mesh)},
           opts.timeout_s)
    if env.rank == 0:
        print(f"cross-island bytes sent by rank 0: {trainer.diloco.bytes_sent:,}", flush=True)
    watch.stop()
    if lock is not None:
        lock.release()
    report_done(env.rank)
    return 0


def _store_heartbeat(plan: Plan, env: RankEnv, opts: RunOptions, where: Beacon):
    """Under torchrun (no local launcher reads the beacons): beat through the store and
    watch a neighbour (heartbeat.py). The local launcher watches its ranks itself."""
    def key_of(rank: int) -> str:
        return island_key(Coords.of(rank, plan.mesh).dp if plan.sync.decoupled else None)

    limit = 0.0 if os.environ.get(ERROR_DIR_ENV) else opts.heartbeat_s
    return StoreHeartbeat(env.rank, env.world_size, limit, lambda: where.text, key_of).start()


def run_worker(plan: Plan, compile_fn, env: RankEnv, opts: RunOptions) -> int:
    """Train on this rank; returns the exit code. Failures stop every rank (see failure.py).

    `compile_fn(plan, model, schedule=None)` returns the CompiledPlan
    (compile_plan, or a build directory's schedule pinned onto it); rank 0's
    schedule reaches the others as `schedule` (agreement.compile_shared).
    """
    started = time.perf_counter()
    where = Beacon(env.rank, "setup").start_heartbeat()  # for the launcher (failure.py)
    check_world(plan, env.world_size)
    device, backend = rank_device(env)
    cuda = device.type == "cuda"
    if plan.mesh.cp > 1 and plan.context.method == "ring":
        from ..parallel.cp.ring import check_ring_device
        check_ring_device(device.type)
    if cuda:
        torch.cuda.set_device(device)
    else:
        return_large_blocks_to_os()  # peak RSS follows what the rank holds (memory.py)
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads:
        torch.set_num_threads(int(threads))
    timeout = timedelta(seconds=opts.timeout_s)
    dist.init_process_group(backend, rank=env.rank, world_size=env.world_size, timeout=timeout,
                            store=local_store(env, timeout))
    # a decoupled DiLoCo island other than 0 fails on its own key (failure.island_key)
    failure_key = island_key(Coords.of(env.rank, plan.mesh).dp if plan.sync.decoupled else None)
    watch = FailureWatch(env.rank, keys=tuple({STORE_KEY, failure_key})).start()
    beat = _store_heartbeat(plan, env, opts, where)
    lock = None
    try:
        lock = _folder_lock(plan, env)
        topo = build_topology(plan.mesh, "cuda" if cuda else "cpu")
        where[0] = "model import and compile"
        compiled = compile_shared(plan, compile_fn)  # on meta: no weights; rank 0 decides
        where[0] = "setup"
        check_agreement(plan, compiled)  # every rank runs the same, or none starts
        trainer = PipelineTrainer(plan, compiled, topo, device)  # only this rank's shards
        param_bytes = trainer.param_bytes
        trainer.executor.on_action = where.action  # the launcher names a killed rank's action
        if trainer.prepass is not None:  # experts.balance = step: the routing pre-pass too
            trainer.prepass.executor.on_action = lambda a: where.action(f"pre-pass {a}")
        if env.rank == 0:
            print(describe_run(compiled, env.world_size), flush=True)
        run = _facts(plan, compiled, trainer.specs)
        planned_activations = (compiled.estimates.ranks[env.rank].activation_bytes
                               if compiled.estimates is not None else 0)
        run_hash = plan_hash(plan, compiled)
        del compiled  # other ranks' stages go with it
        grads = FirstStepGrads(trainer) if opts.dump_dir else None  # for `pipeplan verify`
        startup = (time.perf_counter() - started, peak_rss_bytes())
        trackers = _trackers(plan) if env.rank == 0 else None
        losses, (timings, spans, cpu), first = _train(plan, trainer, env, opts, where, run_hash,
                                                 run.split_points, trackers)
        where[0] = "finish"
        if plan.sync.decoupled:  # no collective at the end: an island may be gone
            beat.stop()  # its island is done; rank 0 waits for the rest without beating
            return _finish_decoupled(plan, env, opts, trainer, losses, watch, lock)
        memory = RankMemory(env.rank, topo.coords.pp, startup[0], param_bytes, startup[1],
                            peak_rss_bytes(), trainer.grad_bytes or 0,
                            trainer.optimizer_bytes(), planned_activations,
                            graphs_note(trainer.runners))
        every = [None] * env.world_size if env.rank == 0 else None
        dist.gather_object(memory, every, dst=0)
        if env.rank == 0:
            print(memory_lines(every), flush=True)
        check = _report(RankTimings(env.rank, topo.coords.pp, topo.coords.dp, topo.coords.tp,
                                    timings, first, spans, cpu, machine()), every, run, env,
                        opts)
        if trackers is not None:
            trackers.summary(opts.steps, check.measured if check else None, every)
            trackers.close()
        if opts.dump_dir:
            dump_rank(opts.dump_dir, env.rank, losses, trainer, grads)
        dist.barrier()
        watch.stop()
        beat.stop()
        dist.destroy_process_group()
        if lock is not None:
            lock.release()
        report_done(env.rank)
        return 0
    except BaseException as e:  # every failure stops every rank, naming this one
        watch.stop()
        beat.stop()
        if lock is not None:
            lock.release()
        detail = str(e) if isinstance(e, PipeplanError) else f"{type(e).__name__}: {e}"
        message = f"rank {env.rank} failed in {where[0]}: {detail}"
        report_failure(Failure(env.rank, message, now()), failure_key)
        if opts.debug or not isinstance(e, PipeplanError):
            traceback.print_exc()
        print(message, file=sys.stderr, flush=True)
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(1)
