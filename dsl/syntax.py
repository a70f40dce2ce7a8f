"""The plan file's syntax tree: what was written, where, before any meaning.

`parse_document(text, file)` turns plan text into a `Table` of `Entry`s whose
values are small frozen nodes (numbers, names, lists, calls, ...), each with
its `Span`. Syntax errors become a `PlanError` pointing at the offending
token with what was expected instead. The schema (dsl/schema.py) gives the
tree its meaning; overrides (dsl/overrides.py) edit it before that.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from decimal import Decimal, localcontext
from functools import lru_cache
from pathlib import Path
from typing import Optional, Union

import lark

from .ast import Span
from .errors import Diagnostic, PlanError
from .scan import check_bounds


# --------------------------------------------------------------------- nodes
@dataclass(frozen=True)
class Int:
    value: int
    span: Span


@dataclass(frozen=True)
class Float:
    value: float
    span: Span


@dataclass(frozen=True)
class Size:
    """`40GiB`: a byte count written with a unit."""

    bytes: int
    span: Span


@dataclass(frozen=True)
class Rate:
    """`450GB/s`, `400Gb/s`, `989TFLOP/s`: an amount per second of bytes or FLOPs."""

    per_s: float
    what: str  # "bytes" | "flops"
    span: Span


@dataclass(frozen=True)
class Duration:
    """`10us`, `1.5ms`: a time, in seconds."""

    seconds: float
    span: Span


@dataclass(frozen=True)
class Str:
    value: str
    span: Span


@dataclass(frozen=True)
class Name:
    """A bare identifier: `1f1b`, `adamw`, `true`, `layers`."""

    value: str
    span: Span


@dataclass(frozen=True)
class Pattern:
    """A module path, possibly with `*` globs: `layers.*.mlp`."""

    value: str
    span: Span


@dataclass(frozen=True)
class Items:
    items: tuple["Node", ...]
    span: Span


@dataclass(frozen=True)
class Entry:
    """`key = value` (or `key { ... }`, whose value is a Table)."""

    key: str
    key_span: Span
    value: "Node"


@dataclass(frozen=True)
class Table:
    entries: tuple[Entry, ...]
    span: Span


@dataclass(frozen=True)
class Call:
    """`adamw(lr = 3e-3)`, `auto(flops)`: positional then keyword arguments."""

    name: str
    args: tuple["Node", ...]
    kwargs: tuple[Entry, ...]
    span: Span


@dataclass(frozen=True)
class RangeNode:
    """`layers[0:6]`."""

    prefix: str
    start: int
    stop: int
    span: Span


@dataclass(frozen=True)
class Shaped:
    """`int64[batch, seq]`: a dtype with a shape."""

    dtype: str
    dims: tuple[Union[int, str], ...]
    span: Span


Node = Union[Int, Float, Size, Rate, Duration, Str, Name, Pattern, Items, Table, Call, RangeNode,
             Shaped]

# Human names of node kinds, for "expected X, got Y" messages.
NODE_KINDS = {
    Int: "an integer", Float: "a number", Size: "a size", Rate: "a rate",
    Duration: "a duration", Str: "a string", Name: "a name",
    Pattern: "a module pattern", Items: "a list", Table: "a block", Call: "a call",
    RangeNode: "a layer range", Shaped: "a typed shape",
}

MAX_INT_DIGITS = 30  # far above any plan size; keeps the literal's conversion cheap
UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
         "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
# Rates: bytes per second (decimal, binary, and bits: `400Gb/s` is 50GB/s) and FLOP/s.
BYTE_RATES = {**{f"{u}/s": Decimal(n) for u, n in UNITS.items()},
              **{f"{p}b/s": Decimal(10 ** e) / 8 for p, e in (("K", 3), ("M", 6), ("G", 9),
                                                               ("T", 12))}}
FLOP_RATES = {f"{p}FLOP/s": Decimal(10 ** e) for p, e in (("", 0), ("K", 3), ("M", 6),
                                                         ("G", 9), ("T", 12), ("P", 15))}
DURATIONS = {"s": Decimal(1), "ms": Decimal("1e-3"), "us": Decimal("1e-6"),
             "ns": Decimal("1e-9")}


def scaled(digits: str, unit: Decimal) -> float:
    """`digits` × `unit` rounded once, so the shortest text of a float reads back exactly."""
    with localcontext() as ctx:
        ctx.prec = 80
        return float(Decimal(digits) * unit)


def split_quantity(text: str) -> tuple[str, str]:
    """`450GB/s` -> ("450", "GB/s")."""
    end = len(text) - len(text.lstrip("0123456789."))
    return text[:end], text[end:]


def kind_of(node: Node) -> str:
    return NODE_KINDS[type(node)]


# -------------------------------------------------------------------- parser
@lru_cache(maxsize=None)
def _parser() -> lark.Lark:
    grammar = (Path(__file__).with_name("plan.lark")).read_text(encoding="utf-8")
    return lark.Lark(grammar, parser="lalr", propagate_positions=True, maybe_placeholders=True)


def _span(file: str, meta) -> Span:
    return Span(file, meta.line, meta.column, meta.end_line, meta.end_column)


class _Bad(Exception):
    """A token that lexes but means nothing (a bad escape, an infinite number)."""

    def __init__(self, message: str, span: Span, hint: Optional[str] = None):
        super().__init__(message)
        self.diagnostic = Diagnostic(message, span, hint)


@lark.v_args(meta=True, inline=True)
class _Build(lark.Transformer):
    """Lark parse tree -> syntax nodes with spans."""

    def __init__(self, file: str):
        super().__init__()
        self.file = file

    def _s(self, meta) -> Span:
        return _span(self.file, meta)

    def _tok(self, tok: lark.Token) -> Span:
        return Span(self.file, tok.line, tok.column, tok.end_line, tok.end_column)

    def start(self, meta, *entries):
        if not entries:
            return Table((), Span(self.file, 1, 1, 1, 1))
        return Table(tuple(entries), self._s(meta))

    def key(self, meta, tok):
        """(key text, span); a quoted key is any text (recompute patterns like "0.mlp")."""
        return (self.string(meta, tok).value if tok.type == "STRING" else str(tok)), self._tok(tok)

    def assign(self, meta, key, value):
        return Entry(key[0], key[1], value)

    def block(self, meta, key, *entries):
        return Entry(key[0], key[1], Table(tuple(entries), self._s(meta)))

    def integer(self, meta, tok):
        return Int(self._int(tok, self._s(meta)), self._s(meta))

    @staticmethod
    def _int(tok, span: Span) -> int:
        """An integer literal; one with more digits than any plan size could need is refused
        here (Python would not even convert 5000 digits)."""
        if len(str(tok).lstrip("-")) > MAX_INT_DIGITS:
            raise _Bad(f"integer {str(tok)[:12]}... ({len(str(tok).lstrip('-'))} digits) is too "
                       "large", span, f"plan integers have at most {MAX_INT_DIGITS} digits")
        return int(tok)

    def real(self, meta, tok):
        value = float(tok)
        if value in (float("inf"), float("-inf")):
            raise _Bad(f"number {tok} is too large", self._s(meta), "write a finite number")
        return Float(value, self._s(meta))

    def size(self, meta, tok):
        text = str(tok)
        digits = text.rstrip("BKMGTi")
        unit = text[len(digits):]
        value = float(digits) * UNITS[unit]
        if value == float("inf"):
            raise _Bad(f"size {text[:12]}... is too large", self._s(meta), "write a finite size")
        return Size(int(value), self._s(meta))

    def rate(self, meta, tok):
        digits, unit = split_quantity(str(tok))
        if unit in FLOP_RATES:
            return Rate(scaled(digits, FLOP_RATES[unit]), "flops", self._s(meta))
        return Rate(scaled(digits, BYTE_RATES[unit]), "bytes", self._s(meta))

    def duration(self, meta, tok):
        digits, unit = split_quantity(str(tok))
        return Duration(scaled(digits, DURATIONS[unit]), self._s(meta))

    def string(self, meta, tok):
        try:
            return Str(json.loads(str(tok)), self._s(meta))
        except ValueError:
            raise _Bad("invalid escape in string", self._s(meta),
                       'use \\" \\\\ \\n \\t or \\uXXXX escapes') from None

    def name(self, meta, tok):
        return Name(str(tok), self._s(meta))

    def pattern(self, meta, tok):
        return Pattern(str(tok), self._s(meta))

    def items(self, meta, *values):
        return Items(tuple(v for v in values if v is not None), self._s(meta))

    def table(self, meta, *entries):
        return Table(tuple(entries), self._s(meta))

    def keyword(self, meta, name, value):
        return Entry(str(name), self._tok(name), value)

    def call(self, meta, name, *args):
        args = [a for a in args if a is not None]
        positional = tuple(a for a in args if not isinstance(a, Entry))
        keywords = tuple(a for a in args if isinstance(a, Entry))
        first_kw = next((i for i, a in enumerate(args) if isinstance(a, Entry)), len(args))
        if any(not isinstance(a, Entry) for a in args[first_kw:]):
            bad = next(a for a in args[first_kw:] if not isinstance(a, Entry))
            raise _Bad("positional argument after a keyword argument", bad.span,
                       "put positional arguments first, or name this one")
        return Call(str(name), positional, keywords, self._s(meta))

    def range(self, meta, prefix, start, stop):
        span = self._s(meta)
        return RangeNode(str(prefix), self._int(start, span), self._int(stop, span), span)

    def dim(self, meta, tok):
        return self._int(tok, self._s(meta)) if tok.type == "INT" else str(tok)

    def shaped(self, meta, dtype, *dims):
        return Shaped(str(dtype), tuple(dims), self._s(meta))


# Human names of terminals for "expected ..." hints.
_TERMINALS = {
    "NAME": "a name", "PATTERN": "a module pattern", "INT": "an integer",
    "FLOAT": "a number", "SIZE": "a size", "RATE": "a rate", "DURATION": "a duration",
    "STRING": "a string",
    "EQUAL": "'='", "LBRACE": "'{'", "RBRACE": "'}'", "LSQB": "'['", "RSQB": "']'",
    "LPAR": "'('", "RPAR": "')'", "COMMA": "','", "COLON": "':'", "SEMICOLON": "';'",
    "$END": "end of file",
}


def _expected(names) -> str:
    shown = sorted({_TERMINALS.get(n, n) for n in names})
    return "expected " + (", ".join(shown[:-1]) + " or " + shown[-1] if len(shown) > 1 else shown[0])


def _acceptable(e: lark.exceptions.UnexpectedToken) -> set:
    """The tokens that could really come next (LALR's own list over-approximates)."""
    try:
        return e.interactive_parser.accepts() or e.expected
    except Exception:  # the exact set is a nicety; fall back to LALR's list
        return e.expected


def _syntax_diagnostic(e: lark.exceptions.UnexpectedInput, file: str, text: str) -> Diagnostic:
    if isinstance(e, lark.exceptions.UnexpectedCharacters):
        char = text[e.pos_in_stream] if e.pos_in_stream < len(text) else ""
        span = Span(file, e.line, e.column, e.line, e.column + 1)
        hint = None
        if char == '"':
            hint = "close the string on the same line"
        elif e.allowed:
            hint = _expected(e.allowed)
        return Diagnostic(f"unexpected character {char!r}", span, hint)
    if isinstance(e, lark.exceptions.UnexpectedToken):
        tok = e.token
        if tok.type == "$END":
            lines = text.splitlines() or [""]
            span = Span(file, len(lines), len(lines[-1]) + 1, len(lines), len(lines[-1]) + 2)
            return Diagnostic("unexpected end of file", span,
                              _expected(_acceptable(e)) + " (is a '}' or ']' missing?)")
        span = Span(file, tok.line, tok.column, tok.end_line or tok.line,
                    tok.end_column or tok.column + 1)
        return Diagnostic(f"unexpected {str(tok)!r}", span, _expected(_acceptable(e)))
    line, col = getattr(e, "line", 1) or 1, getattr(e, "column", 1) or 1
    return Diagnostic("syntax error", Span(file, line, col, line, col + 1))


def parse_document(text: str, file: str = "<plan>") -> Table:
    """Parse plan text into its syntax tree; raise PlanError on a syntax error or a list or
    plan over its bound (dsl/scan.py, checked before the parser runs)."""
    check_bounds(text, file)
    try:
        tree = _parser().parse(text)
        return _Build(file).transform(tree)
    except lark.exceptions.UnexpectedInput as e:
        raise PlanError([_syntax_diagnostic(e, file, text)], text) from None
    except lark.exceptions.VisitError as e:
        if isinstance(e.orig_exc, _Bad):
            raise PlanError([e.orig_exc.diagnostic], text) from None
        if isinstance(e.orig_exc, RecursionError):
            raise PlanError([Diagnostic("the plan is nested too deeply", Span(file, 1, 1, 1, 2))],
                            text) from None
        raise
    except RecursionError:
        raise PlanError([Diagnostic("the plan is nested too deeply", Span(file, 1, 1, 1, 2))],
                        text) from None
