"""`pipeplan schedule`: generate, compare or load a schedule; verify, simulate and render it.

    pipeplan schedule zbv --ranks 4 --microbatches 8 --format ascii
    pipeplan schedule --compare gpipe,1f1b,zbv,auto --ranks 4 --microbatches 8 --costs F=1,B=1.5,W=0.5
    pipeplan schedule --load torch_zbv.csv --format ascii   # a torch-exported CSV
    pipeplan schedule auto -p 2 -m 8 --memory-limit 2 --stage-costs '2,2,2;1,1,1;1,1,1;2,2,2'  # F,B,W per stage
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Optional

from ..schedules.costs import Costs, parse_costs
from ..schedules.errors import ScheduleError
from ..schedules.execution import analyze
from ..schedules.fifo_repair import follow_fifo
from ..schedules.gen_auto import auto_bound
from ..schedules.generate import KINDS, generate
from ..schedules.ir import Schedule
from ..schedules.render import ascii_timeline, chrome_trace_json, explain, metrics_table, svg_gantt
from ..schedules.serialize import (schedule_from_csv, schedule_from_json, schedule_to_csv, schedule_to_json)
from ..schedules.simulate import SimResult, simulate
from ..schedules.verify import verify

FORMATS = ("table", "ascii", "json", "csv", "trace", "svg")


def add_commands(subparsers) -> None:
    p = subparsers.add_parser(
        "schedule", help="generate, verify and simulate a pipeline schedule",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("kind", nargs="?", help=f"one of: {', '.join(KINDS)}")
    p.add_argument("--ranks", "-p", type=int, help="pipeline ranks")
    p.add_argument("--microbatches", "-m", type=int, help="microbatches per step")
    p.add_argument("--virtual", "-v", type=int, default=None,
                   help="stages per rank (default: the kind's own; 2 for V kinds and interleaved)")
    p.add_argument("--costs", default="F=1,B=1,W=1",
                   help="op costs for a rank's whole share of layers, e.g. F=1,B=1.5,W=0.5")
    p.add_argument("--stage-costs", metavar="F,B,W;...",
                   help="absolute F,B,W per stage, stages separated by ';' (ranks x v of them), e.g. "
                        "'2,2,2;1,1,1;1,1,1;2,2,2' for a heavy embedding and head; replaces --costs")
    p.add_argument("--latency", type=float, default=0.0, help="point-to-point latency between ranks")
    p.add_argument("--memory-limit", type=float, default=None,
                   help="activation memory per rank, in microbatches of the rank's activations")
    p.add_argument("--format", "-f", choices=FORMATS, default="table")
    p.add_argument("-o", "--output", help="write to FILE instead of stdout")
    p.add_argument("--compare", metavar="KINDS", help="comma-separated kinds to compare in one table")
    p.add_argument("--load", metavar="FILE", help="verify and simulate a schedule from .json or .csv (torch's)")
    p.set_defaults(func=run)


def run(args) -> int:
    costs = parse_costs(args.costs, args.latency)
    if args.stage_costs:
        costs = parse_stage_costs(args.stage_costs, args.latency)
    if args.load:
        schedule = load(args.load)
        try:
            schedule = adapt_to_channels(schedule)
            verify(schedule, args.memory_limit)
        except ScheduleError as e:
            raise ScheduleError(f"{args.load}: {e}") from None
        return _emit(args, [simulate(schedule, costs)])
    if args.compare:
        kinds = [k.strip() for k in args.compare.split(",") if k.strip()]
        _need_size(args)
        if args.format != "table":
            raise ScheduleError("--compare prints one table; use --format table")
        results, skipped = [], []
        for kind in kinds:
            try:
                results.append(simulate(_generate(kind, args, costs), costs, args.memory_limit))
            except ScheduleError as e:
                if kind not in KINDS:
                    raise
                skipped.append(f"{kind}: skipped, {e}")
        text = metrics_table(results) if results else ""
        return _write(args, text + "".join(line + "\n" for line in skipped))
    if not args.kind:
        raise ScheduleError(f"name a schedule kind ({', '.join(KINDS)}), or use --compare or --load")
    _need_size(args)
    return _emit(args, [simulate(_generate(args.kind, args, costs), costs, args.memory_limit)])


def _need_size(args) -> None:
    if args.ranks is None or args.microbatches is None:
        raise ScheduleError("--ranks and --microbatches are required")


def _generate(kind: str, args, costs: Costs) -> Schedule:
    if kind != "auto":
        return generate(kind, args.ranks, args.microbatches, args.virtual, costs, args.memory_limit)
    t0 = time.process_time()  # reported only: the search is bounded by counts, never by time
    schedule = generate(kind, args.ranks, args.microbatches, args.virtual, costs, args.memory_limit)
    spent = time.process_time() - t0
    bound = auto_bound(args.ranks, args.microbatches, args.virtual, costs, args.memory_limit)
    r = simulate(schedule, costs, args.memory_limit)
    bound_bubble = 1 - sum(r.busy) / (schedule.ranks * bound) if bound > 0 else 0.0
    print(f"auto: {spent:.2f} s of CPU; bubble {r.bubble:.4f}, bound over the placements searched "
          f"{bound_bubble:.4f} (makespan {r.makespan:.4g} vs {bound:.4g}, gap {r.makespan - bound:.4g})",
          file=sys.stderr)
    return schedule


def parse_stage_costs(text: str, latency: float = 0.0) -> Costs:
    """'2,2,2;1,1,1' -> Costs with per-stage (F, B, W); a one-line error for anything else."""
    table = []
    for k, part in enumerate(p for p in text.split(";") if p.strip()):
        fields = part.split(",")
        try:
            values = tuple(float(x) for x in fields)
        except ValueError:
            values = ()
        if len(values) != 3:
            raise ScheduleError(f"--stage-costs: stage {k} is {part.strip()!r}; expected three numbers F,B,W")
        table.append(values)
    if not table:
        raise ScheduleError("--stage-costs: no stages given (expected F,B,W;F,B,W;...)")
    return Costs(per_stage=tuple(table), latency=latency)


def load(path: str) -> Schedule:
    """A schedule from pipeplan JSON or torch CSV, chosen by extension (JSON if it starts with '{').

    Every problem is one line naming the file: unreadable, not UTF-8, or malformed (serialize.py
    bounds the work by the file's size)."""
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise ScheduleError(f"cannot read {path}: {e.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ScheduleError(f"{path}: not a UTF-8 text file (byte {e.start} is {raw[e.start]:#04x}); "
                            f"a schedule is pipeplan JSON or torch's CSV") from None
    try:
        if path.endswith(".json") or text.lstrip().startswith("{"):
            return schedule_from_json(text)
        return schedule_from_csv(text, name=Path(path).stem)
    except ScheduleError as e:
        raise ScheduleError(f"{path}: {e}") from None


def adapt_to_channels(schedule: Schedule) -> Schedule:
    """Orders written for tag-matched receives (torch's ZBV, DualPipeV) are reordered for in-order channels."""
    try:
        analyze(schedule)
        return schedule
    except ScheduleError as e:
        if "out of order" not in str(e):
            raise
        original = e
    try:
        adapted = follow_fifo(schedule)
        analyze(adapted)
    except ScheduleError:
        raise original from None
    moved = sum(a != b for old, new in zip(schedule.order, adapted.order) for a, b in zip(old, new))
    print(f"note: {schedule.name} matches receives by tag; {moved} actions were reordered so each "
          f"rank pair's messages arrive in order ({original})", file=sys.stderr)
    return adapted


def _emit(args, results: list[SimResult]) -> int:
    r = results[0]
    fmt = args.format
    if fmt == "table":
        text = metrics_table(results) + explain(r)
    elif fmt == "ascii":
        text = metrics_table(results) + ascii_timeline(r)
    elif fmt == "json":
        text = schedule_to_json(r.schedule, r.metrics(), indent=None) + "\n"
    elif fmt == "csv":
        text = schedule_to_csv(r.schedule)
    elif fmt == "trace":
        text = chrome_trace_json(r) + "\n"
    else:
        text = svg_gantt(r)
    return _write(args, text)


def _write(args, text: str) -> int:
    output: Optional[str] = args.output
    if output:
        try:
            Path(output).write_text(text, encoding="utf-8")
        except OSError as e:
            raise ScheduleError(f"cannot write {output}: {e.strerror}") from None
        print(f"wrote {output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0
