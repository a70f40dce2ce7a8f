"""Pretrained weights checked before launch: `model { weights = "DIR_OR_FILE" }`'s files,
headers and names against the model (compile time; backends/state/weights.py reads them).

`catalogue(path)` reads every stored tensor's file, dtype and shape from the file
headers only (each header's size is bounded and checked against the file before it
is read; nothing is allocated for tensor data). `check_weights(plan, model)` (so
`pipeplan check`, `compile`, `run` and `verify` refuse before any process starts):
every parameter of the model is stored, under its own name or a name it is tied to,
with the model's shape and a dtype that casts to the model's; a stored tensor that is
neither a parameter nor a buffer of the model is an error too (strict loading).
"""
from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from ..dsl.ast import Plan
from ..dsl.errors import Diagnostic, PlanError
from ..errors import PipeplanError


INDEX = "model.safetensors.index.json"


SINGLE = "model.safetensors"


MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit for one file's JSON header


MAX_INDEX_BYTES = 64 * 2**20


MAX_LISTED = 8  # problems shown per check before "and N more"


DTYPES = {"F64": (torch.float64, 8), "F32": (torch.float32, 4), "F16": (torch.float16, 2),
          "BF16": (torch.bfloat16, 2), "F8_E4M3": (torch.float8_e4m3fn, 1),
          "F8_E5M2": (torch.float8_e5m2, 1), "I64": (torch.int64, 8), "I32": (torch.int32, 4),
          "I16": (torch.int16, 2), "I8": (torch.int8, 1), "U8": (torch.uint8, 1),
          "BOOL": (torch.bool, 1)}


class WeightsFileError(PipeplanError):
    """A weights file that cannot be used, named with the reason."""


@dataclass(frozen=True)
class Stored:
    """One stored tensor: where it is and what it is (from the header, no data read)."""

    file: str
    dtype: str  # safetensors code, e.g. "F32"
    shape: tuple[int, ...]

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype][0]


def weight_files(path: str) -> tuple[list[str], Optional[dict[str, str]]]:
    """(safetensors files, the index's name -> file map or None) that `path` stands for."""
    if os.path.isfile(path):
        return [path], None
    if not os.path.exists(path):
        raise WeightsFileError(f"{path}: no such file or directory")
    index = os.path.join(path, INDEX)
    if os.path.isfile(index):
        weight_map = _read_index(index)
        files = sorted(set(weight_map.values()))
        for f in files:
            if not os.path.isfile(os.path.join(path, f)):
                raise WeightsFileError(f"{index}: lists shard {f!r}, which is not in {path}")
        return [os.path.join(path, f) for f in files], \
            {k: os.path.join(path, f) for k, f in weight_map.items()}
    if os.path.isfile(os.path.join(path, SINGLE)):
        return [os.path.join(path, SINGLE)], None
    found = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if len(found) == 1:
        return [os.path.join(path, found[0])], None
    raise WeightsFileError(
        f"{path}: no {SINGLE} or {INDEX} in this folder"
        + (f" (it holds {len(found)} .safetensors files: {', '.join(found[:4])}; name one)"
           if found else " (a folder written by save_pretrained holds one of them)"))


def _read_index(index: str) -> dict[str, str]:
    size = os.path.getsize(index)
    if size > MAX_INDEX_BYTES:
        raise WeightsFileError(f"{index}: {size:,} bytes, more than an index may hold "
                               f"({MAX_INDEX_BYTES:,})")
    try:
        with open(index, encoding="utf-8") as f:
            data = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise WeightsFileError(f"{index}: not a JSON index: {e}") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise WeightsFileError(f"{index}: no \"weight_map\" of tensor name -> file name")
    bad = [v for v in weight_map.values() if os.path.basename(v) != v or v in ("", ".", "..")]
    if bad:
        raise WeightsFileError(f"{index}: shard {bad[0]!r} is not a file name in its folder")
    return weight_map


def read_header(file: str) -> dict[str, Stored]:
    """The tensors one safetensors file declares, from its header alone (bounded, validated:
    known dtypes, shapes, data offsets inside the file and matching the shape)."""
    size = os.path.getsize(file)
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise WeightsFileError(f"{file}: {size} bytes, too short for a safetensors header")
        n = struct.unpack("<Q", head)[0]
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise WeightsFileError(f"{file}: corrupted header: declares {n:,} header bytes in a "
                                   f"file of {size:,} bytes (limit {MAX_HEADER_BYTES:,})")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise WeightsFileError(f"{file}: corrupted header: not JSON ({e})") from None
    if not isinstance(header, dict):
        raise WeightsFileError(f"{file}: corrupted header: not a JSON object")
    data_bytes = size - 8 - n
    out: dict[str, Stored] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        out[name] = _entry(file, name, entry, data_bytes)
    return out


def _entry(file: str, name: str, entry, data_bytes: int) -> Stored:
    def bad(why: str) -> WeightsFileError:
        return WeightsFileError(f"{file}: corrupted header: tensor `{name}` {why}")

    if not isinstance(entry, dict):
        raise bad("is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPES:
        raise bad(f"has dtype {dtype!r}, not one of {', '.join(DTYPES)}")
    if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
        raise bad(f"has shape {shape!r}, not a list of sizes")
    if not (isinstance(offsets, list) and len(offsets) == 2
            and all(type(o) is int for o in offsets) and 0 <= offsets[0] <= offsets[1]):
        raise bad(f"has data_offsets {offsets!r}, not [begin, end]")
    if offsets[1] > data_bytes:
        raise bad(f"ends at byte {offsets[1]:,} of a data section of {data_bytes:,} bytes "
                  "(truncated file?)")
    if offsets[1] - offsets[0] != math.prod(shape) * DTYPES[dtype][1]:
        raise bad(f"has {offsets[1] - offsets[0]:,} bytes for shape {shape} of {dtype}")
    return Stored(file, dtype, tuple(shape))


def catalogue(path: str) -> dict[str, Stored]:
    """Every stored tensor under `path` (a file or a save_pretrained folder), headers only."""
    files, weight_map = weight_files(path)
    out: dict[str, Stored] = {}
    for file in files:
        for name, stored in read_header(file).items():
            if weight_map is not None and weight_map.get(name) != file:
                continue  # the index decides which shard holds a name
            out[name] = stored
    for name, file in (weight_map or {}).items():
        if name not in out:
            raise WeightsFileError(f"{os.path.join(os.path.dirname(file), INDEX)}: lists tensor "
                                   f"`{name}` in {os.path.basename(file)}, whose header lacks it")
    return out


def alias_groups(model: nn.Module) -> list[list[str]]:
    """The model's parameter names, one group per parameter (tied names together)."""
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return list(groups.values())


def match_names(model: nn.Module, available) -> tuple[dict[str, str], list[list[str]]]:
    """(every parameter name of `model` -> the name in `available` holding its value: its own
    or one it is tied to; the parameters, as tied-name groups, that `available` lacks)."""
    found, missing = {}, []
    for names in alias_groups(model):
        have = next((n for n in names if n in available), None)
        if have is None:
            missing.append(names)
        else:
            found.update((n, have) for n in names)
    return found, missing


def _castable(src: torch.dtype, dst: torch.dtype) -> bool:
    return src.is_floating_point == dst.is_floating_point and (src == torch.bool) == (dst == torch.bool)


def weights_path(plan: Plan) -> str:
    return plan.resolve_path(plan.model.weights, "model.weights")


def plan_catalogue(plan: Plan) -> dict[str, Stored]:
    """The plan's weights catalogue; a file that cannot be used is a PlanError at its line."""
    path = weights_path(plan)
    try:
        return catalogue(path)
    except (WeightsFileError, OSError) as e:
        msg = str(e) if isinstance(e, WeightsFileError) else f"{e.filename or path}: {e.strerror or e}"
        raise PlanError.at(plan, "model.weights", msg,
                           "weights are a .safetensors file or a save_pretrained folder "
                           "(relative to the plan file)") from None


def weight_problems(stored: Mapping[str, Stored], model: nn.Module, where: str) -> list[str]:
    """What keeps `stored` (the weights at `where`) from loading into `model` (empty: it
    loads), each naming the file and the tensor."""
    problems = []
    found, missing = match_names(model, stored)
    for names in missing:
        tied = f" (nor under its tied name {', '.join(names[1:])})" if len(names) > 1 else ""
        problems.append(f"{where}: parameter `{names[0]}` "
                        f"{list(model.get_parameter(names[0]).shape)} is not stored{tied}")
    for name, have in found.items():
        if name != have:
            continue  # a tied name: its stored tensor is checked under the stored name
        p, s = model.get_parameter(name), stored[have]
        if s.shape != tuple(p.shape):
            problems.append(f"{s.file}: tensor `{have}` has shape {list(s.shape)}, the model's "
                            f"parameter has {list(p.shape)}")
        elif not _castable(s.torch_dtype, p.dtype):
            problems.append(f"{s.file}: tensor `{have}` is {s.dtype}, which does not cast to the "
                            f"parameter's {p.dtype}")
    buffers = dict(model.named_buffers(remove_duplicate=False))
    for name, buf in buffers.items():
        s = stored.get(name)
        if s is not None and s.shape != tuple(buf.shape):
            problems.append(f"{s.file}: tensor `{name}` has shape {list(s.shape)}, the model's "
                            f"buffer has {list(buf.shape)}")
    params = {n for g in alias_groups(model) for n in g}
    extra = sorted(n for n in stored if n not in params and n not in buffers)
    if extra:
        files = sorted({stored[n].file for n in extra})
        problems.append(f"{', '.join(files)}: {len(extra)} tensor(s) the model does not have: "
                        + ", ".join(f"`{n}`" for n in extra[:5]) + (" ..." if len(extra) > 5 else ""))
    return problems


def check_weights(plan: Plan, model: nn.Module) -> None:
    """Compile time: the plan's weights load into `model` (headers only, no tensor allocated)."""
    if plan.model.weights is None:
        return
    problems = weight_problems(plan_catalogue(plan), model, weights_path(plan))
    if not problems:
        return
    shown = problems[:MAX_LISTED]
    if len(problems) > MAX_LISTED:
        shown.append(f"... and {len(problems) - MAX_LISTED} more")
    hint = (f"the weights must be {type(model).__name__}'s with these plan args (names as in "
            "its state_dict); the file is another model's, or the args differ")
    span = plan.span_of("model.weights")
    raise PlanError([Diagnostic(p, span, hint) for p in shown],
                    plan.source_text or None, plan.sources)
