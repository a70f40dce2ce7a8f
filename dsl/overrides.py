"""Command-line overrides: `--set pipeline.microbatches=16`.

An override is parsed with the plan grammar itself (it is one `key = value`
line whose key is a dotted path) and spliced into the syntax tree before the
schema reads it, so it is checked exactly like the file, and its errors point
at the override with a caret like any other.
"""
from __future__ import annotations

from typing import Sequence, Union

from .ast import Span
from .errors import Diagnostic, PlanError
from .syntax import Call, Entry, Table, parse_document

# Tables whose keys are module patterns (they contain dots themselves).
PATTERN_KEYED = {("recompute",)}


def override_file(index: int) -> str:
    """The pseudo file name an override's spans point into."""
    return f"<--set {index + 1}>"


def parse_override(text: str, index: int) -> Entry:
    file = override_file(index)
    doc = parse_document(text, file) if "=" in text else None
    if doc is None or len(doc.entries) != 1:
        raise PlanError([Diagnostic(f"override '{text}' is not key=value",
                                    Span(file, 1, 1, 1, max(2, len(text) + 1)),
                                    "e.g. --set pipeline.microbatches=16")], text)
    return doc.entries[0]


def apply_overrides(doc: Table, overrides: Sequence[str]) -> tuple[Table, dict[str, str]]:
    """The document with each override applied in order, and the overrides' texts by file."""
    sources: dict[str, str] = {}
    for i, text in enumerate(overrides):
        sources[override_file(i)] = text
        try:
            entry = parse_override(text, i)
            doc = _set(doc, entry.key.split("."), entry, ())
        except PlanError as e:  # its spans point into the override's text
            raise PlanError(e.diagnostics, text, {override_file(i): text}) from None
    return doc, sources


Container = Union[Table, Call]


def _entries(node: Container) -> tuple[Entry, ...]:
    return node.entries if isinstance(node, Table) else node.kwargs


def _with_entries(node: Container, entries: tuple[Entry, ...]) -> Container:
    if isinstance(node, Table):
        return Table(entries, node.span)
    return Call(node.name, node.args, entries, node.span)


def _set(node: Container, parts: list[str], override: Entry, path: tuple[str, ...]) -> Container:
    entries = list(_entries(node))
    if path in PATTERN_KEYED:
        parts = [".".join(parts)]
    for n in range(len(parts), 0, -1):  # the longest existing key wins
        key = ".".join(parts[:n])
        hits = [i for i, e in enumerate(entries) if e.key == key]
        if not hits:
            continue
        i = hits[-1]
        old = entries[i]
        if n == len(parts):
            entries[i] = Entry(key, old.key_span, override.value)
        elif isinstance(old.value, (Table, Call)):
            entries[i] = Entry(key, old.key_span,
                               _set(old.value, parts[n:], override, path + (key,)))
        else:
            raise PlanError([Diagnostic(
                f"cannot set '{override.key}': {'.'.join(path + (key,))} is a single value, "
                f"not a block", override.key_span,
                f"set {'.'.join(path + (key,))} itself")], None)
        return _with_entries(node, tuple(entries))
    # A new key: build the blocks on the way down at the override's position.
    if path + (parts[0],) in PATTERN_KEYED and len(parts) > 1:
        parts = [parts[0], ".".join(parts[1:])]
    value = override.value
    for part in reversed(parts[1:]):
        value = Table((Entry(part, override.key_span, value),), override.key_span)
    entries.append(Entry(parts[0], _segment_span(override.key_span, path, parts[0]), value))
    return _with_entries(node, tuple(entries))


def _segment_span(key_span: Span, path: tuple[str, ...], segment: str) -> Span:
    """The span of `segment` inside the dotted override key, after the keys of `path`."""
    col = key_span.col + sum(len(k) + 1 for k in path)
    return Span(key_span.file, key_span.line, col, key_span.line, col + len(segment))
