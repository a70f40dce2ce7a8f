"""Stages rewritten before launch, in a world of fake process groups: what a compiled
stage (`compile.mode = graphs | inductor`) under cp, tp or ep keeps for its backward is
known at compile time.

A rank's runtime rewrites its stages (`rewrite_stages`: ring or Ulysses attention, the
static expert dispatch, then TP's DTensor nodes) and traces each rewritten stage jointly;
the bytes its F hands to B and W are what it holds per microbatch. The compiler cannot make
that rewrite (it lives here and needs process groups), so the commands that compile before
a launch (`pipeplan check`, `compile`, `plan`'s check, the launcher's own compile:
runtime/source.py `compile_checked`) hand it `rewrite_in_fake_world`: a torch.distributed
world of "fake" process groups (torch's FakeProcessGroup: groups of the right sizes, no
communication), the groups built as the runtime builds them, and every stage module copied
on the meta device and rewritten there in one `rewrite_stages` call. The compiler traces
the copies on fake tensors (compiler/graphs/__init__.py). The ranks of a tp or ep group
hold the same shapes (tp slices, ep's equal all-to-all blocks), so coordinate 0 stands for
all; cp ranks do not (ring attention computes the causal blocks a rank's chunks need), so
each cp rank gets a world of its own and a stage keeps the most any of them keeps. Inside a
running world (a worker compiling) nothing is faked: its ranks trace their own stages.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Iterator, Sequence

import torch.distributed as dist
from torch import nn

from ...compiler.compiled import StageSpec
from ...dsl.ast import Plan


def _register_fake_backend() -> None:
    """torch's fake process group backend, registered by its testing module on import (torch
    2.13 lists "fake" among the backends before that import registers it: import always)."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers it)


def rewrite_in_fake_world(plan: Plan, experts: tuple, tp_kinds: dict, stages: Sequence[StageSpec]
                          ) -> Iterator[dict[int, nn.Module]]:
    """For each cp rank in turn (dp and tp coordinate 0), a world of fake groups at that
    rank and, valid until the next is asked for, {stage index: a copy of its module
    rewritten as that rank's runtime rewrites it}. Nothing inside an initialised world
    (its ranks trace their own). Close the generator (contextlib.closing) to tear the
    current world down early."""
    if dist.is_initialized():
        return
    from ...dsl.layout import global_rank
    from ..runtime.topology import build_topology
    from . import rewrite_stages

    _register_fake_backend()
    mesh = dataclasses.replace(plan.mesh, pp=1)  # one pipeline rank's groups: all alike
    one = dataclasses.replace(plan, mesh=mesh)
    for cp in range(mesh.cp):  # ring attention's causal blocks differ by cp rank
        _forget_sharding_decisions()  # (none made on another world's meshes reach this one)
        dist.init_process_group("fake", store=dist.HashStore(),
                                rank=global_rank(mesh, 0, 0, 0, cp),
                                world_size=mesh.dp * mesh.cp * mesh.tp)
        try:
            modules = {st.index: _meta_copy(st.module) for st in stages}
            rewrite_stages(one, build_topology(mesh), modules, experts, tp_kinds)
            yield modules
        finally:
            dist.destroy_process_group()
            _forget_sharding_decisions()


def _forget_sharding_decisions() -> None:
    """Empty DTensor's caches of sharding decisions (its Python and native ones). Their
    keys compare device meshes by ranks and layout, not process groups, so a decision made
    in a fake world -- its output spec holding that world's mesh -- would be handed to a
    real world's mesh of the same shape later in the process (torch 2.13), and that run's
    collectives would go to the destroyed fake groups: silently other gradients (forked
    sequence-parallel training after a check in the same process: 41% off). And the other
    way round."""
    import torch
    from torch.distributed.tensor import DTensor

    prop = DTensor._op_dispatcher.sharding_propagator
    prop.propagate_op_sharding.cache_clear()
    torch._C._clear_DTensor_sharding_propagator_cache()


def _meta_copy(module: nn.Module) -> nn.Module:
    """A copy of a stage module whose tensors are new meta tensors (ties kept): the rewrite
    slices the copy's parameters, never the compiler's (which may hold weights)."""
    memo = {}
    for p in module.parameters():
        memo[id(p)] = nn.Parameter(p.detach().to("meta"), requires_grad=p.requires_grad)
    for b in module.buffers():
        memo[id(b)] = b.detach().to("meta")
    return copy.deepcopy(module, memo)
