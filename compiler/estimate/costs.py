"""Per-node training cost after applying the plan: experts at top-k, recompute rules.

The analysis pass measures what the graph computes. Two plan facts change what
training really costs:

* MoE layers (plan.experts.modules): a reference MoE may run every expert on
  every token for exact dropless math, but dispatched for real each token
  visits top_k experts, so FLOPs and saved bytes of ops reading the stacked
  expert weights (dim 0 == num_experts) and producing an every-expert axis
  count top_k / num_experts of that. Grouped-matmul experts (transformers'
  default) already compute routed tokens only and are counted as they are.
  A MoE traced as a leaf with a data-dependent dispatch loop runs with
  everything selected, so each expert takes all T·top_k (token, slot) pairs
  (transformers' eager pattern); it counts 1 / num_experts of that.
* context parallel: an attention op's meta run costs one block of the local slice; a cp
  rank runs more (parallel/cp.py: attention_blocks), so its FLOPs and work repeat.
* recompute rules (compiler/recompute.py): `full` reruns a module's forward in
  backward, `selective` its nodes without matmul work and attention. What a
  stage keeps is compiler/estimate/activations.py's to count.

Backward costs two forwards (grad w.r.t. inputs, B, and w.r.t. weights, W, one
each) — the usual matmul accounting.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.fx as fx

from ...dsl.ast import Plan
from ..capture.analysis import MetaRun
from ..capture.blocks import module_path
from ..patterns import matches, outermost_match
from ..recompute import Region, dropped, recompute_mode
from ..capture.work import Work

_VIEWS = {"view", "reshape", "transpose", "permute", "t", "expand", "contiguous", "unsqueeze",
          "squeeze", "flatten"}


@dataclass(frozen=True)
class Cost:
    """One node, one microbatch."""

    flops: float  # forward
    saved_bytes: int  # saved for backward, no recompute (a stage's: activations.py)
    recompute_flops: float = 0.0  # forward rerun during backward
    ops: int = 0  # aten ops the forward dispatches
    recompute_ops: int = 0  # ... rerun during backward
    work: Work = Work()  # what the forward asks of a device (work.py), before `scale`
    scale: float = 1.0  # the share of its work and saves training runs (experts at top-k)
    repeat: float = 1.0  # how many times a rank runs its work (cp's attention blocks), saves
    # not repeated

    @property
    def total(self) -> float:
        """Forward + backward (B and W, one forward each) + recompute."""
        return 3 * self.flops + self.recompute_flops


def node_costs(plan: Plan, graph: fx.Graph, run: MetaRun) -> dict[fx.Node, Cost]:
    """Per node: forward FLOPs (experts at top-k), the FLOPs and ops a recompute rule reruns,
    and the share of what it saves that counts (experts at top-k; what a stage keeps is
    activations.py's to count)."""
    costs = {}
    experts_calls = _experts_calls(plan, graph, run)
    blocks = _attention_blocks(plan, graph)
    for node in graph.nodes:
        measured = run.costs.get(node)
        if measured is None:
            continue
        flops = measured.flops
        path = module_path(node)
        routed = experts_calls.get(node)
        if routed is not None:  # an experts call (compiler/parallel/ep_cost.py)
            scale = min(1.0, routed / flops) if flops else 1.0
            flops = routed
        else:
            scale = _expert_scale(plan, node, path, run)
            flops = flops * scale
        repeat = blocks.get(node, 1.0)
        flops = flops * repeat
        mode, _ = recompute_mode(plan.recompute, path)
        reruns = mode != "none" and dropped(Region("", mode), node, measured.flops)
        recompute = flops if reruns else 0.0
        costs[node] = Cost(flops, int(measured.saved_bytes * scale), recompute, measured.ops,
                           measured.ops if reruns else 0, measured.work, scale, repeat)
    return costs


def _attention_blocks(plan: Plan, graph: fx.Graph) -> dict[fx.Node, float]:
    if plan.mesh.cp == 1:
        return {}
    from ..parallel.cp import attention_blocks
    return attention_blocks(plan, graph)


def _experts_calls(plan: Plan, graph: fx.Graph, run: MetaRun) -> dict[fx.Node, float]:
    """Routed forward FLOPs of each experts call of the plan's MoE layers."""
    if plan.experts is None:
        return {}
    from ..parallel.ep import find_experts
    from ..parallel.ep_cost import experts_call_flops
    out = {}
    for node in graph.nodes:
        if node.op != "call_module" or len(node.args) < 3:
            continue
        if find_experts(run.gm.get_submodule(node.target), plan.experts.num_experts) != "":
            continue
        flops = experts_call_flops(node, run, plan.experts.num_experts)
        if flops is not None:
            out[node] = flops
    return out


def _expert_scale(plan: Plan, node: fx.Node, path: Optional[str], run: MetaRun) -> float:
    ex = plan.experts
    if ex is None or path is None or ex.num_experts <= 0:
        return 1.0
    if not any(outermost_match(path, p) for p in ex.modules):
        return 1.0
    if node.op == "call_module" and any(matches(path, p) for p in ex.modules):
        # a MoE block traced as a leaf: its data-dependent dispatch ran with everything
        # selected (analysis.py): each expert took all T*top_k (token, slot) pairs, where
        # real routing sends T*top_k pairs to the experts in total
        return 1.0 / ex.num_experts
    out = run.values.get(node)
    if not isinstance(out, torch.Tensor) or ex.num_experts not in out.shape:
        return 1.0  # no every-expert axis: already computed per routed token (grouped mm)
    for a in _through_views(node):
        if a.op == "get_attr":
            v = run.value(a)
            if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == ex.num_experts:
                return min(1.0, ex.top_k / ex.num_experts)
    return 1.0


def _through_views(node: fx.Node):
    """The node's inputs, looking through view-like ops (a transposed expert weight...)."""
    for a in node.all_input_nodes:
        yield a
        if a.op == "call_method" and a.target in _VIEWS or \
                a.op == "call_function" and getattr(a.target, "__name__", "") in _VIEWS:
            yield from _through_views(a)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def param_bytes_per_node(gm: fx.GraphModule, nodes: list[fx.Node]) -> dict[fx.Node, int]:
    """Parameter bytes per compute node (the `params` split basis); each parameter counts once,
    at its first use (a call_module's own weights, or a get_attr read)."""
    params = {n: p for n, p in gm.named_parameters(remove_duplicate=False)}
    out: dict[fx.Node, int] = {}
    seen: set[int] = set()
    for node in nodes:
        tensors = list(gm.get_submodule(node.target).parameters()) \
            if node.op == "call_module" else []
        tensors += [params[a.target] for a in node.all_input_nodes
                    if a.op == "get_attr" and a.target in params]
        total = 0
        for t in tensors:
            if id(t) not in seen:
                seen.add(id(t))
                total += _nbytes(t)
        out[node] = total
    return out
