"""The `pipeplan` command: one module of this package per command (or per few commands
that share their options), the only place that imports every layer.

Each module exposes `add_commands(subparsers)` and imports only argparse at its top
(`pipeplan --help` and `--version` answer without torch); a command's
handler returns an exit code. User errors (PipeplanError, PlanError, and an
OSError on a file the user named) print their message and exit 2, never a
traceback unless --debug is given.
"""
from __future__ import annotations

import argparse
import importlib
import sys
import traceback

from .. import __version__
from ..errors import PipeplanError

# The modules whose `add_commands` contribute sub-commands, in help order.
COMMAND_MODULES = (
    "pipeplan.cli.check",  # check, fmt
    "pipeplan.cli.compile",  # compile
    "pipeplan.cli.plan",  # plan (planner/: search the plan space)
    "pipeplan.cli.schedule",  # schedule
    "pipeplan.cli.run",  # run, profile, report, verify
    "pipeplan.cli.plan_diff",  # plan-diff
    "pipeplan.cli.export",  # export
    "pipeplan.cli.checkpoint",  # checkpoint verify
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pipeplan",
        description="Compile plan files into pipeline-parallel / MoE training programs.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    parser.add_argument("--version", action="version", version=f"pipeplan {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name:  # that subpackage has no commands yet
                continue
            raise
        module.add_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except PipeplanError as e:
        if args.debug:
            traceback.print_exc()
        print(str(e), file=sys.stderr)
        return e.exit_code
    except OSError as e:  # a file the user named cannot be read or written
        if args.debug:
            traceback.print_exc()
        where = f"{e.filename}: " if e.filename else ""
        print(f"pipeplan: {where}{e.strerror or e}", file=sys.stderr)
        return PipeplanError.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
