"""Single values both ways: syntax node -> typed Python value, and back to text.

A reader is `read(node, key) -> value` and raises `Invalid` with a message
that names the dotted key and what was expected; the schema records it as a
diagnostic at the node's span and carries on, so every independent error is
reported at once. A writer turns the typed value back into canonical text
that reads back to an equal value.
"""
from __future__ import annotations

import difflib
import json
import math
import re
from decimal import Decimal, localcontext
from typing import Any, Callable, Mapping, Optional, Sequence

from .ast import Span
from .syntax import (BYTE_RATES, DURATIONS, FLOP_RATES, UNITS, Duration, Float, Int, Items, Name, Node, Pattern, Rate, Str, kind_of)

Read = Callable[[Node, str], Any]


class Invalid(Exception):
    """A value of the wrong type or out of range; the schema turns it into a Diagnostic."""

    def __init__(self, message: str, hint: Optional[str] = None, span: Optional[Span] = None):
        super().__init__(message)
        self.message, self.hint, self.span = message, hint, span


def closest(word: str, options: Sequence[str]) -> list[str]:
    """The option `word` was most likely meant to be (empty when none is close)."""
    return difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)


def did_you_mean(word: str, options: Sequence[str]) -> str:
    """A hint naming the closest option, or listing them all."""
    close = closest(word, options)
    if close:
        return f"did you mean '{close[0]}'?"
    return "expected one of: " + ", ".join(options)


def shown(node: Node) -> str:
    """How a wrong value is quoted back in a message: "got the name 'fast'"."""
    if isinstance(node, (Int, Float)):
        return f"got {node.value!r}"
    if isinstance(node, (Name, Pattern)):
        return f"got {kind_of(node)} '{node.value}'"
    if isinstance(node, Str):
        return f"got the string {json.dumps(node.value)}"
    if isinstance(node, Rate):
        return f"got a {'FLOP' if node.what == 'flops' else 'byte'} rate"
    return f"got {kind_of(node)}"


# ------------------------------------------------------------------- readers
def integer(lo: Optional[int] = None, hi: Optional[int] = None) -> Read:
    """An integer in [lo, hi]; `hi` is how the plan's sizes stay bounded before anything
    is allocated (see LIMITS in dsl/schema.py)."""
    def read(node: Node, key: str) -> int:
        if not isinstance(node, Int):
            raise Invalid(f"{key} must be an integer, {shown(node)}")
        if hi is not None and node.value > hi:
            raise Invalid(f"{key} must be at most {hi:,}, got {node.value:,}",
                          "pipeplan bounds every size in a plan before it allocates anything; "
                          "the bounds are listed in docs/plan-language.md")
        _in_range(node.value, key, lo, hi)
        return node.value
    return read


def number(lo: Optional[float] = None, hi: Optional[float] = None, above: Optional[float] = None
           ) -> Read:
    """A float; `above` is an exclusive lower bound."""
    def read(node: Node, key: str) -> float:
        if not isinstance(node, (Int, Float)):
            raise Invalid(f"{key} must be a number, {shown(node)}")
        value = float(node.value)
        if not math.isfinite(value):
            raise Invalid(f"{key} must be a finite number")
        if above is not None and value <= above:
            raise Invalid(f"{key} must be greater than {above:g}, got {node.value!r}")
        _in_range(value, key, lo, hi)
        return value
    return read


def _in_range(value, key: str, lo, hi) -> None:
    if lo is not None and value < lo:
        raise Invalid(f"{key} must be at least {lo}, got {value!r}")
    if hi is not None and value > hi:
        raise Invalid(f"{key} must be at most {hi}, got {value!r}")


def boolean(node: Node, key: str) -> bool:
    if isinstance(node, Name) and node.value in ("true", "false"):
        return node.value == "true"
    raise Invalid(f"{key} must be true or false, {shown(node)}")


def choice(*options: str) -> Read:
    """One of a fixed set of names (written bare, or quoted)."""
    def read(node: Node, key: str) -> str:
        if isinstance(node, (Name, Str)) and node.value in options:
            return node.value
        if isinstance(node, (Name, Str, Pattern)):
            raise Invalid(f"unknown {key.rsplit('.', 1)[-1]} '{node.value}'",
                          did_you_mean(node.value, options))
        raise Invalid(f"{key} must be one of {', '.join(options)}; {shown(node)}")
    return read


def text(node: Node, key: str) -> str:
    if isinstance(node, Str):
        return node.value
    raise Invalid(f"{key} must be a string in double quotes, {shown(node)}",
                  f'write {key.rsplit(".", 1)[-1]} = "..."')


_SEGMENT = re.compile(r"[A-Za-z0-9_*]+")


def pattern(node: Node, key: str) -> str:
    """A module path pattern: dot-separated names, `*` matches within one segment."""
    if isinstance(node, (Name, Pattern, Str)):
        check_pattern(node.value, key)
        return node.value
    raise Invalid(f"{key} must be a module pattern like layers.*.mlp, {shown(node)}")


def check_pattern(value: str, key: str) -> None:
    if not value or not all(_SEGMENT.fullmatch(s) for s in value.split(".")):
        raise Invalid(f"'{value}' is not a module pattern",
                      "write dot-separated module names, with * for any name: layers.*.mlp")


def patterns(node: Node, key: str) -> tuple[str, ...]:
    """A list of patterns (a single pattern is a one-item list)."""
    if isinstance(node, Items):
        out = []
        for i, item in enumerate(node.items):
            try:
                out.append(pattern(item, key))
            except Invalid as e:
                raise Invalid(e.message, e.hint, item.span) from None
        return tuple(out)
    return (pattern(node, key),)


_RATE_EXAMPLES = {"bytes": "450GB/s (or 400Gb/s in bits)", "flops": "989TFLOP/s"}


def rate(what: str) -> Read:
    """A positive rate of bytes ("bytes") or FLOPs ("flops") per second."""
    def read(node: Node, key: str) -> float:
        if not isinstance(node, Rate) or node.what != what:
            raise Invalid(f"{key} must be a rate like {_RATE_EXAMPLES[what]}, {shown(node)}",
                          f"write {key.rsplit('.', 1)[-1]} = {_RATE_EXAMPLES[what].split()[0]}")
        if node.per_s <= 0:
            raise Invalid(f"{key} must be above 0, got {node.per_s:g}/s")
        return node.per_s
    return read


def duration(node: Node, key: str) -> float:
    """A time of at least 0, in seconds."""
    if not isinstance(node, Duration):
        raise Invalid(f"{key} must be a duration like 10us, {shown(node)}",
                      "units: ns, us, ms, s")
    return node.seconds


def plain_value(node: Node, key: str):
    """A model constructor argument: number, string, boolean, none, or a list of them."""
    if isinstance(node, (Int, Float)):
        if isinstance(node.value, float) and not math.isfinite(node.value):
            raise Invalid(f"{key} must be a finite number")
        return node.value
    if isinstance(node, Name):
        return {"true": True, "false": False, "none": None}.get(node.value, node.value)
    if isinstance(node, (Str, Pattern)):
        return node.value
    if isinstance(node, Items):
        return tuple(plain_value(item, key) for item in node.items)
    raise Invalid(f"{key} must be a number, string, true/false, none or a list, {shown(node)}")


# ------------------------------------------------------------------- writers
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|[0-9]+[A-Za-z_][A-Za-z0-9_]*")
_PATTERN = re.compile(r"([A-Za-z_*][A-Za-z0-9_*]*)(\.[A-Za-z0-9_*]+)+|[A-Za-z_]*\*[A-Za-z0-9_*]*")
_KEYWORDS = {"true", "false", "none"}


def write_float(value: float) -> str:
    text_ = repr(float(value))
    return text_ if any(c in text_ for c in ".e") else text_ + ".0"


def write_string(value: str) -> str:
    return json.dumps(value)


def write_pattern(value: str) -> str:
    """Bare when it lexes back as a name or pattern, else quoted."""
    bare = _NAME.fullmatch(value) or _PATTERN.fullmatch(value)
    return value if bare and not _looks_numeric(value) else write_string(value)


def _looks_numeric(value: str) -> bool:
    """Would lex as a number, size or duration (rates hold a '/', never bare)."""
    return bool(re.fullmatch(r"[0-9]+([eE][+-]?[0-9]+)?(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB|ns|us|ms|s)?",
                             value))


def write_patterns(values: Sequence[str]) -> str:
    return "[" + ", ".join(write_pattern(v) for v in values) + "]"


def write_plain(value: Any) -> str:
    """Inverse of `plain_value`: strings are always quoted so `"true"` stays a string."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return write_float(value)
    if isinstance(value, str):
        return write_string(value)
    if isinstance(value, tuple):
        return "[" + ", ".join(write_plain(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} in a plan")


def write_size(n_bytes: float) -> str:
    """The largest binary unit that writes the size exactly (`40GiB`), else bytes."""
    n = int(n_bytes)
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        if n and n % UNITS[unit] == 0:
            return f"{n // UNITS[unit]}{unit}"
    return f"{n}B"


def write_bool(value: bool) -> str:
    return "true" if value else "false"


def write_scalar(value: Any) -> str:
    """Default writer for schema fields: ints, floats, booleans, bare names."""
    if isinstance(value, bool):
        return write_bool(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return write_float(value)
    if isinstance(value, str):
        bare = _NAME.fullmatch(value) and value not in _KEYWORDS and not _looks_numeric(value)
        return value if bare else write_string(value)
    if isinstance(value, tuple):
        return "[" + ", ".join(write_scalar(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} in a plan")



def _quantity(value: float, units: Mapping[str, Decimal]) -> str:
    """The shortest `<digits><unit>` that reads back as exactly `value` (first unit on ties)."""
    with localcontext() as ctx:
        ctx.prec = 80
        exact = Decimal(repr(float(value)))
        texts = [format((exact / scale).normalize(), "f") + unit for unit, scale in units.items()]
    whole = [t for t in texts if not t.startswith("0.")]  # 500ns, not 0.5us
    return min(whole or texts, key=len)


def write_rate(what: str) -> Callable[[float], str]:
    if what == "flops":
        return lambda value: _quantity(value, FLOP_RATES)
    bytes_first = {u: BYTE_RATES[u] for u in ("B/s", "KB/s", "MB/s", "GB/s", "TB/s", "KiB/s",
                                              "MiB/s", "GiB/s", "TiB/s")}
    return lambda value: _quantity(value, bytes_first)


def write_duration(seconds: float) -> str:
    return _quantity(seconds, {"us": DURATIONS["us"], "ms": DURATIONS["ms"], "s": DURATIONS["s"],
                               "ns": DURATIONS["ns"]})
