"""What each key of a plan means: the schema that reads a syntax tree into a Plan
and writes a Plan back as canonical text.

Every section is declared once, as a tuple of `Field`s (key, reader, writer),
and the same declaration drives both directions, so the reader and the
formatter cannot drift apart. Reading never stops at the first problem: each
bad key or value becomes a Diagnostic and the rest is still read, so a plan
with three mistakes reports three errors.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

from . import ast as A
from .ast import Span
from .errors import Diagnostic
from .checks import SCHEDULE_KINDS
from .syntax import Call, Entry, Float, Int, Items, Name, Node, Pattern, RangeNode, Shaped, Size, Str, Table
from .values import (Invalid, boolean, check_pattern, choice, closest, did_you_mean, integer, number,
                     patterns, plain_value, shown, text, write_float, write_pattern, write_patterns,
                     write_plain, write_scalar, write_size, write_string)


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
    """One key of a section.

    `read(node, key)` / `write(value)` convert a plain value. With `nested`, the
    reader and writer get the context too: `read(reading, node, key)` and
    `write(value, key, emit)` (calls, free-form tables; a list of lines is
    written as a block body). With `section`, the
    value is a block read and written by that section.
    """

    key: str
    read: Optional[Callable] = None
    write: Callable = write_scalar
    attr: str = ""
    nested: bool = False
    section: Optional["Section"] = None

    @property
    def name(self) -> str:
        return self.attr or self.key


@dataclass(frozen=True)
class Section:
    title: str  # for messages: "pipeline", "adamw()"
    cls: type
    fields: tuple[Field, ...]
    noun: str = "key"  # "key" in blocks, "argument" in calls

    def field(self, key: str) -> Optional[Field]:
        return next((f for f in self.fields if f.key == key), None)

    def keys(self) -> list[str]:
        return [f.key for f in self.fields]


def _join(prefix: str, key: str) -> str:
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
        key = _join(prefix, e.key)
        field = section.field(e.key)
        if e.key in seen:
            first = seen[e.key]
            r.error(e.key_span, f"duplicate {section.noun} '{e.key}' in {section.title}",
                    f"it is already set at line {first.line}; keep one", key)
            continue
        seen[e.key] = e.key_span
        if field is None:
            r.error(e.key_span, f"unknown {section.noun} '{e.key}' in {section.title}",
                    did_you_mean(e.key, section.keys()), key)
            # the key it was probably meant to be is unknown too: no knock-on errors about it
            r.failed.update(_join(prefix, k) for k in closest(e.key, section.keys()))
            continue
        ok, value = read_field(r, field, e, key)
        if ok:
            values[field.name] = value
    for f in section.fields:
        missing = _default(section.cls, f.name) is dataclasses.MISSING
        if missing and f.name not in values and _join(prefix, f.key) not in r.failed:
            r.error(owner_span, f"{section.title} needs '{f.key}'",
                    f"add {f.key} = ... to {section.title}", _join(prefix, f.key))
    return values


def read_field(r: Reading, field: Field, e: Entry, key: str) -> tuple[bool, Any]:
    node = e.value
    try:
        if field.section is not None:
            r.spans[key] = e.key_span
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


_PLACEHOLDERS = {"str": "", "int": 1, "tuple[str, ...]": (), "ModelSpec": A.ModelSpec(source="")}


Line = tuple[Optional[str], str]  # (the dotted key the line writes, or None; its text)


def write_section(obj: Any, section: Section, prefix: str, emit: Emit) -> list[Line]:
    """Canonical lines of a section's body (not indented, no braces), each with its key."""
    lines: list[Line] = []
    for f in section.fields:
        key = _join(prefix, f.key)
        value = getattr(obj, f.name)
        default = _default(section.cls, f.name)
        if value is None or not emit(key, value, default):
            continue
        if f.section is not None:
            lines += _block(key, f.key, write_section(value, f.section, key, emit))
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
    if _call_name(node) not in shapes:
        raise Invalid(f"unknown {key.rsplit('.', 1)[-1]} '{_call_name(node)}'",
                      did_you_mean(_call_name(node), list(shapes)))
    shape = shapes[node.name]
    if len(node.args) > len(shape.positional):
        extra = node.args[len(shape.positional)]
        takes = (f"takes {len(shape.positional)} positional argument(s): "
                 + ", ".join(shape.positional)) if shape.positional else "takes only named arguments"
        raise Invalid(f"{node.name}() {takes}", "name the argument: key = value", extra.span)
    named = tuple(Entry(name, arg.span, arg) for name, arg in zip(shape.positional, node.args))
    return node.name, read_entries(r, named + node.kwargs, key, shape.section, node.span)


def _call_name(node: Node) -> str:
    return node.value if isinstance(node, Name) else node.name


def write_call(name: str, obj: Any, section: Section, key: str, emit: Emit,
               positional: tuple[str, ...] = ()) -> str:
    parts = []
    for f in section.fields:
        value = getattr(obj, f.name)
        if value is None or not emit(_join(key, f.key), value, _default(section.cls, f.name)):
            continue
        text_ = f.write(value)
        parts.append(text_ if f.key in positional else f"{f.key} = {text_}")
    return f"{name}({', '.join(parts)})"


# ---------------------------------------------------------------- model
_SOURCE = re.compile(r"(?P<file>[^:]+\.py|[A-Za-z_][\w.]*):(?P<cls>[A-Za-z_]\w*)")


def _source(node: Node, key: str) -> str:
    value = text(node, key)
    if not _SOURCE.fullmatch(value):
        raise Invalid(f"model source '{value}' is not file.py:Class or package.module:Class",
                      'e.g. source = "models/gpt.py:GPT" (relative to this plan file)')
    return value


def _args(r: Reading, node: Node, key: str) -> Mapping[str, A.Value]:
    if not isinstance(node, Table):
        raise Invalid(f"{key} must be a block of name = value, {shown(node)}",
                      "e.g. args = { dim = 64, layers = 8 }")
    out: dict[str, A.Value] = {}
    for e in node.entries:
        sub = _join(key, e.key)
        if e.key in out:
            r.error(e.key_span, f"duplicate argument '{e.key}' in {key}", "keep one", sub)
            continue
        if "." in e.key or "*" in e.key:
            r.error(e.key_span, f"argument name '{e.key}' is not a Python name", None, sub)
            continue
        r.spans[sub] = e.value.span
        try:
            out[e.key] = plain_value(e.value, sub)
        except Invalid as err:
            r.error(err.span or e.value.span, err.message, err.hint, sub)
    return A._frozen_map(out)


def _write_args(args: Mapping[str, A.Value], key: str, emit: Emit) -> str:
    return "{ " + ", ".join(f"{k} = {write_plain(v)}" for k, v in args.items()) + " }" if args else "{}"


DTYPES = ("int64", "int32", "int16", "int8", "uint8", "bool", "float32", "float16", "bfloat16",
          "float64")
SYMBOLIC_DIMS = ("batch", "seq")


def _inputs(r: Reading, node: Node, key: str) -> tuple[A.InputSpec, ...]:
    if not isinstance(node, Table):
        raise Invalid(f"{key} must be a block of name = dtype[dims], {shown(node)}",
                      "e.g. inputs { input_ids = int64[batch, seq] }")
    out: list[A.InputSpec] = []
    for e in node.entries:
        sub = _join(key, e.key)
        r.spans[sub] = e.value.span
        if any(s.name == e.key for s in out):
            r.error(e.key_span, f"duplicate input '{e.key}'", "keep one", sub)
        elif not isinstance(e.value, Shaped):
            r.error(e.value.span, f"input {e.key} must be dtype[dims], {shown(e.value)}",
                    "e.g. int64[batch, seq]", sub)
        elif e.value.dtype not in DTYPES:
            r.error(e.value.span, f"unknown dtype '{e.value.dtype}'",
                    did_you_mean(e.value.dtype, DTYPES), sub)
        elif any(isinstance(d, str) and d not in SYMBOLIC_DIMS for d in e.value.dims):
            bad = next(d for d in e.value.dims if isinstance(d, str) and d not in SYMBOLIC_DIMS)
            r.error(e.value.span, f"unknown dimension '{bad}' in input {e.key}",
                    "a dimension is an integer, batch (the microbatch size) or seq (data seq_len)",
                    sub)
        elif any(isinstance(d, int) and d < 1 for d in e.value.dims):
            r.error(e.value.span, f"input {e.key} has a dimension below 1", None, sub)
        else:
            out.append(A.InputSpec(e.key, e.value.dtype, tuple(e.value.dims)))
    if not out and not node.entries:
        raise Invalid(f"{key} is empty", "name at least one input: input_ids = int64[batch, seq]")
    return tuple(out)


def _write_inputs(inputs: tuple[A.InputSpec, ...], key: str, emit: Emit) -> str:
    shown_ = (f"{i.name} = {i.dtype}[{', '.join(str(d) for d in i.shape)}]" for i in inputs)
    return "{ " + ", ".join(shown_) + " }"


MODEL = Section("model", A.ModelSpec, (
    Field("source", _source, write_string),
    Field("args", _args, _write_args, nested=True),
    Field("inputs", _inputs, _write_inputs, nested=True),
    Field("capture", choice("auto", "fx", "export")),
    Field("leaf_modules", patterns, write_patterns),
    Field("loss", choice("cross_entropy", "mse", "model")),
))

# ----------------------------------------------------------------- data
_SYNTHETIC = CallShape(Section("synthetic()", A.DataSpec, (
    Field("seed", integer(0)),
    Field("vocab", integer(2)),
    Field("seq_len", integer(1)),
), noun="argument"))
_DATA_FILE_EXTENSIONS = (".bin", ".npy")


def _token_path(node: Node, key: str) -> str:
    value = text(node, key)
    if not value.endswith(_DATA_FILE_EXTENSIONS):
        raise Invalid(f"token file '{value}' is not .bin or .npy",
                      ".bin holds uint16 tokens, .npy any integer array; both are memory-mapped")
    return value


_TOKENS = CallShape(Section("tokens()", A.DataSpec, (
    Field("path", _token_path, write_string),
    Field("seq_len", integer(1)),
), noun="argument"), positional=("path",))
_DATA_SHAPES = {"synthetic": _SYNTHETIC, "tokens": _TOKENS}


def _data(r: Reading, node: Node, key: str) -> A.DataSpec:
    name, values = read_call(r, node, key, _DATA_SHAPES)
    if name == "tokens":
        return A.DataSpec(kind="file", **values)
    return A.DataSpec(kind="synthetic", **values)


def _write_data(data: A.DataSpec, key: str, emit: Emit) -> str:
    if data.kind == "file":
        always = lambda k, v, d: k == f"{key}.path" or emit(k, v, d)  # noqa: E731
        return write_call("tokens", data, _TOKENS.section, key, always, _TOKENS.positional)
    return write_call("synthetic", data, _SYNTHETIC.section, key, emit)


# ----------------------------------------------------------------- mesh
MESH = Section("mesh", A.MeshSpec, tuple(Field(axis, integer(1)) for axis in ("pp", "dp", "tp", "ep")))

# ------------------------------------------------------------- pipeline
SPLIT_BASES = ("flops", "params", "profile")
_AUTO = CallShape(Section("auto()", A.SplitSpec, (Field("basis", choice(*SPLIT_BASES)),),
                          noun="argument"), positional=("basis",))


def _split(r: Reading, node: Node, key: str) -> A.SplitSpec:
    if isinstance(node, (Name, Call)) and _call_name(node) == "auto":
        _, values = read_call(r, node, key, {"auto": _AUTO})
        return A.SplitSpec(kind="auto", **values)
    if isinstance(node, Items) and not node.items:  # one stage: no split points
        return A.SplitSpec(kind="points")
    if not isinstance(node, Items):
        raise Invalid(f"{key} must be auto(flops|params|profile), a list of module names where "
                      f"stages begin, or a list of layer ranges; {shown(node)}",
                      'e.g. split = ["layers.4"] or split = [layers[0:4], layers[4:8]]')
    if all(isinstance(i, RangeNode) for i in node.items):
        return A.SplitSpec(kind="ranges", ranges=tuple(
            A.LayerRange(i.prefix, i.start, i.stop) for i in node.items))
    if all(isinstance(i, (Str, Pattern, Name)) for i in node.items):
        points = []
        for item in node.items:
            try:
                check_pattern(item.value, key)
            except Invalid as err:
                raise Invalid(err.message, err.hint, item.span) from None
            if "*" in item.value:
                raise Invalid(f"split point '{item.value}' must name one module, not a glob",
                              "write the module where a stage begins, e.g. layers.4", item.span)
            points.append(item.value)
        return A.SplitSpec(kind="points", points=tuple(points))
    odd = next(i for i in node.items if not isinstance(i, type(node.items[0])))
    raise Invalid(f"{key} mixes module names and layer ranges", "use one form for every stage",
                  odd.span)


def _write_split(split: A.SplitSpec, key: str, emit: Emit) -> str:
    if split.kind == "auto":
        return f"auto({split.basis})"
    if split.kind == "points":
        return write_patterns(split.points)
    return "[" + ", ".join(f"{write_pattern(g.prefix)}[{g.start}:{g.stop}]"
                           for g in split.ranges) + "]"


def _memory_limit(node: Node, key: str) -> A.MemoryLimit:
    if isinstance(node, Size):
        if node.bytes <= 0:
            raise Invalid(f"{key} must be above 0 bytes")
        return A.MemoryLimit(float(node.bytes), in_bytes=True)
    if isinstance(node, (Int, Float)):
        return A.MemoryLimit(number(above=0)(node, key))
    raise Invalid(f"{key} must be a size (40GiB) or a count of microbatches' activations (4); "
                  f"{shown(node)}")


def _write_memory_limit(limit: A.MemoryLimit) -> str:
    if limit.in_bytes:
        return write_size(limit.amount)
    return str(int(limit.amount)) if limit.amount.is_integer() else write_float(limit.amount)


PIPELINE = Section("pipeline", A.PipelineSpec, (
    Field("schedule", choice(*SCHEDULE_KINDS)),
    Field("microbatches", integer(1)),
    Field("microbatch_size", integer(1)),
    Field("virtual", integer(1)),
    Field("split", _split, _write_split, nested=True),
    Field("memory_limit", _memory_limit, _write_memory_limit),
))

# -------------------------------------------------------------- experts
EXPERTS = Section("experts", A.ExpertsSpec, (
    Field("modules", patterns, write_patterns),
    Field("num_experts", integer(1)),
    Field("top_k", integer(1)),
    Field("dropless", boolean),
    Field("capacity_factor", number(above=0)),
    Field("drop_policy", choice("probs", "position")),
    Field("aux_loss", number(lo=0)),
    Field("z_loss", number(lo=0)),
    Field("dispatcher", choice("alltoall", "allgather")),
    Field("shared_experts", integer(0)),
))

# --------------------------------------------------------------- tensor
TENSOR = Section("tensor", A.TensorSpec, (
    Field("column", patterns, write_patterns),
    Field("row", patterns, write_patterns),
    Field("vocab", patterns, write_patterns),
    Field("sequence_parallel", boolean),
))

# ------------------------------------------------------------- recompute
RECOMPUTE_MODES = ("none", "full", "selective")


def _recompute(r: Reading, node: Node, key: str) -> tuple[A.RecomputeRule, ...]:
    if not isinstance(node, Table):
        raise Invalid(f"{key} must be a block of pattern = none|full|selective, {shown(node)}",
                      "e.g. recompute { layers.*.mlp = full }")
    rules: list[A.RecomputeRule] = []
    mode = choice(*RECOMPUTE_MODES)
    for i, e in enumerate(node.entries):
        sub = f"{key}.{i}"
        r.spans[sub] = e.key_span
        r.spans[f"{sub}.mode"] = e.value.span
        try:
            check_pattern(e.key, sub)
            if any(rule.pattern == e.key for rule in rules):
                raise Invalid(f"duplicate recompute pattern '{e.key}'", "keep one", e.key_span)
        except Invalid as err:
            r.error(err.span or e.key_span, err.message, err.hint, sub)
            continue
        try:
            rules.append(A.RecomputeRule(e.key, mode(e.value, "recompute mode")))
        except Invalid as err:
            r.error(e.value.span, err.message, err.hint, sub)
    return tuple(rules)


def _write_recompute(rules: tuple[A.RecomputeRule, ...], key: str, emit: Emit) -> list:
    return [(f"{key}.{i}", f"{write_pattern(x.pattern)} = {x.mode}") for i, x in enumerate(rules)]


# ---------------------------------------------------------------- train
def _betas(node: Node, key: str) -> tuple[float, float]:
    if not isinstance(node, Items) or len(node.items) != 2:
        raise Invalid(f"{key} must be a list of two numbers, {shown(node)}", "e.g. betas = [0.9, 0.95]")
    read = number(lo=0, hi=1)
    b1, b2 = (read(i, key) for i in node.items)
    if b1 >= 1 or b2 >= 1:
        raise Invalid(f"{key} must be below 1, got [{b1:g}, {b2:g}]")
    return (b1, b2)


_LR, _WD = Field("lr", number(above=0)), Field("weight_decay", number(lo=0))
_OPTIMIZERS = {
    "adamw": CallShape(Section("adamw()", A.OptimizerSpec, (
        _LR, Field("betas", _betas), Field("eps", number(above=0)), _WD), noun="argument")),
    "sgd": CallShape(Section("sgd()", A.OptimizerSpec, (
        _LR, Field("momentum", number(lo=0)), _WD), noun="argument")),
}


def _optimizer(r: Reading, node: Node, key: str) -> A.OptimizerSpec:
    name, values = read_call(r, node, key, _OPTIMIZERS)
    return A.OptimizerSpec(name=name, **values)


def _write_optimizer(opt: A.OptimizerSpec, key: str, emit: Emit) -> str:
    return write_call(opt.name, opt, _OPTIMIZERS[opt.name].section, key, emit)


_LR_SCHEDULES = {
    "constant": CallShape(Section("constant()", A.LRScheduleSpec, (
        Field("warmup", integer(0)),), noun="argument")),
    "cosine": CallShape(Section("cosine()", A.LRScheduleSpec, (
        Field("warmup", integer(0)), Field("min_lr", number(lo=0))), noun="argument")),
}


def _lr_schedule(r: Reading, node: Node, key: str) -> A.LRScheduleSpec:
    name, values = read_call(r, node, key, _LR_SCHEDULES)
    return A.LRScheduleSpec(kind=name, **values)


def _write_lr_schedule(s: A.LRScheduleSpec, key: str, emit: Emit) -> str:
    return write_call(s.kind, s, _LR_SCHEDULES[s.kind].section, key, emit)


CHECKPOINT = Section("checkpoint", A.CheckpointSpec, (
    Field("every", integer(1)),
    Field("dir", text, write_string),
    Field("keep", integer(1)),
))

TRAIN = Section("train", A.TrainSpec, (
    Field("steps", integer(1)),
    Field("global_batch", integer(1)),
    Field("optimizer", _optimizer, _write_optimizer, nested=True),
    Field("lr_schedule", _lr_schedule, _write_lr_schedule, nested=True),
    Field("grad_clip", number(above=0)),
    Field("precision", choice("fp32", "bf16")),
    Field("seed", integer(0)),
    Field("checkpoint", section=CHECKPOINT),
    Field("log_dir", text, write_string),
))

# ----------------------------------------------------------------- plan
PLAN = Section("the plan", A.Plan, (
    Field("model", section=MODEL),
    Field("data", _data, _write_data, nested=True),
    Field("mesh", section=MESH),
    Field("pipeline", section=PIPELINE),
    Field("experts", section=EXPERTS),
    Field("tensor", section=TENSOR),
    Field("zero", integer(0, 3)),
    Field("recompute", _recompute, _write_recompute, nested=True),
    Field("train", section=TRAIN),
))
