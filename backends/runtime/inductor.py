"""compile.mode = inductor: each F / B / W / BW graph compiled by torch's inductor.

`compile_part(part)` hands one partitioned graph (compiler/graphs/split.py) to
`torch._inductor.compile_fx.compile_fx` with example inputs of the shapes,
strides and dtypes its placeholders were traced with, and returns the compiled
callable (a graph without ops is returned as it is). Inductor's FX graph cache
keeps the compiled artifacts on disk, keyed by a hash of the graph, its inputs'
metadata, the inductor configuration and the torch version; `cache_dir()` is
where: `$TORCHINDUCTOR_CACHE_DIR` when set, else ~/.cache/pipeplan/inductor,
shared by every rank and every later run. `COMPILES` records each compile: the
graph, its seconds and whether the cache had it (the runner reports them).

Beside inductor's cache, `pipeplan_compiles.json` in the same folder records the seconds
each graph took to compile cold, keyed by `part_key` (the torch version, the graph's code
and its inputs' shapes, strides, dtypes and device), so `pipeplan check` tells before a
launch which stages' graphs are compiled already and what the cold ones cost
(`cache_report`).
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ...compiler.graphs.split import Part


@dataclass(frozen=True)
class Compile:
    part: str  # "F", "B", "W", "BW"
    seconds: float
    cache_hit: bool


COMPILES: list[Compile] = []


def cache_dir() -> str:
    """Where inductor keeps compiled graphs (set once per process, before any compile)."""
    default = os.path.join(os.path.expanduser("~"), ".cache", "pipeplan", "inductor")
    return os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", default)


def compile_part(part: Part) -> Callable:
    """The compiled callable of `part` (inputs positional, outputs a tuple)."""
    if not any(n.op == "call_function" for n in part.gm.graph.nodes):
        return part.gm
    from torch._dynamo.utils import counters
    from torch._inductor import config
    from torch._inductor.compile_fx import compile_fx

    cache_dir()
    config.fx_graph_cache = True
    hits = counters["inductor"]["fxgraph_cache_hit"]
    start = time.perf_counter()
    examples = _examples(part)
    compiled = compile_fx(part.gm, examples)
    seconds = time.perf_counter() - start
    hit = counters["inductor"]["fxgraph_cache_hit"] > hits
    COMPILES.append(Compile(part.name, seconds, hit))
    if not hit:
        _record(part_key(part), seconds)

    strides = [e.stride() for e in examples]

    def call(*args):  # compiled code indexes by the traced strides: inputs laid out so
        return tuple(compiled(*[a if a.stride() == s else _laid_out(a, s)
                                for a, s in zip(args, strides)]))

    return call


def _examples(part: Part) -> list[torch.Tensor]:
    """Fake tensors like the ones each placeholder was traced with (shape, stride, dtype,
    device), in a fake mode with a (static) shape environment: inductor's FX graph cache
    needs one to key a graph."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    with FakeTensorMode(shape_env=ShapeEnv()):
        return [torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device)
                for v in (n.meta["val"] for n in part.gm.graph.nodes if n.op == "placeholder")]


def _laid_out(x: torch.Tensor, stride: tuple) -> torch.Tensor:
    """`x`'s values in a tensor of the given strides (a copy)."""
    return torch.empty_strided(x.shape, stride, dtype=x.dtype, device=x.device).copy_(x)


INDEX = "pipeplan_compiles.json"  # in cache_dir(): part_key -> seconds of its cold compile


def part_key(part: Part) -> str:
    """What inductor's cache keys a graph by, as far as pipeplan sees it: the torch version,
    the graph's code and each placeholder's shape, stride, dtype and device type."""
    meta = [(tuple(v.shape), tuple(v.stride()), str(v.dtype), v.device.type)
            for v in (n.meta["val"] for n in part.gm.graph.nodes if n.op == "placeholder")]
    text = repr((torch.__version__, part.gm.code, meta))
    return hashlib.sha256(text.encode()).hexdigest()


def compiled_seconds(key: str) -> Optional[float]:
    """Seconds the graph of `key` took to compile cold, if it was compiled into this cache."""
    return _read(os.path.join(cache_dir(), INDEX)).get(key)


def _read(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _record(key: str, seconds: float) -> None:
    """Add one cold compile to the index (ranks compiling at once take turns)."""
    path = os.path.join(cache_dir(), INDEX)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        lock = open(f"{path}.lock", "a+")
    except OSError:
        return  # a read-only cache: nothing recorded, inductor's own cache still works
    with lock, contextlib.ExitStack() as done:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done.callback(fcntl.flock, lock, fcntl.LOCK_UN)
        data = _read(path)
        data[key] = round(seconds, 3)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f)
        os.replace(tmp, path)


def cache_report(compiled) -> list[str]:
    """`pipeplan check`'s lines under compile.mode = inductor: per stage, whether its graphs
    are in this machine's cache (warm: compiled before, in how long) or not (cold: what
    the first run compiles, and the seconds recorded for those compiled before). A stage
    the runtime traces itself (rewritten by cp, tp or ep; bf16 autocast) is compiled on
    each rank at its first microbatch: its graphs are not known here."""
    from ...compiler.graphs.split import split_joint

    lines = [f"inductor cache: {cache_dir()} (CPU ranks' graphs; a CUDA rank traces and "
             "compiles its own)"]
    for st in compiled.stages:
        if st.joint is None or compiled.plan.train.precision == "bf16":
            lines.append(f"  stage {st.index}: traced and compiled on each rank at its first "
                         "microbatch (rewritten, or traced under autocast)")
            continue
        g = split_joint(st.joint)
        parts = [p for p in (g.F, g.B, g.W, g.BW)
                 if any(n.op == "call_function" for n in p.gm.graph.nodes)]
        seconds = {p.name: compiled_seconds(part_key(p)) for p in parts}
        warm = [n for n, t in seconds.items() if t is not None]
        cold = [n for n, t in seconds.items() if t is None]
        if not cold:
            lines.append(f"  stage {st.index}: warm ({', '.join(warm)} compiled before, "
                         f"{sum(seconds.values()):.1f} s cold)")
        else:
            lines.append(f"  stage {st.index}: cold: the first run compiles {', '.join(cold)}"
                         + (f" ({', '.join(warm)} cached)" if warm else ""))
    return lines
