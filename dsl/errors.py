"""Compiler-grade plan errors: `file:line:col: error: message`, the line, a caret, a hint.

One error type for every phase (parser, semantic checks, compiler checks that
need the model), so a user always sees the plan line to fix. A PlanError holds
all independent diagnostics found, not only the first.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Optional

from ..errors import PipeplanError
from .ast import Plan, Span


@dataclass(frozen=True)
class Diagnostic:
    message: str
    span: Span
    hint: Optional[str] = None

    def render(self, source_text: Optional[str] = None,
               sources: Optional[Mapping[str, str]] = None) -> str:
        """`sources` (file -> text) wins over `source_text` for the span's file."""
        s = self.span
        out = [f"{s.file}:{s.line}:{s.col}: error: {self.message}"]
        if sources and s.file in sources:
            source_text = sources[s.file]
        line = _source_line(s, source_text)
        if line is not None:
            width = max(1, (s.end_col - s.col) if s.end_line == s.line else len(line) - s.col + 1)
            out.append(f"    {line}")
            out.append("    " + " " * (s.col - 1) + "^" * width)
        if self.hint:
            out.append(f"  hint: {self.hint}")
        return "\n".join(out)


def _source_line(span: Span, source_text: Optional[str]) -> Optional[str]:
    text = source_text
    if text is None:
        try:
            with open(span.file, encoding="utf-8") as f:
                text = f.read()
        except OSError:
            return None
    lines = text.splitlines()
    if 1 <= span.line <= len(lines):
        return lines[span.line - 1].expandtabs(1)
    return None


class PlanError(PipeplanError):
    """Raised with every independent diagnostic found; the CLI prints them and exits 2."""

    def __init__(self, diagnostics: Iterable[Diagnostic], source_text: Optional[str] = None,
                 sources: Optional[Mapping[str, str]] = None):
        self.diagnostics = list(diagnostics)
        self.source_text = source_text
        self.sources = dict(sources or {})
        super().__init__(self.render())

    def render(self) -> str:
        return "\n".join(d.render(self.source_text, self.sources) for d in self.diagnostics)

    @staticmethod
    def at(plan: Plan, key: str, message: str, hint: Optional[str] = None) -> "PlanError":
        """An error pointing at the plan line of dotted `key` (e.g. "tensor.column")."""
        return PlanError([Diagnostic(message, plan.span_of(key), hint)], plan.source_text or None,
                         plan.sources)
