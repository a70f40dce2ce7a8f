"""`pipeplan compile PLAN -o BUILD/`: compile a plan on the meta device and write the build."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path



def add_commands(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser("compile", help="capture, split and schedule a plan; write a build "
                       "directory (stage code, schedule.json, report.md, manifest.json)")
    c.add_argument("plan", help="the plan file")
    c.add_argument("-o", "--out", default=None, help="build directory (default: build/<plan name>)")
    c.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a plan key, e.g. --set mesh.pp=8 (repeatable)")
    c.add_argument("--tflops", type=_positive, default=None,
                   help="peak TFLOP/s per device in the plan's compute precision for the time "
                        "model; overrides the device profile's and the plan's device flops")
    c.add_argument("--link-gbps", type=_positive, default=None,
                   help="bandwidth between nodes in GB/s per device; overrides the plan's "
                        "device inter_node")
    c.set_defaults(func=run_compile)


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def run_compile(args: argparse.Namespace) -> int:
    from ..dsl import load_plan
    from ..compiler.build import write_build
    from ..backends.runtime.source import compile_checked
    from ..compiler.estimate.device import device_model
    from ..compiler.estimate.report import render_summary
    started = time.perf_counter()
    plan = load_plan(args.plan, args.overrides)
    device = device_model(plan, tflops=args.tflops, link_gbps=args.link_gbps)
    compiled = compile_checked(plan, device=device)
    out = Path(args.out) if args.out else Path("build") / Path(args.plan).stem
    write_build(compiled, out)
    lines = [f"compiled {args.plan} in {time.perf_counter() - started:.1f} s"]
    lines += ["  " + line for line in render_summary(compiled).splitlines()]
    lines.append(f"  wrote {out}/ (report.md, schedule.json, trace.json, stages/, plan.plan, "
                 "manifest.json)")
    sys.stdout.write("\n".join(lines) + "\n")
    return 0
