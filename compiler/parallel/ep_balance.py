"""`experts.balance = step`: the model's load-balancing statistics over the whole step.

A load-balancing loss (Switch, GShard, transformers' `load_balancing_loss_func`)
multiplies a *non-differentiable* statistic of the routing -- the share of the
tokens' slots each expert received, `f` -- by a differentiable one, the mean
router probability `P`: `aux = c * E * sum_e f_e * P_e`. The model's code
computes both over the tokens of the call it is given: one microbatch of one
data-parallel rank (`balance = microbatch`, the default: nothing here runs).

With `balance = step`, `f` covers the step's global tokens (every microbatch of
every dp/ep rank) while each microbatch keeps its own `P`; the microbatch
losses are averaged as always, so the step's loss and gradients are the
model's aux loss over the whole global batch (`mean_i c E sum f P_i = c E sum f
P`, microbatches being equal in size). The compiler finds each such statistic
in the captured graph by structure, never by name:

    a float tensor that needs no gradient, computed from a routing decision (an
    integer tensor made from differentiable values: the top-k expert ids, then
    one-hot, scatter, histc ...), read by an op whose result needs a
    gradient, and reaching the loss but neither the model's prediction nor any
    experts call (so it changes no activation, only the aux loss)

and wraps it in `step_statistic(value, key)`. Off the runtime (reference,
meta runs, costs) that call is the identity. The runtime (backends/runtime/balance.py)
first runs a no-grad forward of every microbatch through the pipeline
collecting each statistic (`StepStatistics.active("collect")`), averages it
over the microbatches and the dp group, then runs the step's schedule with the
averaged values (`active("apply")`). The statistic must be a mean over the call's tokens (as `f` is),
so that the mean over equal microbatches is the whole step's; the tests and
`pipeplan verify` hold this against the single-process model run on the whole
global batch at once.

Refused at `experts.balance` (plan line): no such statistic in the graph (a
model whose statistic would change its activations has none by this rule),
tp > 1, cp > 1 and zero = 3 (not built), DiLoCo sync (no global step).
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
import torch.fx as fx

from ...dsl.ast import Plan
from ...dsl.errors import Diagnostic, PlanError
from ..capture.analysis import MetaRun

# --------------------------------------------------------------- the graph's call
class StepStatistics:
    """One rank's step-wide statistics by key: summed while collecting, then the averages."""

    def __init__(self) -> None:
        self.mode: Optional[str] = None  # "collect" | "apply" | None (the model's own value)
        self.sums: dict[str, torch.Tensor] = {}
        self.values: dict[str, torch.Tensor] = {}

    def see(self, key: str, value: torch.Tensor) -> torch.Tensor:
        if self.mode == "collect":
            v = value.detach().to(torch.float64)
            self.sums[key] = self.sums[key] + v if key in self.sums else v.clone()
            return value
        if self.mode == "apply":
            if key not in self.values:
                raise RuntimeError(f"step statistic {key!r} was not collected before the step")
            return self.values[key].to(value.dtype)
        return value

    @contextlib.contextmanager
    def active(self, mode: str) -> Iterator["StepStatistics"]:
        global _ACTIVE
        outer, _ACTIVE, self.mode = _ACTIVE, self, mode
        try:
            yield self
        finally:
            _ACTIVE, self.mode = outer, None


_ACTIVE: Optional[StepStatistics] = None


def step_statistic(value: torch.Tensor, key: str) -> torch.Tensor:
    """The graph's call around one statistic: the value itself unless a runtime's
    `StepStatistics` is active (then collected, or replaced by its step-wide average)."""
    return value if _ACTIVE is None else _ACTIVE.see(key, value)


# ------------------------------------------------------------------- compile time
def mark_step_statistics(plan: Plan, gm: fx.GraphModule, run: MetaRun,
                         loss: fx.Node, prediction: Optional[fx.Node],
                         experts: dict[str, str]) -> list[str]:
    """Under `experts.balance = step`, wrap each load-balancing statistic of the captured
    graph in `step_statistic` (keyed by the node's name) and return the keys; raises a
    PlanError at `experts.balance` for what cannot run. Nothing changes otherwise."""
    if plan.experts is None or plan.experts.balance != "step":
        return []
    problems = list(_plan_problems(plan))
    found = [] if problems else find_statistics(gm.graph, run, loss, prediction, experts)
    if not problems and not found:
        problems.append((
            "the model computes no load-balancing statistic pipeplan can take over the step: "
            "a value that needs no gradient, made from the routing's top-k choice, read by "
            "the aux loss and by nothing the activations depend on",
            "return the model's aux loss (the example MoE's (logits, aux), or transformers' "
            "output_router_logits with loss = model and labels), or use balance = microbatch"))
    if problems:
        raise PlanError([Diagnostic(msg, plan.span_of("experts.balance"), hint)
                         for msg, hint in problems], plan.source_text or None, plan.sources)
    keys = []
    for node in found:
        with gm.graph.inserting_after(node):
            wrapped = gm.graph.call_function(step_statistic, (node, node.name))
        node.replace_all_uses_with(wrapped, delete_user_cb=lambda u: u is not wrapped)
        run.values[wrapped], run.costs[wrapped] = run.values[node], run.costs[node]
        keys.append(node.name)
    gm.recompile()
    return keys


def _plan_problems(plan: Plan) -> Iterator[tuple[str, str]]:
    why = "balance = step is built for pp x dp x ep"
    if plan.mesh.tp > 1:
        yield (f"{why}: with tp > 1 the statistics would be DTensors of the rewritten stage "
               "graph (not built)", "use balance = microbatch with tensor parallelism")
    if plan.mesh.cp > 1:
        yield (f"{why}: with cp > 1 each rank sees a slice of the sequence (not built)",
               "use balance = microbatch")
    if plan.zero == 3:
        yield (f"{why}: zero = 3 would gather parameters around the routing pre-pass too "
               "(not built)", "use zero <= 2, or balance = microbatch")


def find_statistics(graph: fx.Graph, run: MetaRun, loss: fx.Node,
                    prediction: Optional[fx.Node], experts: dict[str, str]) -> list[fx.Node]:
    """The statistics the module docstring defines, in graph order."""
    def grad(n) -> bool:
        v = run.values.get(n) if isinstance(n, fx.Node) else None
        return isinstance(v, torch.Tensor) and v.requires_grad

    order = list(graph.nodes)
    differentiable_before: set[fx.Node] = set()  # nodes with a differentiable ancestor
    decided: set[fx.Node] = set()  # nodes downstream of a routing decision
    for n in order:
        if any(grad(a) or a in differentiable_before for a in n.all_input_nodes):
            differentiable_before.add(n)
            v = run.values.get(n)
            if isinstance(v, torch.Tensor) and not (v.is_floating_point() or v.is_complex()):
                decided.add(n)  # an integer tensor made from differentiable values: top-k ids
        if any(a in decided for a in n.all_input_nodes):
            decided.add(n)
    calls = [n for n in order if n.op == "call_module" and n.target in experts.values()]
    # what the activations depend on: a statistic there would change them (and with them
    # the other statistics the routing pre-pass collects); loss = model: the loss itself
    forbidden = _ancestors(calls + ([prediction] if prediction is not None else []))
    feeds_loss = _ancestors([loss])
    out = []
    for n in order:
        v = run.values.get(n)
        if n.op in ("placeholder", "get_attr", "output") or not isinstance(v, torch.Tensor) \
                or v.requires_grad or not v.is_floating_point():
            continue
        if n not in decided or n not in feeds_loss or n in forbidden:
            continue
        if any(grad(u) for u in n.users):
            out.append(n)
    return out


def _ancestors(nodes: list[fx.Node]) -> set[fx.Node]:
    seen, todo = set(), list(nodes)
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(n.all_input_nodes)
    return seen

