"""Per-op time on a device profile: each node's work (work.py) under the plan's tensor split.

The model (docs/compiler.md, "The time model"):

* a matmul-like kernel (its local M, N, K) takes max(FLOPs / (peak x gemm_peak),
  bytes / (bandwidth x memory)): a roofline, so thin products (attention's scores with a
  head dimension of 64-160, a TP-split layer's few columns) are bound by memory;
* a memory-bound kernel (norm, activation, softmax, dropout, elementwise, copy) takes
  bytes moved / (bandwidth x memory);
* host time per aten op where the profile has one (the measured CPU: dispatch and
  autograd bookkeeping, cpu_probe.py): forward ops in F, backward's split between B and W;
* backward: each matmul's two products (the input gradient in B; the weight gradient in W
  when one operand is a parameter, else in B too) at the forward's shape; memory-bound
  kernels read and write twice the forward's bytes, in B; nodes recomputed (full or
  selective) run their forward again in B;
* a stage no input gradient leaves (the first: token ids) does nothing in B: its W is the
  whole backward (backends/runtime/stage.py; a compiled stage's B graph is empty there);
* the optimizer step: its bytes over memory bandwidth (predict.timing_of), and on a host
  that pays per op, the ops torch's single-tensor AdamW or SGD dispatches in a step and per
  tensor it steps (`optimizer_ops`: the measured CPU's probe counts them running it as
  backends/runtime/optim.py builds it, foreach off) x the host time per op;
* a separate W in eager mode makes one autograd call per weight-using op on the path
  from the stage's inputs (backends/runtime/split_backward.py: its seeds; `weight_seeds`
  counts them in the stage graph), each costing the host the measured CPU's
  `split_call_s` beyond the fused backward (OpTimes.split; a compiled stage's W is one
  graph call).

Tensor parallel divides what the rewrite splits, found by following the graph: a
column-parallel layer's N and a row-parallel layer's K are 1/tp, every node reading a value
computed between them (a column output's views, the attention core, the activation) does
1/tp of its work (its batch dimension), and a row layer's output is whole again; under
sequence parallel the whole values' memory-bound kernels also run on 1/tp of the sequence.
Floats move in the plan's compute precision (bf16: 2 bytes).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Optional

import torch.fx as fx

from ...dsl.ast import Plan
from ..capture.blocks import module_path
from ..capture.work import Gemm
from ..compiled import BATCH
from ..parallel.ep import experts_dispatched
from .costs import Cost
from .devices import DeviceProfile, dtype_of


@dataclass(frozen=True)
class OpTimes:
    """One stage's compute seconds per microbatch, by action."""

    f: float
    b: float
    w: float
    split: float = 0.0  # what a separate W costs beyond its share of the fused BW (host)


def _float_bytes(plan: Plan) -> int:
    return {"bf16": 2, "fp64": 8}.get(plan.train.precision, 4)


def gemm_time(g: Gemm, dev: DeviceProfile, peak: float, float_bytes: int) -> float:
    """A roofline: the slower of its FLOPs at the sustained GEMM rate (a fused attention
    kernel: the profile's measured rate at its head dimension, where it has one) and its
    operands' and result's bytes at the sustained memory bandwidth."""
    rate = attention_rate(dev, g.k / 2) if g.attention and dev.attention else \
        peak * dev.efficiency.gemm_peak
    return max(g.flops / rate, g.elements * float_bytes / _bandwidth(dev))


def attention_rate(dev: DeviceProfile, head_dim: float) -> float:
    """The profile's fused-attention FLOP/s at `head_dim`: its measured points interpolated
    in log(head dim), the nearest end outside them."""
    return _interpolated(dev.attention, head_dim, 1)


def attention_backward(dev: DeviceProfile, head_dim: float) -> float:
    """A fused attention's backward time over its forward's: measured (the profile's
    points), else 2 (its two products per forward product, as any matmul)."""
    return _interpolated(dev.attention, head_dim, 2) if dev.attention else 2.0


def _interpolated(points, x: float, column: int) -> float:
    pts = sorted(points)
    if x <= pts[0][0]:
        return pts[0][column]
    for (x0, *a), (x1, *b) in zip(pts, pts[1:]):
        if x <= x1:
            t = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return a[column - 1] + t * (b[column - 1] - a[column - 1])
    return pts[-1][column]


def memory_time(elements: float, other_bytes: float, dev: DeviceProfile, float_bytes: int,
                div: float = 1.0) -> float:
    """Memory-bound kernels: bytes moved over the sustained memory bandwidth."""
    return (elements * float_bytes + other_bytes) / div / _bandwidth(dev)


def _bandwidth(dev: DeviceProfile) -> float:
    """Sustained memory bandwidth; a profile without one (the measured CPU: host time per op
    dominates) moves bytes for free."""
    bw = dev.memory_bandwidth * dev.efficiency.memory
    return bw if bw > 0 else float("inf")


def shard(g: Gemm, kind: Optional[str], tp: int) -> Gemm:
    """The local shape on one TP rank: column/vocab N/tp, row K/tp, else batch/tp."""
    if tp <= 1:
        return g
    if kind in ("column", "vocab"):
        return replace(g, n=max(1, g.n // tp))
    if kind == "row":
        return replace(g, k=max(1, g.k // tp))
    if g.batch >= tp:
        return replace(g, batch=g.batch // tp)
    return replace(g, m=max(1, g.m // tp))


def split_kinds(graph: fx.Graph, tp_kinds: dict[str, str], tp: int,
                costs: dict[fx.Node, Cost]) -> dict[fx.Node, str]:
    """Each node the TP rewrite splits -> its kind ("column", "row", "vocab", or "inner": it
    reads a value split between a column and a row layer). Nodes kept whole are absent. A
    vocab-parallel lookup (no matmul) writes its rows whole; a vocab-parallel head splits
    its logits."""
    if tp <= 1 or not tp_kinds:
        return {}
    out, split_values = {}, set()
    for node in graph.nodes:
        kind = tp_kinds.get(module_path(node) or "") if _calls_module(node) else None
        if kind == "vocab" and not (node in costs and costs[node].work.gemms):
            kind = None  # an embedding lookup: its output is all-reduced whole
        if kind is not None:
            out[node] = kind
            if kind != "row":
                split_values.add(node)
        elif any(a in split_values for a in node.all_input_nodes):
            out[node] = "inner"
            split_values.add(node)
    return out


def _calls_module(node: fx.Node) -> bool:
    return node.op == "call_module" or (
        node.op == "call_function" and any(a.op == "get_attr" for a in node.all_input_nodes))


@dataclass
class StageWork:
    """One stage's ops per microbatch, grouped so a device can cost them in a few steps (and
    a planner can re-cost them for another device or tp without tracing again):
    gemms (shape, TP kind, recomputed) -> count; memory-bound (split, recomputed) ->
    [float elements, other bytes, kernels]."""

    gemms: dict = field(default_factory=dict)
    memory: dict = field(default_factory=dict)
    ops: int = 0  # aten ops the forward dispatches (host time on a CPU)
    recompute_ops: int = 0
    seeds: int = 0  # autograd calls a separate W makes (weight_seeds)
    input_grads: bool = True  # False: no gradient leaves the stage, B does nothing

    def add(self, cost: Cost, kind: Optional[str]) -> None:
        rec = bool(cost.recompute_ops or cost.recompute_flops)
        self.ops += cost.ops
        self.recompute_ops += cost.recompute_ops
        share = cost.scale * cost.repeat
        for g in cost.work.gemms:
            key = (g, kind, rec)
            self.gemms[key] = self.gemms.get(key, 0.0) + share
        w = cost.work
        m = self.memory.setdefault((kind is not None, rec), [0.0, 0.0, 0])
        m[0] += w.float_elements * share
        m[1] += w.other_bytes * share
        m[2] += w.kernels


def stage_work(graph: fx.Graph, nodes: list[fx.Node], stage_of, costs: dict[fx.Node, Cost],
               tp_kinds: dict[str, str], tp: int, stages: list) -> list[StageWork]:
    """Per stage (`stages`: their StageSpecs), its nodes' work (`stage_of(i)`: the stage of
    nodes[i]), its split backward's calls and whether a gradient leaves it."""
    kinds = split_kinds(graph, tp_kinds, tp, costs)
    out = [StageWork(seeds=weight_seeds(st), input_grads=takes_input_grads(st))
           for st in stages]
    for i, node in enumerate(nodes):
        c = costs.get(node)
        if c is not None:
            out[stage_of(i)].add(c, kinds.get(node))
    return out


def op_times(plan: Plan, work: StageWork, dev: DeviceProfile) -> OpTimes:
    """(F, B, W) seconds of one stage per microbatch on one rank (recompute in B)."""
    tp, fb = plan.mesh.tp, _float_bytes(plan)
    peak = dev.flops[dtype_of(plan)]
    f = b = w = 0.0
    for (g, kind, rec), n in work.gemms.items():
        t = gemm_time(shard(g, kind, tp if kind else 1), dev, peak, fb) * n
        f += t
        b += t * (2 if rec else 1)
        if g.attention:  # both products of each forward one are input gradients
            b += t * (attention_backward(dev, g.k / 2) - 1)
        elif kind in ("column", "row", "vocab") or g.batch == 1:
            w += t  # a product with a weight: its second product is the weight gradient
        else:
            b += t  # two activations (attention): both products are input gradients
    sp = plan.tensor.sequence_parallel
    for (split, rec), (elements, other, _) in work.memory.items():
        t = memory_time(elements, other, dev, fb, tp if split or sp else 1)
        f += t
        b += t * (3 if rec else 2)  # backward reads and writes twice; recompute once more
    op_s, op_b = dev.op_s, dev.op_backward_s
    if on_dtensors(plan, work):  # eager tp: every op also pays DTensor's dispatch
        op_s, op_b = op_s + dev.dtensor_op_s, op_b + dev.dtensor_op_backward_s
    host_b = work.ops * op_b / 2  # host time per op (a CPU): B and W halve it
    b, w = b + host_b + work.recompute_ops * op_s, w + host_b
    if not work.input_grads:  # nothing to send back: W is the whole backward, one call
        return OpTimes(f + work.ops * op_s, 0.0, b + w)
    calls = work.seeds * dev.split_call_s if plan.compile.mode == "eager" else 0.0
    return OpTimes(f + work.ops * op_s, b, w, calls)


def takes_input_grads(spec) -> bool:
    """Does a gradient leave the stage: an input received from the stage before that a
    gradient flows back to (the runtime's StageRunner.grad_inputs)."""
    return any(r.source != BATCH and r.requires_grad for r in spec.inputs)


def weight_seeds(spec) -> int:
    """The autograd calls the runtime's separate W makes for the stage (eager mode; one per
    seed of backends/runtime/split_backward.py), counted in its graph: each op on a path
    from an input a gradient flows back to that reads a trainable parameter or a value
    computed from parameters off that path (a module call: one per submodule owning
    parameters), and one more when an output is off the path but computed from parameters
    (its free roots)."""
    module = spec.module
    if module is None or not takes_input_grads(spec):
        return 0
    grad_in = {r.name for r in spec.inputs if r.source != BATCH and r.requires_grad}
    trainable = {n for n, p in module.named_parameters(remove_duplicate=False)
                 if p.requires_grad}
    on_path: set = set()  # nodes a gradient of the inputs flows through
    weighted: set = set()  # nodes off that path computed from trainable parameters
    seeds = 0
    for node in module.graph.nodes:
        if node.op == "placeholder":
            if node.target in grad_in:
                on_path.add(node)
            continue
        if node.op == "get_attr":
            if node.target in trainable:
                weighted.add(node)
            continue
        if node.op == "output":
            outs = [a for a in node.all_input_nodes]
            seeds += int(any(a in weighted and a not in on_path for a in outs))
            continue
        owners = _owners(module, node)
        ins = node.all_input_nodes
        if any(a in on_path for a in ins):
            on_path.add(node)
            seeds += owners + int(any(a in weighted for a in ins))
        elif owners or any(a in weighted for a in ins):
            weighted.add(node)
    return seeds


def _owners(module, node: fx.Node) -> int:
    """Submodules owning trainable parameters of the module a call_module node calls."""
    if node.op != "call_module":
        return 0
    return sum(1 for m in module.get_submodule(node.target).modules()
               if any(p.requires_grad for p in m.parameters(recurse=False)))


def dtensor_host(plan: Plan, dev: Optional[DeviceProfile], tensors: int,
                 collectives: tuple[int, int]) -> tuple[float, float]:
    """(F, B) host seconds per microbatch eager tensor parallelism adds to a stage around its
    ops (their own dispatch is in op_times): each tensor its rewrite wraps as a DTensor
    (`tensors`: predict.wrapped; forward, and the rest of the round trip
    in backward) and each redistribution's Python beyond its collective (`collectives`: the
    stage's TP collectives per microbatch in the forward and in the backward,
    predict.tp_passes' placement). Zero where the stage runs no collective (nothing
    rewritten), outside eager mode, and on devices without a measured host
    (accelerators)."""
    if dev is None or not sum(collectives) or plan.mesh.tp <= 1 or \
            plan.compile.mode != "eager":
        return 0.0, 0.0
    f, b = (n * dev.dtensor_redistribute_s for n in collectives)
    return tensors * dev.dtensor_wrap_s + f, tensors * dev.dtensor_wrap_backward_s + b


def host_around(plan: Plan, dev: Optional[DeviceProfile], tensors: int,
                collectives: tuple[int, int], experts_calls: int,
                ep: int) -> tuple[float, float]:
    """(F, B) host seconds per microbatch a stage's runtime adds around its ops: eager
    tensor parallelism's DTensors (`dtensor_host`) and the expert dispatcher
    (`dispatch_host`). Check (predict.action_costs) and the planner both call it."""
    f, b = dtensor_host(plan, dev, tensors, collectives)
    df, db = dispatch_host(plan, dev, experts_calls, ep)
    return f + df, b + db


def dispatch_host(plan: Plan, dev: Optional[DeviceProfile], calls: int,
                  ep: int) -> tuple[float, float]:
    """(F, B) host seconds per microbatch the expert dispatcher (compiler/parallel/
    ep_dispatch.routed_call) adds to a stage around its `calls` experts calls at `ep`
    expert-parallel ranks: the measured CPU's time per call (cpu_probe.measure_dispatch:
    expert parallel, with or without a capacity, or a capacity on one rank), beyond the
    experts' own ops (op_times) and the all-to-alls' bytes and latencies
    (predict.action_costs). Zero where nothing is dispatched (parallel.ep.
    experts_dispatched), for the static dispatch (compiled
    stages: the all-to-alls are inside one graph) and on devices without a measured host
    (accelerators); measured at 2 expert-parallel ranks and used at every ep."""
    if dev is None or not dev.dispatch_s or not calls or not experts_dispatched(plan, ep) or \
            plan.compile.graphs:
        return 0.0, 0.0
    case = "capacity" if ep <= 1 else "ep" if plan.experts.dropless else "ep_capacity"
    f, b = next((f, b) for c, f, b in dev.dispatch_s if c == case)
    return calls * f, calls * b


def on_dtensors(plan: Plan, work: StageWork) -> bool:
    """Does the runtime run this stage's ops on DTensors: eager mode (graphs and inductor
    call traced graphs of plain tensors) on a stage with a tensor-parallel matmul
    (backends/parallel/tp/dtensor.py)?"""
    return plan.mesh.tp > 1 and plan.compile.mode == "eager" and \
        (any(kind for _, kind, _ in work.gemms) or any(split for split, _ in work.memory))


def optimizer_ops(spec, dev: DeviceProfile) -> tuple[int, int]:
    """(ops per step, ops per tensor) the plan's optimizer (dsl OptimizerSpec) dispatches in
    a step on `dev`'s host: what the measured CPU's probe counted running torch's own
    single-tensor AdamW or SGD (cpu_probe.count_optimizer_ops); none on accelerators."""
    key = (spec.name, spec.weight_decay != 0.0, spec.name == "sgd" and spec.momentum != 0.0)
    for name, decay, momentum, fixed, per in dev.optimizer_ops:
        if (name, decay, momentum) == key:
            return fixed, per
    return 0, 0
