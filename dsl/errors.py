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
        message = self.message
        if len(message) > ECHO_MESSAGE:  # a message quoting a huge value
            message = (message[:ECHO_MESSAGE] + f"... ({len(message) - ECHO_MESSAGE:,} more "
                       "characters)")
        out = [f"{s.file}:{s.line}:{s.col}: error: {message}"]
        if sources and s.file in sources:
            source_text = sources[s.file]
        line = _source_line(s, source_text)
        if line is not None:
            width = max(1, (s.end_col - s.col) if s.end_line == s.line else len(line) - s.col + 1)
            line, col, width = clip_line(line, s.col, width)
            out.append(f"    {line}")
            out.append("    " + " " * (col - 1) + "^" * width)
        if self.hint:
            out.append(f"  hint: {self.hint}")
        return "\n".join(out)


ECHO_COLUMNS = 160  # at most this much of a source line is echoed under an error
ECHO_MESSAGE = 1000  # and of a message (which may quote a value)
ECHO_DIAGNOSTICS = 50  # errors printed in full; the rest are counted
ECHO_BEFORE = 40  # columns kept before the caret when the line is cut


def clip_line(line: str, col: int, width: int) -> tuple[str, int, int]:
    """(the part of `line` echoed, the caret's column in it, its width): a long line (a
    400k-element list) is cut around the span, each cut marked "...", the caret clipped."""
    if len(line) <= ECHO_COLUMNS:
        return line, col, width
    start = max(0, min(col - 1 - ECHO_BEFORE, len(line) - ECHO_COLUMNS))
    part = line[start:start + ECHO_COLUMNS]
    head = "..." if start > 0 else ""
    tail = "..." if start + ECHO_COLUMNS < len(line) else ""
    col = col - start + len(head)
    return head + part + tail, col, max(1, min(width, len(head + part) - col + 1))


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
        """Every diagnostic up to ECHO_DIAGNOSTICS, then a count of the rest."""
        shown = [d.render(self.source_text, self.sources)
                 for d in self.diagnostics[:ECHO_DIAGNOSTICS]]
        rest = len(self.diagnostics) - ECHO_DIAGNOSTICS
        if rest > 0:
            shown.append(f"... and {rest:,} more errors (the first {ECHO_DIAGNOSTICS} are shown)")
        return "\n".join(shown)

    @staticmethod
    def at(plan: Plan, key: str, message: str, hint: Optional[str] = None) -> "PlanError":
        """An error pointing at the plan line of dotted `key` (e.g. "tensor.column")."""
        return PlanError([Diagnostic(message, plan.span_of(key), hint)], plan.source_text or None,
                         plan.sources)
