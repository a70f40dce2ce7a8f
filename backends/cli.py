"""`pipeplan run` and `pipeplan verify`.

run PLAN|BUILD/: without a rank in the environment it launches world-size
local processes (gloo) that each re-enter this command as one rank; under
torchrun (RANK, WORLD_SIZE, ... set) it is that rank. verify runs the plan
locally, then the single-process reference, and compares.
"""
from __future__ import annotations

import argparse
import os
import tempfile

import torch

from ..errors import PipeplanError
from .data_check import check_data
from .source import RunSource, load_source
from .worker import RankEnv, RunOptions, run_worker


def add_commands(sub) -> None:
    run = sub.add_parser("run", help="train a plan (local processes, or one rank under torchrun)",
                         description=__doc__.split("\n\n")[1])
    _common(run)
    run.add_argument("--steps", type=int, default=None, help="optimizer steps (default: train.steps)")
    run.add_argument("--trace", metavar="FILE", help="write every rank's measured actions as a Chrome trace")
    run.add_argument("--metrics", metavar="FILE", help="write one JSON object per step (JSONL)")
    run.add_argument("--dump-dir", help=argparse.SUPPRESS)
    run.set_defaults(func=_cmd_run)

    verify = sub.add_parser("verify", help="run a plan and the single-process reference; compare")
    _common(verify)
    verify.add_argument("--steps", type=int, default=3, help="optimizer steps (default 3)")
    verify.add_argument("--rtol", type=float, default=1e-5)
    verify.add_argument("--atol", type=float, default=1e-6)
    verify.set_defaults(func=_cmd_verify)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("plan", help="a plan file, or a build directory from `pipeplan compile`")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a plan value, e.g. --set pipeline.microbatches=8")
    p.add_argument("--timeout", type=float, default=300.0, metavar="S",
                   help="seconds any rank may wait on another before the run fails (default 300)")


def _steps(args, source: RunSource) -> int:
    steps = source.plan.train.steps if args.steps is None else args.steps
    if steps < 0:
        raise PipeplanError(f"--steps must be >= 0, got {steps}")
    return steps


def _rank_argv(args, steps: int, dump_dir: str | None = None) -> list[str]:
    """The command each local rank runs: this run, pinned to `steps`."""
    argv = ["--debug"] if getattr(args, "debug", False) else []
    argv += ["run", args.plan, "--steps", str(steps), "--timeout", str(args.timeout)]
    for kv in args.set:
        argv += ["--set", kv]
    for flag in ("trace", "metrics"):
        if getattr(args, flag, None):
            argv += [f"--{flag}", os.path.abspath(getattr(args, flag))]
    if dump_dir:
        argv += ["--dump-dir", dump_dir]
    return argv


def _cmd_run(args) -> int:
    from .launcher import launch_local
    from .trainer import check_supported

    env = RankEnv.from_environ()
    source = load_source(args.plan, args.set, env.world_size if env else None)
    steps = _steps(args, source)
    if env is None:
        check_supported(source.plan)  # fail before spawning anything
        check_data(source.plan, steps)
        m = source.plan.mesh
        print(f"pipeplan: {source.plan.pipeline.schedule} on pp={m.pp} dp={m.dp} tp={m.tp}: "
              f"launching {m.world_size} local processes (gloo)", flush=True)
        return launch_local(_rank_argv(args, steps, args.dump_dir), m.world_size)
    opts = RunOptions(steps=steps, trace=args.trace, metrics=args.metrics,
                      timeout_s=args.timeout, dump_dir=args.dump_dir,
                      debug=getattr(args, "debug", False))
    return run_worker(source.plan, source.compile, env, opts)


def _cmd_verify(args) -> int:
    from .compare import compare, noise_level
    from .launcher import launch_local
    from .reference import train_reference
    from .trainer import check_supported

    if RankEnv.from_environ() is not None:
        raise PipeplanError("pipeplan verify launches its own local processes; "
                            "run it without torchrun")
    source = load_source(args.plan, args.set, None)
    check_supported(source.plan)
    steps = _steps(args, source)
    check_data(source.plan, steps)
    with tempfile.TemporaryDirectory(prefix="pipeplan-verify-") as dump:
        code = launch_local(_rank_argv(args, steps, dump), source.plan.mesh.world_size)
        if code:
            return code
        dumps = [torch.load(os.path.join(dump, f), weights_only=True)
                 for f in sorted(os.listdir(dump)) if f.endswith(".pt")]
    print(f"pipeplan: single-process reference, {steps} steps", flush=True)
    ref = train_reference(source.plan, steps)
    adam = source.plan.train.optimizer.name == "adamw"
    result = compare(ref.losses, ref.params, [d["losses"] for d in dumps],
                     [d["params"] for d in dumps], args.rtol, args.atol,
                     noise_params=frozenset(noise_level(ref.grad_max)) if adam else frozenset(),
                     noise_bound=source.plan.train.optimizer.lr * steps * 1.01)
    for step, (r, p) in enumerate(zip(ref.losses, dumps[0]["losses"])):
        print(f"step {step + 1}: loss {p:.6f}  reference {r:.6f}  diff {abs(p - r):.2e}")
    print(result.render(args.rtol, args.atol))
    return 0 if result.within else 1
