"""Checks of the plan's `compile` section (docs/compiler.md, "Compiled stages").

`graphs` and `inductor` run each stage as its partitioned joint graph
(backends/runtime/graph_stage.py). What that runtime does not do yet is refused
here at the `compile.mode` line, each with the reason: one table, `UNSUPPORTED`.
Stages that cannot be traced jointly (a custom autograd.Function, an op whose
shape depends on the data) are refused after tracing (compiler/checks.py).
"""
from __future__ import annotations

from typing import Callable, Iterator

from .ast import Plan
from .layout import ep_across_tp
from .rules import Problem, check

# (what the plan asks for, why graphs mode refuses it) -- docs/compiler.md lists the same
UNSUPPORTED: tuple[tuple[str, Callable[[Plan], bool], str], ...] = (
    ("expert parallelism across tp", lambda p: p.mesh.ep > 1 and ep_across_tp(p.mesh),
     "the static expert dispatch of compiled stages is built within data-parallel ranks "
     "only (ep dividing dp)"),
    ("experts.dropless = false", lambda p: p.experts is not None and not p.experts.dropless,
     "the capacity rewrite of the experts is a runtime module swap not traced jointly"),
    ("sync = diloco", lambda p: p.sync.diloco, "DiLoCo islands are not built on compiled stages"),
    ("experts.balance = step", lambda p: p.experts is not None and p.experts.balance == "step",
     "the routing pre-pass runs the stages eagerly"),
)


@check("compile", "mesh", "zero", "experts", "recompute", "sync")
def _compile(plan: Plan) -> Iterator[Problem]:
    if not plan.compile.graphs:
        return
    for what, asks, why in UNSUPPORTED:
        if asks(plan):
            yield Problem("compile.mode", f"compile.mode = {plan.compile.mode} does not run "
                          f"with {what}: {why}", "use compile { mode = eager } for this plan")
