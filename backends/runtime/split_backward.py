"""Split backward without doing B's work twice: B keeps what W needs, W starts from there.

The autograd graph of one microbatch splits in two regions:

* the *input region* I: nodes on a path from the roots (stage outputs) to the
  stage inputs. B (`autograd.grad(roots, inputs)`) executes exactly these.
* the rest: nodes B never runs; every weight gradient is computed there, or
  on the edges leaving I.

A *seed* is a node of I with an edge into the rest that leads to a weight
(e.g. a Linear's AddmmBackward, whose weight edge is the expensive GEMM B
skips). During B a pre-hook saves each seed's incoming gradient. W then runs
one `autograd.grad` per seed, from `GradientEdge(seed, k)` with that saved
gradient, asking only for the weights reachable through the seed's edges into
the rest. Nothing in I runs again, and since no path from outside I re-enters
I, every weight-gradient contribution is computed exactly once.

The one case where a per-seed call would recompute I and count twice: a weight
reachable from a seed both through the rest and through the seed's edges into
I (a weight used twice in one stage, one use below the other). `plan_split`
detects it and returns None; the caller then falls back to W = the full
backward to the weights (correct, slower).

`SplitCache` keeps one stage's plans: every microbatch of a stage builds a
graph of the same shape, so the analysis runs once per shape and later
microbatches only walk their graph to map the cached seeds onto its nodes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge


@dataclass
class Seed:
    node: object  # torch.autograd.graph.Node
    params: list[torch.nn.Parameter]  # weights reachable through its edges outside I
    grads: Optional[tuple] = None  # its incoming gradients, saved during B


@dataclass
class SplitPlan:
    """What B must save and W must run for one microbatch."""

    seeds: list[Seed]
    free_roots: list[int]  # roots outside I (they reach no input): W starts from them directly
    free_params: list[torch.nn.Parameter]  # weights reachable from those roots


def _node(t: torch.Tensor):
    return get_gradient_edge(t).node


def plan_split(roots: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
               params: Sequence[torch.nn.Parameter]) -> Optional[SplitPlan]:
    """Find the seeds of this microbatch's graph; None when the split would double count."""
    root_nodes = [r.grad_fn for r in roots]
    input_nodes = {_node(x) for x in inputs}
    param_of = {_node(p): p for p in params}
    children: dict = {}
    order: list = []  # post-order: children before parents
    stack = [(n, False) for n in root_nodes if n is not None]
    while stack:
        n, done = stack.pop()
        if done:
            order.append(n)
            continue
        if n in children:
            continue
        children[n] = [c for c, _ in n.next_functions if c is not None]
        stack.append((n, True))
        stack.extend((c, False) for c in children[n] if c not in children)
    reaches_input: dict = {}
    weights: dict = {}  # node -> frozenset of param ids reachable from it
    for n in order:
        kids = children[n]
        reaches_input[n] = n in input_nodes or any(reaches_input.get(c, False) for c in kids)
        below = {id(param_of[n])} if n in param_of else set()
        for c in kids:
            below |= weights.get(c, frozenset())
        weights[n] = frozenset(below)
    by_id = {id(p): p for p in params}
    seeds = []
    for n in order:
        if not reaches_input[n]:
            continue
        outside = set().union(*(weights[c] for c in children[n] if not reaches_input[c]))
        if not outside:
            continue
        inside = set().union(*(weights[c] for c in children[n] if reaches_input[c]))
        if outside & inside:
            return None  # a weight used on both sides of this node: see the module docstring
        seeds.append(Seed(n, [by_id[i] for i in sorted(outside)]))
    free_roots = [i for i, n in enumerate(root_nodes) if n is not None and not reaches_input[n]]
    free = set().union(*(weights[root_nodes[i]] for i in free_roots))
    return SplitPlan(seeds, free_roots, [by_id[i] for i in sorted(free)])


class SplitCache:
    """`plan_split` once per graph shape, for one stage's weights (its microbatches share one).

    The shape of a graph is, in a fixed depth-first walk from its roots, each
    node's type, the positions of its children, and which input or weight each
    leaf is. Two graphs of one shape have their seeds at the same positions, so
    a hit maps the cached positions onto the new graph's nodes: the SplitPlan
    `plan_split` would return, seeds in the same order. The walk costs about a
    third of the analysis.
    """

    def __init__(self, params: Sequence[torch.nn.Parameter]):
        self.params = list(params)
        self._leaf = {id(p): ("weight", k) for k, p in enumerate(self.params)}
        self._plans: dict = {}  # shape -> (seed positions and weights, free roots, free weights)

    def plan(self, roots: Sequence[torch.Tensor],
             inputs: Sequence[torch.Tensor]) -> Optional[SplitPlan]:
        order, shape = self._shape(roots, inputs)
        if shape not in self._plans:
            plan = plan_split(roots, inputs, self.params)
            at = {n: i for i, n in enumerate(order)}
            self._plans[shape] = None if plan is None else (
                [(at[s.node], s.params) for s in plan.seeds], plan.free_roots, plan.free_params)
        cached = self._plans[shape]
        if cached is None:
            return None
        seeds, free_roots, free_params = cached
        return SplitPlan([Seed(order[i], ps) for i, ps in seeds], free_roots, free_params)

    def _shape(self, roots, inputs) -> tuple[list, tuple]:
        """The graph's nodes in depth-first order from the roots, and its shape."""
        leaf = dict(self._leaf)
        leaf.update((id(x), ("input", k)) for k, x in enumerate(inputs))
        root_nodes = [r.grad_fn for r in roots]
        at: dict = {}
        order: list = []
        kids: list = []
        stack = [n for n in reversed(root_nodes) if n is not None]
        while stack:
            n = stack.pop()
            if n in at:
                continue
            at[n] = len(order)
            order.append(n)
            children = [c for c, _ in n.next_functions]
            kids.append(children)
            stack.extend(c for c in reversed(children) if c is not None and c not in at)
        types = tuple(map(type, order))
        leaves = tuple(leaf.get(id(n.variable)) if hasattr(n, "variable") else None
                       for n in order)
        get = at.get
        return order, (tuple(map(get, root_nodes)), types,
                       tuple(tuple(map(get, k)) for k in kids), leaves)


def backward_input(plan: SplitPlan, roots, root_grads, inputs) -> tuple:
    """B: input gradients, saving each seed's incoming gradient for W."""
    handles = []
    for seed in plan.seeds:
        def save(grad_outputs, seed=seed):
            seed.grads = tuple(grad_outputs)
        handles.append(seed.node.register_prehook(save))
    try:
        return torch.autograd.grad(roots, inputs, root_grads, retain_graph=True,
                                   allow_unused=True)
    finally:
        for h in handles:
            h.remove()


def backward_weight(plan: SplitPlan, roots, root_grads) -> dict[int, torch.Tensor]:
    """W: weight gradients by id(param), from the seeds (and roots outside I) only."""
    out: dict[int, torch.Tensor] = {}

    def add(params, grads):
        for p, g in zip(params, grads):
            if g is not None:
                out[id(p)] = g if id(p) not in out else out[id(p)] + g

    for seed in plan.seeds:
        if seed.grads is None:
            continue
        edges = [(GradientEdge(seed.node, k), g) for k, g in enumerate(seed.grads) if g is not None]
        if edges:
            add(seed.params, torch.autograd.grad([e for e, _ in edges], seed.params,
                                                 [g for _, g in edges], retain_graph=True,
                                                 allow_unused=True))
    if plan.free_roots and plan.free_params:
        add(plan.free_params, torch.autograd.grad(
            [roots[i] for i in plan.free_roots], plan.free_params,
            [root_grads[i] for i in plan.free_roots], retain_graph=True, allow_unused=True))
    return out


def disjoint(plan: SplitPlan) -> bool:
    """Whether every weight is reached from one seed (or the free roots) only: then W can
    let autograd add each gradient into `.grad` with nothing summed outside it."""
    groups = [seed.params for seed in plan.seeds] + [plan.free_params]
    return sum(map(len, groups)) == len({id(p) for ps in groups for p in ps})


def accumulate_weight(plan: SplitPlan, roots, root_grads) -> None:
    """W into `.grad` (`disjoint` plans): from the seeds (and roots outside I) only, each
    weight's gradient added by autograd as it is produced, never copied."""
    for seed in plan.seeds:
        if seed.grads is None:
            continue
        edges = [(GradientEdge(seed.node, k), g) for k, g in enumerate(seed.grads) if g is not None]
        if edges:
            torch.autograd.backward([e for e, _ in edges], [g for _, g in edges],
                                    inputs=seed.params, retain_graph=True)
    if plan.free_roots and plan.free_params:
        torch.autograd.backward([roots[i] for i in plan.free_roots],
                                [root_grads[i] for i in plan.free_roots],
                                inputs=plan.free_params, retain_graph=True)
