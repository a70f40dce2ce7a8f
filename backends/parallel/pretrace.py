"""Stages rewritten before launch, in a world of fake process groups: what a compiled
stage (`compile.mode = graphs | inductor`) under tp or ep keeps for its backward is known
at compile time.

A rank's runtime rewrites each stage (`parallelize_stage`: the static expert dispatch,
then TP's DTensor nodes) and traces the rewritten stage jointly; the bytes its F hands to
B and W are what it holds per microbatch. The compiler cannot make that rewrite (it lives
here and needs process groups), so the commands that compile before a launch (`pipeplan
check`, `compile`, `plan`'s check, the launcher's own compile: runtime/source.py
`compile_checked`) hand it `rewrite_in_fake_world`: a torch.distributed world of "fake"
process groups (torch's FakeProcessGroup: groups of the right sizes, no communication),
rank 0's groups built as the runtime builds them (topology.py, `build_parallel_groups`),
and each stage module copied and rewritten in it on the meta device. The compiler traces
the copy on fake tensors (compiler/graphs/__init__.py). Every rank of a tp or ep group
holds the same shapes (tp slices, ep's equal all-to-all blocks), so rank 0's stages stand
for all. Inside a running world (a worker compiling) nothing is faked: its ranks trace
their own stages.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
from typing import Callable, Iterator, Optional

import torch.distributed as dist
from torch import nn

from ...compiler.compiled import StageSpec
from ...dsl.ast import Plan


def _register_fake_backend() -> None:
    """torch's fake process group backend, registered by its testing module on import."""
    if "fake" not in dist.Backend.backend_list:
        import torch.testing._internal.distributed.fake_pg  # noqa: F401


@contextlib.contextmanager
def rewrite_in_fake_world(plan: Plan, experts: tuple, tp_kinds: dict
                          ) -> Iterator[Optional[Callable[[StageSpec], object]]]:
    """Yields stage spec -> a copy of its module rewritten as rank 0's runtime rewrites it
    (None inside an initialised world). The fake world is torn down on exit."""
    if dist.is_initialized():
        yield None
        return
    from ..runtime.topology import build_topology
    from . import build_parallel_groups, parallelize_stage

    _register_fake_backend()
    mesh = dataclasses.replace(plan.mesh, pp=1)  # one pipeline rank's groups: all alike
    dist.init_process_group("fake", store=dist.HashStore(), rank=0,
                            world_size=mesh.dp * mesh.cp * mesh.tp)
    try:
        topo = build_topology(mesh)
        groups = build_parallel_groups(
            mesh, topo.tp_group, topo.dp_group,
            sequence_parallel_experts=plan.tensor.sequence_parallel and plan.experts is not None)

        def rewritten(spec: StageSpec):
            return parallelize_stage(_meta_copy(spec.module), plan, groups, experts,
                                     tp_kinds).module

        yield rewritten
    finally:
        dist.destroy_process_group()


def _meta_copy(module: nn.Module) -> nn.Module:
    """A copy of a stage module whose tensors are new meta tensors (ties kept): the rewrite
    slices the copy's parameters, never the compiler's (which may hold weights)."""
    memo = {}
    for p in module.parameters():
        memo[id(p)] = nn.Parameter(p.detach().to("meta"), requires_grad=p.requires_grad)
    for b in module.buffers():
        memo[id(b)] = b.detach().to("meta")
    return copy.deepcopy(module, memo)
