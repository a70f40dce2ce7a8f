"""`pipeplan check` and `pipeplan fmt`."""
from __future__ import annotations

import argparse
import sys

from ..dsl.format import format_plan
from ..dsl.load import load_plan
from ..dsl.report import check_report


def add_commands(sub: argparse._SubParsersAction) -> None:
    check = sub.add_parser("check", help="parse and check a plan; print it resolved and its mesh")
    check.add_argument("plan", help="the plan file")
    check.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override a key, e.g. --set pipeline.microbatches=16 (repeatable)")
    check.add_argument("--world-size", type=int, default=None,
                       help="the launcher's world size; the plan must use exactly this many ranks")
    check.add_argument("--no-model", action="store_true",
                       help="skip loading and tracing the model (no per-rank estimates)")
    check.set_defaults(func=run_check)

    fmt = sub.add_parser("fmt", help="print a plan in canonical form (or rewrite it with -i)")
    fmt.add_argument("plan", help="the plan file")
    fmt.add_argument("-i", "--in-place", action="store_true", help="rewrite the file")
    fmt.set_defaults(func=run_fmt)


def run_check(args: argparse.Namespace) -> int:
    from ..compiler.data import check_data

    plan = load_plan(args.plan, args.overrides, world_size=args.world_size)
    check_data(plan)  # the token file: exists, integer ids in range, long enough
    sys.stdout.write(check_report(plan))
    if args.no_model and plan.model.weights is not None:
        from ..compiler.weights import plan_catalogue

        plan_catalogue(plan)  # without the model: the weights' files and headers at least
    if not args.no_model:
        # Once the model is known: trace it on meta (no weights) and print the estimates.
        from ..backends.runtime.source import compile_checked
        from ..compiler import compile_for_check, render_summary

        compiled = compile_for_check(plan, compile_checked)
        sys.stdout.write("\n# after tracing the model (meta device, no weights)\n")
        sys.stdout.write(render_summary(compiled).rstrip("\n") + "\n")
        if plan.compile.mode == "inductor":
            from ..backends.runtime.inductor import cache_report

            sys.stdout.write("\n".join(cache_report(compiled)) + "\n")
    return 0


def run_fmt(args: argparse.Namespace) -> int:
    plan = load_plan(args.plan)
    text = format_plan(plan)
    if args.in_place:
        if text != plan.source_text:
            with open(args.plan, "w", encoding="utf-8") as f:
                f.write(text)
    else:
        sys.stdout.write(text)
    return 0

