"""Declaring a section's keys once, and reading and writing it from that declaration.

A `Section` is a tuple of `Field`s (key, reader, writer). `read_entries` reads
syntax entries against it (unknown and duplicate keys, type errors and missing
required keys become diagnostics, and reading carries on), `write_section`
writes the dataclass back as canonical lines, and `read_call` / `write_call`
do the same for call-valued keys like `adamw(lr = 3e-3)`. The plan's own
sections are declared in dsl/schema.py.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

from . import ast as A
from .ast import Span
from .errors import Diagnostic
from .syntax import Call, Entry, Items, Name, Node, Table
from .values import Invalid, closest, did_you_mean, shown, write_scalar


# ------------------------------------------------------------ reading context
class Reading:
    """Diagnostics, spans and failed keys collected while reading one plan."""

    def __init__(self) -> None:
        self.diagnostics: list[Diagnostic] = []
        self.spans: dict[str, Span] = {}
        self.failed: set[str] = set()

    def error(self, span: Span, message: str, hint: Optional[str], key: str) -> None:
        self.diagnostics.append(Diagnostic(message, span, hint))
        self.failed.add(key)


# A writer decides, per key, whether a value is shown: `emit(key, value, default)`.
Emit = Callable[[str, Any, Any], bool]


@dataclass(frozen=True)
class Field:
    """One key of a section; `key` is also the dataclass attribute it fills.

    `read(node, key)` / `write(value)` convert a plain value. With `nested`, the
    reader and writer get the context too: `read(reading, node, key)` and
    `write(value, key, emit)` (calls, free-form tables; a list of (key, line)
    is written as a block body). With `section`, the value is a block read and
    written by that section.
    """

    key: str
    read: Optional[Callable] = None
    write: Callable = write_scalar
    nested: bool = False
    section: Optional["Section"] = None
    shorthand: Optional[str] = None  # with `section`: the key a plain value fills (device = a100)


@dataclass(frozen=True)
class Section:
    title: str  # for messages: "pipeline", "adamw()"
    cls: type
    fields: tuple[Field, ...]
    noun: str = "key"  # "key" in blocks, "argument" in calls
    retired: tuple[tuple[str, str, str], ...] = ()  # (key, message, hint): refused with a hint

    def field(self, key: str) -> Optional[Field]:
        return next((f for f in self.fields if f.key == key), None)

    def keys(self) -> list[str]:
        return [f.key for f in self.fields]


def join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def _default(cls: type, name: str) -> Any:
    for f in dataclasses.fields(cls):
        if f.name == name:
            if f.default is not dataclasses.MISSING:
                return f.default
            if f.default_factory is not dataclasses.MISSING:
                return f.default_factory()
    return dataclasses.MISSING


# --------------------------------------------------------- generic machinery
def read_entries(r: Reading, entries: Sequence[Entry], prefix: str, section: Section,
                 owner_span: Span) -> dict[str, Any]:
    """Read `entries` against `section`'s fields -> {attribute: value}.

    Unknown and duplicate keys, type errors and missing required keys become
    diagnostics; keys that failed are left out of the result.
    """
    seen: dict[str, Span] = {}
    values: dict[str, Any] = {}
    for e in entries:
        key = join(prefix, e.key)
        field = section.field(e.key)
        if e.key in seen:
            first = seen[e.key]
            r.error(e.key_span, f"duplicate {section.noun} '{e.key}' in {section.title}",
                    f"it is already set at line {first.line}; keep one", key)
            continue
        seen[e.key] = e.key_span
        retired = next((x for x in section.retired if x[0] == e.key), None)
        if field is None and retired is not None:
            r.error(e.key_span, retired[1], retired[2], key)
            continue
        if field is None:
            r.error(e.key_span, f"unknown {section.noun} '{e.key}' in {section.title}",
                    did_you_mean(e.key, section.keys()), key)
            # the key it was probably meant to be is unknown too: no knock-on errors about it
            r.failed.update(join(prefix, k) for k in closest(e.key, section.keys()))
            continue
        ok, value = read_field(r, field, e, key)
        if ok:
            values[field.key] = value
    for f in section.fields:
        missing = _default(section.cls, f.key) is dataclasses.MISSING
        if missing and f.key not in values and join(prefix, f.key) not in r.failed:
            r.error(owner_span, f"{section.title} needs '{f.key}'",
                    f"add {f.key} = ... to {section.title}", join(prefix, f.key))
    return values


def read_field(r: Reading, field: Field, e: Entry, key: str) -> tuple[bool, Any]:
    node = e.value
    try:
        if field.section is not None:
            r.spans[key] = e.key_span
            if not isinstance(node, Table) and field.shorthand is not None:
                inner = field.section.field(field.shorthand)
                ok, value = read_field(r, inner, e, join(key, field.shorthand))
                return ok, _build(field.section.cls, {field.shorthand: value} if ok else {})
            if not isinstance(node, Table):
                raise Invalid(f"{key} must be a block {{ ... }}, {shown(node)}")
            return True, read_section(r, node, key, field.section, e.key_span)
        r.spans[key] = node.span
        if isinstance(node, Items):
            for i, item in enumerate(node.items):
                r.spans[f"{key}.{i}"] = item.span
        if field.nested:
            n_errors = len(r.diagnostics)
            value = field.read(r, node, key)
            if len(r.diagnostics) > n_errors:
                r.failed.add(key)
                return False, None
            return True, value
        return True, field.read(node, key)
    except Invalid as err:
        r.error(err.span or node.span, err.message, err.hint, key)
        return False, None


def read_section(r: Reading, table: Table, prefix: str, section: Section, owner_span: Span):
    values = read_entries(r, table.entries, prefix, section, owner_span)
    return _build(section.cls, values)


def _build(cls: type, values: dict[str, Any]):
    """The dataclass from what was read; required fields that failed get placeholders
    (the plan is not returned when anything failed, but later checks still run)."""
    for f in dataclasses.fields(cls):
        if f.name not in values and _default(cls, f.name) is dataclasses.MISSING:
            values[f.name] = _PLACEHOLDERS.get(f.type, None)
    return cls(**values)


# Stand-ins for required fields that failed to read, by annotation (they are strings here).
_PLACEHOLDERS = {"str": "", "int": 1, "tuple[str, ...]": (), "ModelSpec": A.ModelSpec(source="")}


Line = tuple[Optional[str], str]  # (the dotted key the line writes, or None; its text)


def write_section(obj: Any, section: Section, prefix: str, emit: Emit) -> list[Line]:
    """Canonical lines of a section's body (not indented, no braces), each with its key."""
    lines: list[Line] = []
    for f in section.fields:
        key = join(prefix, f.key)
        value = getattr(obj, f.key)
        default = _default(section.cls, f.key)
        if value is None:
            continue
        if f.section is not None:  # shown when written, or when anything inside is shown
            body = write_section(value, f.section, key, emit)
            if body or emit(key, value, value):
                lines += _block(key, f.key, body)
            continue
        if not emit(key, value, default):
            continue
        written = f.write(value, key, emit) if f.nested else f.write(value)
        if isinstance(written, list):  # a block body, one (key, line) per item
            lines += _block(key, f.key, written)
        else:
            lines.append((key, f"{f.key} = {written}"))
    return lines


def _block(key: str, name: str, body: list[Line]) -> list[Line]:
    if not body:
        return [(key, f"{name} {{}}")]
    return [(key, f"{name} {{")] + [(k, "  " + line) for k, line in body] + [(None, "}")]


# -------------------------------------------------------------- calls `f(...)`
@dataclass(frozen=True)
class CallShape:
    """One function a call-valued key accepts, e.g. `adamw(lr = 3e-3)`."""

    section: Section  # its keyword arguments (section.title is "adamw()")
    positional: tuple[str, ...] = ()  # names of the positional arguments, in order


def read_call(r: Reading, node: Node, key: str, shapes: Mapping[str, CallShape]
              ) -> tuple[str, dict[str, Any]]:
    """A call (or a bare name for a call without arguments) -> (function name, values)."""
    if isinstance(node, Name) and node.value in shapes:
        return node.value, read_entries(r, (), key, shapes[node.value].section, node.span)
    if not isinstance(node, (Call, Name)):
        raise Invalid(f"{key} must be one of {', '.join(f'{n}(...)' for n in shapes)}; {shown(node)}")
    if call_name(node) not in shapes:
        raise Invalid(f"unknown {key.rsplit('.', 1)[-1]} '{call_name(node)}'",
                      did_you_mean(call_name(node), list(shapes)))
    shape = shapes[node.name]
    if len(node.args) > len(shape.positional):
        extra = node.args[len(shape.positional)]
        takes = (f"takes {len(shape.positional)} positional argument(s): "
                 + ", ".join(shape.positional)) if shape.positional else "takes only named arguments"
        raise Invalid(f"{node.name}() {takes}", "name the argument: key = value", extra.span)
    named = tuple(Entry(name, arg.span, arg) for name, arg in zip(shape.positional, node.args))
    return node.name, read_entries(r, named + node.kwargs, key, shape.section, node.span)


def call_name(node: Node) -> str:
    return node.value if isinstance(node, Name) else node.name


def write_call(name: str, obj: Any, section: Section, key: str, emit: Emit,
               positional: tuple[str, ...] = ()) -> str:
    """`name(a, k = v)`: the `positional` fields (declared first) unnamed, then the rest."""
    parts = []
    for f in section.fields:
        value = getattr(obj, f.key)
        if value is None or not emit(join(key, f.key), value, _default(section.cls, f.key)):
            continue
        text_ = f.write(value, join(key, f.key), emit) if f.nested else f.write(value)
        parts.append(text_ if f.key in positional else f"{f.key} = {text_}")
    return f"{name}({', '.join(parts)})"
