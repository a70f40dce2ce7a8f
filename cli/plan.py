"""`pipeplan plan PLAN --gpus N`: search the plan space and write the best plan (planner/)."""
from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys

from ..errors import PipeplanError

# --set keys that fix an axis of the search (Candidate field, parser); any other key is an
# override of the plan itself (as `pipeplan check --set`)
AXES = {
    "mesh.pp": ("pp", int), "mesh.dp": ("dp", int), "mesh.tp": ("tp", int),
    "mesh.cp": ("cp", int), "mesh.ep": ("ep", int),
    "pipeline.schedule": ("schedule", str), "pipeline.virtual": ("virtual", int),
    "pipeline.microbatches": ("microbatches", int),
    "pipeline.microbatch_size": ("mbs", int),
    "tensor.sequence_parallel": ("sp", lambda s: {"true": True, "false": False}[s.lower()]),
    "zero": ("zero", int), "recompute": ("recompute", str),
}


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="search mesh, schedule, microbatching, recompute, ZeRO "
                       "and SP for a model on N GPUs; print the best and write a plan file")
    p.add_argument("plan", help="a plan giving the model, data, global batch and optimizer "
                   "(and a tensor section: the modules tensor parallelism may split)")
    p.add_argument("--gpus", type=int, required=True, help="GPUs (ranks) to plan for")
    p.add_argument("--device", default=None, help="a built-in device profile: a100, a100-40gb, "
                   "h100, h200, b200 (default: the plan's device; docs/compiler.md lists their sources)")
    p.add_argument("--memory", type=float, default=None,
                   help="device memory in GB (default: the device profile's capacity)")
    p.add_argument("--ranks-per-node", type=int, default=None,
                   help="GPUs per node (default: the plan's, else the profile's)")
    p.add_argument("--top", type=int, default=10, help="plans to print (K)")
    p.add_argument("-o", "--out", default=None, help="write the chosen plan here")
    p.add_argument("--pick", type=int, default=1, help="which of the top K to write (1 = best)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="fix an axis (mesh.tp=8, pipeline.schedule=1f1b, zero=1, "
                   "recompute=full, ...) or override a plan key (repeatable)")
    p.add_argument("--headroom", type=float, default=0.0,
                   help="fraction of device memory to leave free (0..1)")
    p.add_argument("--max-pp", type=int, default=None, help="deepest pipeline to consider")
    p.add_argument("--schedules", default=None,
                   help="comma-separated schedule kinds allowed (default: all)")
    p.add_argument("--no-recompute", action="store_true", help="must fit without recompute")
    p.add_argument("--max-evals", type=int, default=2000,
                   help="candidates evaluated at most (schedule generated and simulated)")
    p.add_argument("--max-auto", type=int, default=None,
                   help="of those, schedule kind auto at most (each is a schedule search; "
                   "default 12)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-verify", action="store_true",
                   help="do not compile the written plan again (as `pipeplan check` does)")
    p.set_defaults(func=run_plan)


def split_sets(sets: list[str]) -> tuple[dict, list[str]]:
    """(fixed axes {Candidate field: value}, plan overrides)."""
    fixed, overrides = {}, []
    for item in sets:
        key, sep, value = item.partition("=")
        if not sep:
            raise PipeplanError(f"--set {item!r}: expected KEY=VALUE")
        if key.strip() in AXES:
            field, parse = AXES[key.strip()]
            try:
                fixed[field] = parse(value.strip())
            except (ValueError, KeyError):
                raise PipeplanError(f"--set {item!r}: not a valid value for {key}") from None
        else:
            overrides.append(item)
    return fixed, overrides


def run_plan(args: argparse.Namespace) -> int:
    from ..compiler.estimate.device import device_model
    from ..compiler.estimate.devices import NAMES, profile
    from ..dsl.ast import DeviceSpec, MeshSpec
    from ..dsl.load import load_plan
    from ..planner.report import not_considered, plan_text, summary, table
    from ..planner.search import search
    from ..planner.space import Constraints
    from ..schedules.kinds import KINDS

    _check_args(args)
    fixed, overrides = split_sets(args.sets)
    plan = load_plan(args.plan, overrides)
    if args.device:
        if profile(args.device) is None:
            raise PipeplanError(f"--device {args.device!r}: known devices: {', '.join(NAMES)}")
        plan = dataclasses.replace(plan, device=DeviceSpec(
            name=args.device, ranks_per_node=args.ranks_per_node or plan.device.ranks_per_node
            or profile(args.device).ranks_per_node))  # written out: the plan names the node
    elif args.ranks_per_node:
        plan = dataclasses.replace(plan, device=dataclasses.replace(
            plan.device, ranks_per_node=args.ranks_per_node))
    named = profile(plan.device.name) if plan.device.name else None
    memory = args.memory * 1e9 if args.memory else named.memory_bytes if named else None
    if memory is None:
        raise PipeplanError("give --device (" + ", ".join(NAMES) + ") or --memory GB: the "
                            "capacity the plan must fit")
    kinds = tuple(k.strip() for k in args.schedules.split(",")) if args.schedules else KINDS
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise PipeplanError(f"--schedules: unknown kind {unknown[0]!r}; kinds: {', '.join(KINDS)}")
    cons = Constraints(fixed=fixed, max_pp=args.max_pp, schedules=kinds,
                       no_recompute=args.no_recompute, headroom=args.headroom)
    # the device model of N ranks (a CPU's measured model splits its cores among them)
    device = device_model(dataclasses.replace(plan, mesh=MeshSpec(pp=1, dp=args.gpus)))
    result = search(plan, args.gpus, device, memory, cons, top_k=args.top,
                    max_evals=args.max_evals, progress=not args.no_progress,
                    **({} if args.max_auto is None else {"max_auto": args.max_auto}))
    out = sys.stdout
    replaced = [k for k in ("memory_limit", "profile", "costs")
                if getattr(plan.pipeline, k) is not None]
    if replaced:
        out.write(f"note: the plan's {', '.join('pipeline.' + k for k in replaced)} "
                  f"{'is' if len(replaced) == 1 else 'are'} replaced by the search's (it "
                  "bounds memory by the device's capacity: --memory, --headroom)\n")
    out.write(summary(result))
    out.write(not_considered(result))
    if not result.top:
        out.write("no candidate fits: relax a constraint, add GPUs or memory\n")
        return 1
    written = plan.device != DeviceSpec()  # else this machine's measured model, as check's
    peak = device.flops_per_s  # in the compute precision
    out.write(table(result, peak))
    if args.pick > len(result.top):
        raise PipeplanError(f"--pick {args.pick}: only {len(result.top)} plans were found")
    if args.out:
        command = "pipeplan plan " + " ".join(shlex.quote(a) for a in sys.argv[2:]) \
            if len(sys.argv) > 2 else "pipeplan plan"
        text = plan_text(_paths_from(plan, args.out), result, args.pick - 1, command, peak,
                         written)
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)
        out.write(f"wrote {args.out} (#{args.pick})\n")
        if not args.no_verify:
            out.write(_verify(args.out, result.top[args.pick - 1].prediction, args.gpus))
    return 0


def _paths_from(plan, out: str):
    """The plan with its model, weights and data paths relative to `out`'s folder (the
    written plan may live elsewhere than the one it was planned from)."""
    import os
    where = os.path.dirname(os.path.abspath(out))

    def moved(path):
        return path if path is None or os.path.isabs(path) else \
            os.path.relpath(plan.resolve_path(path), where)

    from ..compiler.capture.loading import is_path_source
    file, colon, cls = plan.model.source.rpartition(":")
    source = plan.model.source
    if colon and is_path_source(file):
        source = f"{moved(file)}:{cls}"
    model = dataclasses.replace(plan.model, source=source, weights=moved(plan.model.weights))
    data = dataclasses.replace(plan.data, path=moved(plan.data.path))
    return dataclasses.replace(plan, model=model, data=data)


def _check_args(args: argparse.Namespace) -> None:
    for name, low in (("gpus", 1), ("top", 1), ("pick", 1), ("ranks_per_node", 1),
                      ("max_evals", 1), ("max_auto", 0)):
        if getattr(args, name) is not None and getattr(args, name) < low:
            raise PipeplanError(f"--{name.replace('_', '-')} must be at least {low}")
    if not 0 <= args.headroom < 1:
        raise PipeplanError("--headroom must be in [0, 1)")


def _verify(path: str, predicted, gpus: int) -> str:
    """The written plan read back and compiled as `pipeplan check` does; both estimates."""
    from ..backends.runtime.source import compile_checked
    from ..dsl.load import load_plan
    plan = load_plan(path, world_size=gpus)
    est = compile_checked(plan).estimates
    peak = est.peak_bytes
    return (f"checked {path}: the compiler estimates step {est.step_time_s:.6g} s, peak "
            f"{peak / 2**30:.3f} GiB (planner: {predicted.step_time_s:.6g} s, "
            f"{predicted.peak_bytes / 2**30:.3f} GiB)\n")
