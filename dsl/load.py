"""Text -> checked Plan: parse, apply overrides, read with the schema, check.

Syntax errors stop at the first (the rest of the file cannot be trusted);
after that, schema and semantic problems are all collected and raised
together in one PlanError.
"""
from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Optional, Sequence

from .ast import Plan, Span
from .checks import find_problems, resolve
from .errors import Diagnostic, PlanError
from .fields import Reading, read_section
from .overrides import apply_overrides
from .schema import PLAN
from .syntax import Table, parse_document


def parse_plan(text: str, path: str = "<plan>", overrides: Sequence[str] = (),
               world_size: Optional[int] = None) -> Plan:
    """A checked Plan from plan text; raises PlanError listing every problem found."""
    doc = parse_document(text, path)
    sources = {path: text}
    try:
        doc, override_sources = apply_overrides(doc, overrides)
    except PlanError as e:
        raise PlanError(e.diagnostics, text, {**sources, **e.sources}) from None
    sources.update(override_sources)
    plan, reading = read_plan(doc, path)
    plan = dataclasses.replace(plan, path=path, spans=_frozen(reading.spans), source_text=text,
                               sources=_frozen(sources))
    plan = resolve(plan, parsed=True)
    diagnostics = reading.diagnostics + find_problems(plan, world_size, frozenset(reading.failed))
    if diagnostics:
        raise PlanError(_in_order(diagnostics), text, sources)
    return plan


def load_plan(path: str, overrides: Sequence[str] = (), world_size: Optional[int] = None) -> Plan:
    """Read and check the plan file at `path` (see parse_plan)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_PLAN_BYTES + 1)
    except OSError as e:
        raise PlanError([Diagnostic(f"cannot read plan file: {e.strerror or e}",
                                    _file_start(path))], "") from None
    if len(raw) > MAX_PLAN_BYTES:
        raise PlanError([Diagnostic(f"plan file is larger than {MAX_PLAN_BYTES // 2**20} MiB",
                                    _file_start(path), "a plan is a short text file; is this "
                                    "the right file?")], "")
    return parse_plan(decode_plan(raw, path), path, overrides, world_size)


MAX_PLAN_BYTES = 4 * 2**20
_UTF16_BOMS = (b"\xff\xfe", b"\xfe\xff")


def decode_plan(raw: bytes, path: str) -> str:
    """A plan file's text: UTF-8 (a leading byte-order mark is dropped). Anything else is a
    PlanError at the first byte that is not UTF-8, naming the encoding when it is UTF-16."""
    if raw.startswith(_UTF16_BOMS) or (len(raw) > 1 and b"\x00" in raw[:2]):
        raise PlanError([Diagnostic("plan file is UTF-16, not UTF-8", _file_start(path),
                                    "save the plan as UTF-8")], "")
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        before = raw[:e.start].decode("utf-8", errors="replace")
        line = before.count("\n") + 1
        col = len(before) - (before.rfind("\n") + 1) + 1
        shown = raw[:e.start].decode("utf-8", errors="replace").rsplit("\n", 1)[-1]
        rest = raw[e.start:].split(b"\n", 1)[0].decode("utf-8", errors="replace")
        span = Span(path, line, col, line, col + 1)
        raise PlanError([Diagnostic(f"plan file is not UTF-8: byte 0x{raw[e.start]:02x} "
                                    f"at line {line}, column {col} is not valid UTF-8",
                                    span, "save the plan as UTF-8")],
                        "\n" * (line - 1) + shown + rest) from None


def read_plan(doc: Table, path: str) -> tuple[Plan, Reading]:
    """The plan the schema reads from a syntax tree, with what went wrong on the way."""
    reading = Reading()
    plan = read_section(reading, doc, "", PLAN, doc.span)
    return plan, reading


def _in_order(diagnostics: list[Diagnostic]) -> list[Diagnostic]:
    """Overrides first, then by position in the file: the order a reader expects."""
    return sorted(diagnostics, key=lambda d: (not d.span.file.startswith("<--set"),
                                              d.span.file, d.span.line, d.span.col))


def _frozen(d: dict) -> MappingProxyType:
    return MappingProxyType(dict(d))


def _file_start(path: str) -> Span:
    return Span(path, 1, 1, 1, 1)
