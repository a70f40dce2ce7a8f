"""Plan -> canonical plan text (`pipeplan fmt`, and the resolved plan `pipeplan check` prints).

Sections in a fixed order, one `key = value` per line, two-space indents, a
blank line between top-level items. A key is shown when the plan wrote it or
when it differs from its default (or always, with `full=True`), so
`parse_plan(format_plan(p)) == p` and formatting canonical text gives it back
unchanged. Comments of the source survive: each one stays above the key it
preceded, or after the key on its line.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .ast import Plan
from ..schedules.kinds import KINDS_TABLE, min_microbatches
from .fields import Line, write_section
from .schema import PLAN


def format_plan(plan: Plan, full: bool = False, comments: bool = True) -> str:
    """Canonical text of `plan`; with `full`, every key including defaults."""
    written = set(plan.spans)
    filled = resolved_defaults(plan)

    def emit(key: str, value: Any, default: Any) -> bool:
        return full or key in written or value != filled.get(key, default)

    lines = write_section(plan, PLAN, "", emit)
    found = find_comments(plan.source_text) if comments else []
    return _render(lines, _attach(found, lines, plan))


def resolved_defaults(plan: Plan) -> dict[str, Any]:
    """Values the resolver fills when the plan leaves them open: not worth writing."""
    p = plan.pipeline
    if p.schedule not in KINDS_TABLE:
        return {}
    filled = {"pipeline.virtual": KINDS_TABLE[p.schedule].natural_virtual}
    if p.microbatch_size is None:
        filled["pipeline.microbatches"] = min_microbatches(p.schedule, plan.mesh.pp)
    return filled


# ------------------------------------------------------------------ comments
@dataclass(frozen=True)
class Comment:
    line: int
    text: str  # from the '#'
    trailing: bool  # code before it on the same line
    blank_after: bool = False  # a blank line follows it (kept: it separates a header)


def find_comments(text: str) -> list[Comment]:
    """Every `#` comment outside a string, with its line."""
    out = []
    lines = text.splitlines()
    for number, line in enumerate(lines, start=1):
        in_string = escaped = False
        for col, ch in enumerate(line):
            if in_string:
                if escaped:
                    escaped = False
                elif ch == "\\":
                    escaped = True
                elif ch == '"':
                    in_string = False
            elif ch == '"':
                in_string = True
            elif ch == "#":
                blank_after = number < len(lines) and not lines[number].strip()
                out.append(Comment(number, line[col:].rstrip(), bool(line[:col].strip()),
                                   blank_after))
                break
    return out


@dataclass
class _Placed:
    before: dict[int, list[str]]  # line index -> comment lines above it
    after: dict[int, str]  # line index -> trailing comment
    footer: list[str]


def _attach(comments: list[Comment], lines: list[Line], plan: Plan) -> _Placed:
    """A comment on its own line goes above the first written key after it; a comment
    after code goes after the last key that starts on or before its line."""
    placed = _Placed({}, {}, [])
    starts: list[tuple[int, int]] = []  # (source line, output line index), in output order
    for index, (key, _) in enumerate(lines):
        span = plan.spans.get(key) if key else None
        if span is not None and span.file == plan.path:
            starts.append((span.line, index))
    for c in comments:
        if c.trailing:  # after its line's key, or the key whose (multi-line) value it ends
            same = [i for line, i in starts if line <= c.line]
            if same:
                existing = placed.after.get(same[-1])
                placed.after[same[-1]] = f"{existing} {c.text}" if existing else c.text
                continue
        later = [(line, i) for line, i in starts if line > c.line]
        if later:
            placed.before.setdefault(min(later)[1], []).append(c.text)
            if c.blank_after and not c.trailing:
                placed.before[min(later)[1]].append("")
        else:
            placed.footer.append(c.text)
    return placed


def _render(lines: list[Line], placed: _Placed) -> str:
    out: list[str] = []
    for index, (_, text) in enumerate(lines):
        top_level = not text.startswith((" ", "}"))
        if top_level and out:
            out.append("")
        indent = text[: len(text) - len(text.lstrip())]
        out.extend((indent + c).rstrip() for c in placed.before.get(index, []))
        out.append(f"{text}  {placed.after[index]}" if index in placed.after else text)
    if placed.footer:
        out.extend([""] * bool(out) + placed.footer)
    return "\n".join(out) + "\n"
