"""Schedules on disk: pipeplan's JSON schema, and torch.distributed.pipelining's CSV action grammar.

JSON: {"schedule", "ranks", "stages", "microbatches", "stage_to_rank",
       "order": [[{"op", "stage", "mb"}, ...] per rank], "metrics": {...}}.
CSV: one row per rank, one cell per action, torch's spelling `{stage}{F|I|W|B}{mb}`:
torch's I (input grad) is our B, torch's B (full backward) is our BW. torch rows
carry no placement; it is inferred from which rank runs each stage.

Loading is bounded by the file: nesting deeper than MAX_DEPTH is refused before
parsing, CSV numbers longer than MAX_DIGITS are refused, and the declared sizes
(ranks, stages, microbatches) must be backed by the actions the file lists
(each stage-microbatch needs an F and a backward), so nothing is allocated
beyond a constant times the file's size, and every check is linear in it.
"""
from __future__ import annotations

import json
import re
from typing import Optional

from .errors import ScheduleError
from .ir import B, BW, F, OPS, W, Action, Schedule

_TO_TORCH = {F: "F", B: "I", W: "W", BW: "B"}
_FROM_TORCH = {v: k for k, v in _TO_TORCH.items()}
_TORCH_ACTION = re.compile(r"^\s*(\d+)\s*([FIWB])\s*(\d+)\s*$")
MAX_DEPTH = 32  # the schema nests 4 deep (metrics 3); anything deeper is not a schedule
MAX_DIGITS = 12  # stage and microbatch numbers: no schedule has 10**12 of anything
_JSON_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]')


def schedule_to_dict(schedule: Schedule, metrics: Optional[dict] = None) -> dict:
    out = {
        "schedule": schedule.name, "ranks": schedule.ranks, "stages": schedule.stages,
        "microbatches": schedule.microbatches, "stage_to_rank": list(schedule.stage_to_rank),
        "order": [[{"op": a.op, "stage": a.stage, "mb": a.microbatch} for a in row]
                  for row in schedule.order],
    }
    if metrics is not None:
        out["metrics"] = metrics
    return out


def schedule_to_json(schedule: Schedule, metrics: Optional[dict] = None, indent: Optional[int] = None) -> str:
    return json.dumps(schedule_to_dict(schedule, metrics), indent=indent)


def schedule_from_json(text: str) -> Schedule:
    """Parse the JSON schema; structural problems become one-line ScheduleErrors (verify separately)."""
    _check_json_shape(text)
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError
        raise ScheduleError(f"malformed schedule JSON: {e}") from None
    return schedule_from_dict(data)


def _check_json_shape(text: str) -> None:
    """Refuse deep nesting in one linear scan, before the parser recurses (json refuses integers
    over 4300 digits itself, as a ValueError)."""
    depth = 0
    for token in _JSON_TOKEN.finditer(text):
        c = token.group()[0]
        if c in "[{":
            depth += 1
            if depth > MAX_DEPTH:
                raise ScheduleError(f"malformed schedule JSON: nested deeper than {MAX_DEPTH} levels "
                                    f"(at character {token.start()})")
        elif c in "]}":
            depth -= 1


def schedule_from_dict(data) -> Schedule:
    if not isinstance(data, dict):
        raise ScheduleError("malformed schedule JSON: the top level must be an object")
    for key in ("ranks", "stages", "microbatches", "stage_to_rank", "order"):
        if key not in data:
            raise ScheduleError(f"malformed schedule JSON: missing key {key!r}")
    for key in ("ranks", "stages", "microbatches"):
        if not _is_int(data[key]):
            raise ScheduleError(f"malformed schedule JSON: {key!r} must be an integer, got {data[key]!r}")
    s2r = data["stage_to_rank"]
    if not isinstance(s2r, list) or not all(_is_int(x) for x in s2r):
        raise ScheduleError("malformed schedule JSON: 'stage_to_rank' must be a list of integers")
    rows = data["order"]
    if not isinstance(rows, list) or not all(isinstance(r, list) for r in rows):
        raise ScheduleError("malformed schedule JSON: 'order' must be a list of lists (one per rank)")
    order = []
    for r, row in enumerate(rows):
        actions = []
        for i, item in enumerate(row):
            if (not isinstance(item, dict) or item.get("op") not in OPS
                    or not _is_int(item.get("stage")) or not _is_int(item.get("mb"))):
                raise ScheduleError(f"malformed schedule JSON: rank {r} action {i} must be "
                                    f'{{"op": F|B|W|BW, "stage": int, "mb": int}}, got {item!r}')
            actions.append(Action(item["op"], item["stage"], item["mb"]))
        order.append(tuple(actions))
    _check_sizes(data, len(s2r), rows)
    return Schedule(str(data.get("schedule", "loaded")), data["ranks"], data["stages"],
                    data["microbatches"], tuple(s2r), tuple(order))


def _check_sizes(data: dict, placed: int, rows: list) -> None:
    """The declared sizes must be backed by the listed actions (bounds every later allocation)."""
    listed = sum(len(r) for r in rows)
    if data["ranks"] != len(rows):
        raise ScheduleError(f"malformed schedule JSON: 'ranks' is {data['ranks']} but 'order' lists "
                            f"{len(rows)} ranks")
    if data["stages"] != placed:
        raise ScheduleError(f"malformed schedule JSON: 'stages' is {data['stages']} but 'stage_to_rank' "
                            f"places {placed}")
    m = data["microbatches"]
    if m > 0 and placed * m * 2 > listed:
        raise ScheduleError(f"malformed schedule JSON: 'microbatches' = {m} with {placed} stages needs at "
                            f"least {2 * placed * m} actions (an F and a backward each), the file lists "
                            f"{listed}")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def schedule_to_csv(schedule: Schedule) -> str:
    """torch's format: one line per rank, comma-separated actions like 0F0,0I0,0W0,0B0."""
    return "".join(",".join(f"{a.stage}{_TO_TORCH[a.op]}{a.microbatch}" for a in row) + "\n"
                   for row in schedule.order)


def schedule_from_csv(text: str, name: str = "csv", stage_to_rank: Optional[tuple[int, ...]] = None) -> Schedule:
    """Read torch's CSV (one rank per line); ranks, stages, microbatches and placement are inferred.

    torch's overlapped pairs `(0F7;7B3)OVERLAP_F_B` become the two actions in that
    order; its non-compute entries (REDUCE_GRAD, UNSHARD, RESHARD, SEND_*/RECV_*)
    are dropped, since pipeplan derives communication from the dependencies.
    """
    rows = text.splitlines()
    while rows and not rows[-1].strip():
        rows.pop()
    if not rows:
        raise ScheduleError("malformed schedule CSV: no rows")
    order, placement = [], {}
    for r, line in enumerate(rows):
        actions = []
        for i, cell in enumerate(c.strip() for c in line.split(",")):
            for stage, op, mb in _parse_cell(cell, r, i):
                if placement.setdefault(stage, r) != r:
                    raise ScheduleError(f"malformed schedule CSV: stage {stage} appears on ranks "
                                        f"{placement[stage]} and {r}")
                actions.append(Action(op, stage, mb))
        order.append(tuple(actions))
    if stage_to_rank is None:
        if not placement:
            raise ScheduleError("malformed schedule CSV: stage 0 has no actions")
        if max(placement) >= len(placement):  # some stage below the largest is never run
            missing = next(s for s, t in enumerate(sorted(placement)) if s != t)
            raise ScheduleError(f"malformed schedule CSV: stage {missing} has no actions (the file names "
                                f"stage {max(placement)} but only {len(placement)} distinct stages)")
        stage_to_rank = tuple(placement[s] for s in range(len(placement)))
    microbatches = sum(1 for row in order for a in row if a.op == F and a.stage == 0)
    for r, row in enumerate(order):
        for i, a in enumerate(row):
            if a.microbatch >= microbatches:
                raise ScheduleError(f"rank {r} action {i}: {a.describe()} is out of range: stage 0 runs "
                                    f"{microbatches} forwards, so microbatches are 0..{microbatches - 1}")
    return Schedule(name, len(order), len(stage_to_rank), max(microbatches, 1), tuple(stage_to_rank),
                    tuple(order))


_OVERLAP = re.compile(r"^\((.*)\)\s*OVERLAP_F_B$")
_NON_COMPUTE = re.compile(r"^\d+\s*(REDUCE_GRAD|UNSHARD|RESHARD|SEND_F|RECV_F|SEND_B|RECV_B)\s*\d*$")


def _parse_cell(cell: str, rank: int, index: int) -> list[tuple[int, str, int]]:
    if not cell or _NON_COMPUTE.match(cell):
        return []
    overlap = _OVERLAP.match(cell)
    parts = overlap.group(1).split(";") if overlap else [cell]
    out = []
    for part in parts:
        m = _TORCH_ACTION.match(part)
        if not m:
            raise ScheduleError(f"malformed schedule CSV: rank {rank} action {index} {cell!r} is "
                                f"not {{stage}}{{F|I|W|B}}{{microbatch}} (e.g. 0F0)")
        if max(len(m.group(1)), len(m.group(3))) > MAX_DIGITS:
            raise ScheduleError(f"malformed schedule CSV: rank {rank} action {index} {cell[:40]!r} has a "
                                f"number with more than {MAX_DIGITS} digits")
        out.append((int(m.group(1)), _FROM_TORCH[m.group(2)], int(m.group(3))))
    return out
