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
        with open(path, encoding="utf-8-sig") as f:  # a BOM is not part of the plan
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise PlanError([Diagnostic(f"cannot read plan file: {e.strerror or e}",
                                    _file_start(path))], "") from None
    return parse_plan(text, path, overrides, world_size)


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
