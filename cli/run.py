"""`pipeplan run`, `pipeplan verify`, `pipeplan profile` and `pipeplan report`.

run PLAN|BUILD/: without a rank in the environment it launches world-size
local processes (gloo) that each re-enter this command as one rank; under
torchrun (RANK, WORLD_SIZE, ... set) it is that rank. verify runs the plan
locally, then the single-process reference, and compares. profile is a short
run (warm-up + measured steps) that writes a cost file. report turns a run
directory (train.log_dir) into report.html. Everything a run writes is checked
before any process starts (backends/runtime/outputs.py). Only argparse at import:
`pipeplan --help` answers without importing torch.
"""
from __future__ import annotations

import argparse
import contextlib
import os

from ..errors import PipeplanError

RUN_HELP = """Train the plan: with no rank in the environment, start one local process per rank
(gloo) on this machine; under torchrun, be the rank torchrun started. A path on the
command line (--trace, --metrics, a --set value) is relative to the working
directory; a path in the plan file is relative to the plan file's folder. Output
folders are made, and an output that cannot be written is refused before any
process starts."""


def add_commands(sub) -> None:
    run = sub.add_parser("run", help="train a plan (local processes, or one rank under torchrun)",
                         description=RUN_HELP)
    _common(run)
    run.add_argument("--steps", type=int, default=None, help="optimizer steps (default: train.steps)")
    run.add_argument("--trace", metavar="FILE", help="write what every rank did, and the plan, as a Chrome trace "
                     "(open it in Perfetto)")
    run.add_argument("--metrics", metavar="FILE", help="write one JSON object per step: loss, lr, grad norm, tokens/s, "
                     "step time (JSONL)")
    run.add_argument("--reset-optimizer", action="store_true",
                     help="resume a checkpoint's weights (and step) with a fresh optimizer")
    run.add_argument("--resume-from", metavar="STEP_DIR",
                     help="resume from this checkpoint (a step_N folder; verified first) "
                          "instead of the newest intact one in train.checkpoint.dir")
    run.add_argument("--resume-verified", action="store_true", help=argparse.SUPPRESS)
    run.add_argument("--dump-dir", help=argparse.SUPPRESS)
    run.add_argument("--profile-out", help=argparse.SUPPRESS)  # `pipeplan profile`'s ranks
    run.add_argument("--warmup", type=int, default=1, help=argparse.SUPPRESS)
    run.set_defaults(func=_cmd_run)

    prof = sub.add_parser("profile", help="run a few steps on the plan's own processes and "
                          "write the measured per-stage costs (a cost file the plan can name)")
    _common(prof)
    prof.add_argument("-o", "--out", default="costs.json", help="the cost file (default "
                      "costs.json, relative to the working directory); name it in the plan: "
                      "pipeline { profile = \"costs.json\" }, relative to the plan file")
    prof.add_argument("--steps", type=int, default=4, help="measured steps (default 4)")
    prof.add_argument("--warmup", type=int, default=2, help="steps before them (default 2)")
    prof.set_defaults(func=_cmd_profile)

    report = sub.add_parser("report", help="write RUN_DIR/report.html: loss and step-time "
                            "curves, measured vs planned timeline, memory per rank")
    report.add_argument("run_dir", help="the folder a run wrote (its train.log_dir)")
    report.add_argument("-o", "--out", default=None, help="the HTML file (default "
                        "RUN_DIR/report.html)")
    report.set_defaults(func=_cmd_report)

    verify = sub.add_parser("verify", help="run a plan and the single-process reference; compare")
    _common(verify)
    verify.add_argument("--steps", type=int, default=3, help="optimizer steps (default 3)")
    verify.add_argument("--precision", choices=("fp64", "fp32"), default="fp64",
                        help="both sides' precision and the judge's rule: fp64 (default; every "
                             "element within rtol 1e-9, atol 1e-12) or fp32 (per-element bounds "
                             "scaled by the optimizer's reach)")
    verify.set_defaults(func=_cmd_verify)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("plan", help="a plan file, or a build directory from `pipeplan compile`")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a plan value, e.g. --set pipeline.microbatches=8")
    p.add_argument("--timeout", type=float, default=300.0, metavar="S",
                   help="seconds any rank may wait on another before the run fails (default 300)")
    p.add_argument("--heartbeat", type=float, default=None, metavar="S",
                   help="the run stops when a rank shows no sign of life (stopped, hung "
                        "outside a collective) for S seconds (default 30; under torchrun each "
                        "rank watches the next through the store)")


def _steps(args, source) -> int:
    steps = source.plan.train.steps if args.steps is None else args.steps
    if steps < 0:
        raise PipeplanError(f"--steps must be >= 0, got {steps}")
    return steps


def _rank_argv(args, steps: int, dump_dir: str | None = None,
               precision: str | None = None) -> list[str]:
    """The command each local rank runs: this run, pinned to `steps` (and `precision`)."""
    argv = ["--debug"] if getattr(args, "debug", False) else []
    argv += ["run", args.plan, "--steps", str(steps), "--timeout", str(args.timeout)]
    for kv in args.set:
        argv += ["--set", kv]
    if precision:
        argv += ["--set", f"train.precision={precision}"]
    for flag in ("trace", "metrics", "profile_out"):
        if getattr(args, flag, None):
            argv += [f"--{flag.replace('_', '-')}", os.path.abspath(getattr(args, flag))]
    argv += ["--warmup", str(getattr(args, "warmup", 1))]
    if dump_dir:
        argv += ["--dump-dir", dump_dir]
    if getattr(args, "reset_optimizer", False):
        argv += ["--reset-optimizer"]
    return argv


def precompile(plan, source):
    """Compile on the meta device as every rank will, with every check `pipeplan check`
    makes (initial weights drawable per module included: compile_for_check), so each
    refusal (a PlanError at the plan line) comes before any process starts."""
    from ..compiler import compile_for_check

    return compile_for_check(plan, source.compile)


def choose_resume(plan, resume_from: str | None = None) -> dict | None:
    """Before launch, before compiling: what each series of train.checkpoint.dir resumes
    from ({series: a verified step folder, or None to start fresh}; None without
    checkpointing): the newest intact checkpoint (a damaged newer one skipped with a
    warning) or --resume-from's, refused when damaged (backends/state/checkpoint/verify.py)."""
    from ..backends.state.checkpoint import checkpoint_folder, latest_step
    from ..backends.state.checkpoint.verify import resume_choice

    spec = plan.train.checkpoint
    if spec is None:
        if resume_from:
            raise PipeplanError("--resume-from needs train.checkpoint in the plan (where the "
                                "resumed run writes its checkpoints)")
        return None
    if resume_from and plan.sync.decoupled:
        raise PipeplanError("--resume-from: a decoupled diloco run resumes each island's own "
                            f"series under {spec.dir}; leave it out")
    # decoupled DiLoCo: each island resumes its own series (dir/island<d>), checked alike
    folders = {checkpoint_folder(plan, d) for d in range(plan.mesh.dp)}
    other = {os.path.join(spec.dir, "island0")} if not plan.sync.decoupled else {spec.dir}
    stray = [f for f in other - folders if latest_step(f) is not None]
    if stray:
        raise PipeplanError(
            f"checkpoint folder {spec.dir} holds "
            + ("one series per island (a decoupled diloco run's)" if not plan.sync.decoupled
               else "one series for the whole run (not a decoupled diloco run's)")
            + f": {stray[0]}; this plan would not resume it (nothing was started); set sync "
            "as it was, or start fresh (another train.checkpoint.dir, or move it away)")
    return {folder: resume_choice(folder, resume_from and os.path.abspath(resume_from))
            for folder in sorted(folders)}


def check_resume(plan, compiled, reset_optimizer: bool = False,
                 chosen: dict | None = None) -> None:
    """Before launch: the checkpoints chosen (choose_resume; by default the newest) load
    under this plan, or one message lists every item that will not."""
    from ..backends.state.checkpoint import check_loadable, parameter_shapes

    if chosen is None:
        chosen = choose_resume(plan)
    for found in (chosen or {}).values():
        if found is not None:
            check_loadable(found, plan, parameter_shapes(compiled)[0], reset_optimizer)


def _resume_argv(plan, chosen: dict | None) -> list[str]:
    """The launcher's decision for its ranks (one series: they do not verify again)."""
    if chosen is None or plan.sync.decoupled:
        return []
    (found,) = chosen.values()
    return (["--resume-from", found] if found else []) + ["--resume-verified"]


def _cmd_run(args) -> int:
    from ..backends.runtime.launcher import launch_local, rank_server
    from ..backends.runtime.outputs import check_outputs, run_outputs
    from ..backends.runtime.source import load_source
    from ..backends.runtime.worker import RankEnv, RunOptions, run_worker
    from ..backends.runtime.memory import check_local_memory
    from ..compiler.capture.budget import local_run_budget
    from ..compiler.data import check_data
    from . import main  # what each rank runs

    env = RankEnv.from_environ()
    source = load_source(args.plan, args.set, env.world_size if env else None)
    steps = _steps(args, source)
    check_outputs(run_outputs(source.plan, args.trace, args.metrics, args.profile_out))
    if env is None:
        # the ranks' fork server imports torch while this process compiles
        with rank_server(source.plan.mesh.world_size, source.plan.train.seed), \
                _folder_lock(source.plan):  # one run per checkpoint folder, until it ends
            chosen = choose_resume(source.plan, getattr(args, "resume_from", None))
            import torch

            local_cpu = not torch.cuda.is_available()  # every rank on this machine's memory
            with local_run_budget() if local_cpu else contextlib.nullcontext():
                compiled = precompile(source.plan, source)  # fail before spawning anything
            if local_cpu:
                check_local_memory(source.plan, compiled)
            check_data(source.plan, steps)
            check_resume(source.plan, compiled, args.reset_optimizer, chosen)
            m = source.plan.mesh
            print(f"pipeplan: {source.plan.pipeline.schedule} on pp={m.pp} dp={m.dp} cp={m.cp} "
                  f"tp={m.tp}: launching {m.world_size} local processes (gloo)", flush=True)
            argv = _rank_argv(args, steps, args.dump_dir) + _resume_argv(source.plan, chosen)
            return launch_local(main, argv, m.world_size, islands=_islands(source.plan),
                                seed=source.plan.train.seed, heartbeat_s=_heartbeat(args))
    opts = RunOptions(steps=steps, trace=args.trace, metrics=args.metrics,
                      timeout_s=args.timeout, dump_dir=args.dump_dir,
                      debug=getattr(args, "debug", False), reset_optimizer=args.reset_optimizer,
                      profile_out=args.profile_out, warmup=args.warmup,
                      resume_from=getattr(args, "resume_from", None),
                      resume_verified=getattr(args, "resume_verified", False),
                      heartbeat_s=_heartbeat(args))
    return run_worker(source.plan, source.compile, env, opts)


@contextlib.contextmanager
def _folder_lock(plan):
    """Hold the lock of train.checkpoint.dir (if any) for the launcher and its ranks
    (backends/state/checkpoint/lock.py): the ranks inherit HELD_ENV and do not lock again."""
    from ..backends.state.checkpoint.lock import HELD_ENV, FolderLock

    spec = plan.train.checkpoint
    if spec is None:
        yield
        return
    with FolderLock(spec.dir):
        os.environ[HELD_ENV] = spec.dir
        try:
            yield
        finally:
            os.environ.pop(HELD_ENV, None)


def _heartbeat(args) -> float:
    from ..backends.runtime.failure import HEARTBEAT_S

    return HEARTBEAT_S if getattr(args, "heartbeat", None) is None else args.heartbeat


def _cmd_profile(args) -> int:
    """`run` for warm-up + measured steps, rank 0 writing the cost file."""
    if args.steps < 1 or args.warmup < 0:
        raise PipeplanError(f"pipeplan profile needs --steps >= 1 and --warmup >= 0, got "
                            f"{args.steps} and {args.warmup}")
    out = os.path.abspath(args.out)
    run_args = argparse.Namespace(**vars(args))
    run_args.steps, run_args.profile_out = args.warmup + args.steps, out
    run_args.trace = run_args.metrics = run_args.dump_dir = None
    run_args.reset_optimizer = False
    return _cmd_run(run_args)


def _cmd_report(args) -> int:
    from ..backends.observe.run_dir import write_report
    from ..backends.runtime.outputs import check_outputs

    if args.out:
        check_outputs([("-o", os.path.abspath(args.out), False)])
    print(f"wrote {write_report(args.run_dir, args.out)}")
    return 0


def _islands(plan):
    """A decoupled DiLoCo run's islands (the ranks of each dp coordinate): the launcher
    drops an island that dies instead of stopping the run (backends/parallel/diloco/decoupled.py)."""
    if not plan.sync.decoupled:
        return None
    from ..dsl.layout import mesh_layout

    layout = mesh_layout(plan.mesh)
    return [[c.rank for c in layout if c.dp == d] for d in range(plan.mesh.dp)]


def _cmd_verify(args) -> int:
    from ..backends.runtime.launcher import launch_local, rank_server
    from ..backends.runtime.source import load_source
    from ..backends.runtime.worker import RankEnv
    from ..backends.verify.run import judged_plan, verify_plan
    from ..compiler.data import check_data
    from . import main  # what each rank runs

    if RankEnv.from_environ() is not None:
        raise PipeplanError("pipeplan verify launches its own local processes; "
                            "run it without torchrun")
    source = load_source(args.plan, args.set, None)
    steps = _steps(args, source)
    if source.plan.sync.diloco and args.precision != "fp64":
        raise PipeplanError("pipeplan verify judges a diloco plan against its island-by-island "
                            "reference in fp64 only (the fp32 rule bounds one optimizer, not "
                            "the outer step); run it with --precision fp64")
    if source.plan.sync.decoupled:
        raise PipeplanError("pipeplan verify judges synchronous DiLoCo (its islands sync in "
                            "lockstep); a decoupled run's syncs follow arrival order, which no "
                            "single-process reference reproduces")
    world, seed = source.plan.mesh.world_size, source.plan.train.seed
    with rank_server(world, seed):  # it imports torch while this process compiles
        precompile(judged_plan(source.plan, args.precision), source)  # fail before spawning
        check_data(source.plan, steps)
        print(f"pipeplan: verify {args.plan} in {args.precision}: launching {world} local "
              f"processes (gloo), {steps} steps", flush=True)
        return verify_plan(source.plan, steps, args.precision, lambda dump: launch_local(
            main, _rank_argv(args, steps, dump, args.precision), world, seed=seed,
            heartbeat_s=_heartbeat(args)))
