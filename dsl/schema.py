"""The plan's schema: every section and key of the language, what it reads and writes.

Each section is declared once (dsl/fields.py), and the same declaration drives
reading a syntax tree into a Plan and writing a Plan back as canonical text,
so the reader and the formatter cannot drift apart. Readers of single values
live in dsl/values.py; this module says which key takes which value.
"""
from __future__ import annotations

import re
from typing import Mapping

from . import ast as A
from ..schedules.kinds import KINDS
from .schema_train import TRAIN, read_sync, write_sync
from .stage_costs import read_costs, write_costs
from .limits import (MAX_BATCH, MAX_DIM, MAX_EXPERTS, MAX_LAYER, MAX_MICROBATCHES, MAX_RANKS, MAX_SEED, MAX_SEQ_LEN, MAX_VIRTUAL, MAX_VOCAB)
from .fields import CallShape, Emit, Field, Reading, Section, call_name, join, read_call, write_call
from .syntax import (Call, Float, Int, Items, Name, Node, Pattern, RangeNode, Shaped, Size, Str, Table)
from .values import (Invalid, boolean, check_pattern, choice, did_you_mean, duration, integer, number, patterns, plain_value, rate, shown, text, write_duration, write_float, write_pattern, write_patterns, write_plain, write_rate, write_size, write_string)


# ---------------------------------------------------------------- model
_SOURCE = re.compile(r"(?P<file>[^:]+\.py|[A-Za-z_][\w.]*):(?P<cls>[A-Za-z_]\w*)")


def _source(node: Node, key: str) -> str:
    """file.py:Class, package.module:Class, or a folder (no `:`) holding a config.json."""
    value = text(node, key)
    if value.endswith(".py"):  # a model file without its class
        raise Invalid(f"model source '{value}' is not file.py:Class or package.module:Class",
                      f'name the class: source = "{value}:ClassName" (relative to this plan '
                      "file)")
    if not _SOURCE.fullmatch(value) and (":" in value or not value.strip()):
        raise Invalid(f"model source '{value}' is not file.py:Class, package.module:Class or a "
                      "model folder", 'e.g. source = "models/gpt.py:GPT" or source = '
                      '"llama-tiny" (a save_pretrained folder), relative to this plan file')
    return value


def _args(r: Reading, node: Node, key: str) -> Mapping[str, A.Value]:
    if not isinstance(node, Table):
        raise Invalid(f"{key} must be a block of name = value, {shown(node)}",
                      "e.g. args = { dim = 64, layers = 8 }")
    out: dict[str, A.Value] = {}
    for e in node.entries:
        sub = join(key, e.key)
        if e.key in out:
            r.error(e.key_span, f"duplicate argument '{e.key}' in {key}", "keep one", sub)
            continue
        if not e.key.isidentifier():
            r.error(e.key_span, f"argument name '{e.key}' is not a Python name",
                    "constructor arguments are keyword arguments: letters, digits, _", sub)
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
        sub = join(key, e.key)
        r.spans[sub] = e.value.span
        if any(s.name == e.key for s in out):
            r.error(e.key_span, f"duplicate input '{e.key}'", "keep one", sub)
        elif not e.key.isidentifier():
            r.error(e.key_span, f"input name '{e.key}' is not a Python name",
                    "inputs are the forward()'s parameter names", sub)
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
        elif any(isinstance(d, int) and d > MAX_DIM for d in e.value.dims):
            r.error(e.value.span, f"input {e.key} has a dimension above {MAX_DIM:,}",
                    "pipeplan bounds every size in a plan before it allocates anything", sub)
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
    Field("weights", text, write_string)  # backends/state/weights.py checks it,
))

# ----------------------------------------------------------------- data
DATA_FIELDS = ("tokens", "positions", "document_positions", "mask", "targets")  # what the
# runtime's data provides (backends/runtime/data.py)


def _data_inputs(r: Reading, node: Node, key: str) -> tuple[tuple[str, str], ...]:
    """`inputs = { tokens = tokens, pos = positions }`: model input -> data field."""
    if not isinstance(node, Table):
        raise Invalid(f"{key} must be a block of model_input = data field, {shown(node)}",
                      "e.g. inputs = { tokens = tokens, position_ids = positions }")
    out: list[tuple[str, str]] = []
    field = choice(*DATA_FIELDS)
    for e in node.entries:
        sub = join(key, e.key)
        r.spans[sub] = e.key_span
        if any(name == e.key for name, _ in out):
            r.error(e.key_span, f"duplicate input '{e.key}' in {key}", "keep one", sub)
            continue
        try:
            out.append((e.key, field(e.value, "data field")))
        except Invalid as err:
            r.error(e.value.span, err.message, err.hint, sub)
    return tuple(out)


def _write_data_inputs(inputs: tuple[tuple[str, str], ...], key: str, emit: Emit) -> str:
    return "{ " + ", ".join(f"{k} = {v}" for k, v in inputs) + " }"


_INPUTS = Field("inputs", _data_inputs, _write_data_inputs, nested=True)
_SYNTHETIC = CallShape(Section("synthetic()", A.DataSpec, (
    Field("seed", integer(0, MAX_SEED)),
    Field("vocab", integer(2, MAX_VOCAB)),
    Field("seq_len", integer(1, MAX_SEQ_LEN)),
    _INPUTS,
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
    Field("seq_len", integer(1, MAX_SEQ_LEN)),
    Field("wrap", boolean),
    _INPUTS,
), noun="argument"), positional=("path",))


def _paths(node: Node, key: str) -> tuple[str, ...]:
    """A list of paths in double quotes (one string is a one-item list)."""
    if not isinstance(node, Items):
        return (text(node, key),)
    if not node.items:
        raise Invalid(f"{key} is empty", 'name at least one file: files = ["corpus.txt"]')
    out = []
    for item in node.items:
        try:
            out.append(text(item, key))
        except Invalid as e:
            raise Invalid(e.message, e.hint, item.span) from None
    return tuple(out)


def _write_paths(paths: tuple[str, ...]) -> str:
    return "[" + ", ".join(write_string(p) for p in paths) + "]"


def _cache_dir(node: Node, key: str) -> str:
    value = text(node, key)
    if not value.strip():
        raise Invalid(f"{key} is empty", 'name a folder, e.g. cache = ".pipeplan-cache"')
    return value


# text(...): documents -> a tokenizer -> a cached token file (compiler/text.py)
_TEXT = CallShape(Section("text()", A.DataSpec, (
    Field("files", _paths, _write_paths),
    Field("tokenizer", text, write_string),
    Field("seq_len", integer(1, MAX_SEQ_LEN)),
    Field("field", text, write_string),
    Field("eos", text, write_string),
    Field("holdout", number(lo=0, hi=0.5)),
    Field("shuffle", boolean),
    Field("wrap", boolean),
    Field("cache", _cache_dir, write_string),
    _INPUTS,
), noun="argument"), positional=("files",))
_DATA_SHAPES = {"synthetic": _SYNTHETIC, "tokens": _TOKENS, "text": _TEXT}
_DATA_KINDS = {"synthetic": "synthetic", "tokens": "file", "text": "text"}  # call -> kind


def _data(r: Reading, node: Node, key: str) -> A.DataSpec:
    name, values = read_call(r, node, key, _DATA_SHAPES)
    if name == "text" and "tokenizer" not in values and f"{key}.tokenizer" not in r.failed:
        r.error(node.span, "text() needs a tokenizer",
                'add tokenizer = "FOLDER" (a save_pretrained folder) or "tokenizer.json"',
                f"{key}.tokenizer")
    if name == "text" and "files" not in values and f"{key}.files" not in r.failed:
        r.error(node.span, "text() needs files", 'e.g. text(files = ["corpus.txt"], ...)',
                f"{key}.files")
    return A.DataSpec(kind=_DATA_KINDS[name], **values)


def _write_data(data: A.DataSpec, key: str, emit: Emit) -> str:
    name = next(n for n, kind in _DATA_KINDS.items() if kind == data.kind)
    shape = _DATA_SHAPES[name]
    return write_call(name, data, shape.section, key, emit, shape.positional)


# ----------------------------------------------------------------- mesh
MESH = Section("mesh", A.MeshSpec, tuple(Field(axis, integer(1, MAX_RANKS)) for axis in ("pp", "dp", "tp", "ep", "cp")))

# -------------------------------------------------------------- context
CONTEXT = Section("context", A.ContextSpec, (Field("method", choice("ulysses", "ring")),))

# ------------------------------------------------------------- pipeline
SPLIT_BASES = ("flops", "params", "profile")
_AUTO = CallShape(Section("auto()", A.SplitSpec, (Field("basis", choice(*SPLIT_BASES)),),
                          noun="argument"), positional=("basis",))


def _split(r: Reading, node: Node, key: str) -> A.SplitSpec:
    if isinstance(node, (Name, Call)) and call_name(node) == "auto":
        _, values = read_call(r, node, key, {"auto": _AUTO})
        return A.SplitSpec(kind="auto", **values)
    if isinstance(node, Items) and not node.items:  # one stage: no split points
        return A.SplitSpec(kind="points")
    if not isinstance(node, Items):
        raise Invalid(f"{key} must be auto(flops|params|profile), a list of module names where "
                      f"stages begin, or a list of layer ranges; {shown(node)}",
                      'e.g. split = ["layers.4"] or split = [layers[0:4], layers[4:8]]')
    if all(isinstance(i, RangeNode) for i in node.items):
        big = next((i for i in node.items if max(abs(i.start), abs(i.stop)) > MAX_LAYER), None)
        if big is not None:
            raise Invalid(f"layer range {big.prefix}[{big.start}:{big.stop}] has a bound above "
                          f"{MAX_LAYER:,}", "pipeplan bounds every size in a plan before it "
                          "allocates anything", big.span)
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
    Field("schedule", choice(*KINDS)),
    Field("microbatches", integer(1, MAX_MICROBATCHES)),
    Field("microbatch_size", integer(1, MAX_BATCH)),
    Field("virtual", integer(1, MAX_VIRTUAL)),
    Field("split", _split, _write_split, nested=True),
    Field("memory_limit", _memory_limit, _write_memory_limit),
    Field("profile", text, write_string),
    Field("costs", read_costs, write_costs),
))

# -------------------------------------------------------------- experts
EXPERTS = Section("experts", A.ExpertsSpec, (
    Field("modules", patterns, write_patterns),
    Field("num_experts", integer(1, MAX_EXPERTS)),
    Field("top_k", integer(1, MAX_EXPERTS)),
    Field("dropless", boolean),
    Field("capacity_factor", number(above=0, hi=MAX_EXPERTS)),  # capacity <= all tokens
    Field("drop_policy", choice("probs", "position")),
    Field("aux_loss", number(lo=0)),
    Field("z_loss", number(lo=0)),
    Field("dispatcher", choice("alltoall", "allgather")),
    Field("shared_experts", integer(0, MAX_EXPERTS)),
    Field("balance", choice("microbatch", "step")),
))

# --------------------------------------------------------------- tensor
TENSOR = Section("tensor", A.TensorSpec, (
    Field("column", patterns, write_patterns),
    Field("row", patterns, write_patterns),
    Field("vocab", patterns, write_patterns),
    Field("sequence_parallel", boolean),
    Field("plan", choice("model", "patterns", "auto")),
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


# -------------------------------------------------------------- compile
COMPILE = Section("compile", A.CompileSpec, (Field("mode", choice(*A.COMPILE_MODES)),))

# --------------------------------------------------------------- device
def _device_name(node: Node, key: str) -> str:
    """A profile's name (checked against the built-in profiles by the compiler)."""
    if isinstance(node, (Name, Str)) and node.value:
        return node.value
    raise Invalid(f"{key} must name a device profile like a100 or h100, {shown(node)}")


DEVICE = Section("device", A.DeviceSpec, (
    Field("name", _device_name),
    Field("flops", rate("flops"), write_rate("flops")),
    Field("memory_bandwidth", rate("bytes"), write_rate("bytes")),
    Field("intra_node", rate("bytes"), write_rate("bytes")),
    Field("inter_node", rate("bytes"), write_rate("bytes")),
    Field("latency", duration, write_duration),
    Field("ranks_per_node", integer(1, MAX_RANKS)),
), retired=(("mfu", "device.mfu is gone: the time model predicts MFU from the device's "
                    "ops (pipeplan check prints it)",
             "name a device (device = a100) and override its facts (flops = 312TFLOP/s, "
             "memory_bandwidth = 2TB/s, ...) instead"),))

# ----------------------------------------------------------------- plan
PLAN = Section("the plan", A.Plan, (
    Field("model", section=MODEL),
    Field("data", _data, _write_data, nested=True),
    Field("mesh", section=MESH),
    Field("pipeline", section=PIPELINE),
    Field("experts", section=EXPERTS),
    Field("context", section=CONTEXT),
    Field("tensor", section=TENSOR),
    Field("compile", section=COMPILE),
    Field("zero", integer(0, 3)),
    Field("sync", read_sync, write_sync, nested=True),
    Field("recompute", _recompute, _write_recompute, nested=True),
    Field("train", section=TRAIN),
    Field("device", section=DEVICE, shorthand="name"),
))
