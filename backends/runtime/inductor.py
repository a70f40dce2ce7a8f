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
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable

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
    COMPILES.append(Compile(part.name, time.perf_counter() - start,
                            counters["inductor"]["fxgraph_cache_hit"] > hits))

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
