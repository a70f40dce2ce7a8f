"""The partition rule: one stage's joint graph cut into F, B, W and BW graphs.

Over the joint graph's nodes (joint.py), with its outputs the stage outputs,
the input gradients and the weight gradients:

* F: every node the stage outputs are computed from (the forward);
* B: every other node an input gradient is computed from (reachable backwards
  from the input gradients) -- the gradient of what the previous stage sent;
* W: every other node a weight gradient is computed from -- what B does not
  compute, so no node runs in both;
* BW: B and W in one graph (schedules without a separate W).

A node F computes that B or W reads is *saved*: F returns it with the stage
outputs, and B/W take it as an input; a node B computes that W reads is
*handed* from B to W. The exception is a node computed from parameters and
buffers alone (a weight's transpose, a constant): it is not saved but
recomputed where it is read, so nothing that aliases a parameter is held from
F to W and only activations are saved. Random ops are never recomputed.
Recompute rules (`recompute`): F nodes inside a matched module region (tagged
with the region's mode when traced, joint.py) are not saved either -- under
`full` every one (functional collectives too: backward communicates again),
under `selective` those without matmul work (no entry in torch's FLOP counter)
and attention, so matmul outputs stay saved, and no collective; random ops are
never rerun. B recomputes the ones it or W reads
from the region's inputs (which are saved), and hands W what W reads of them.

Each graph is an `fx.GraphModule` with flat positional inputs and outputs,
described by `Key`s: ("p", i) primal i (parameter, buffer or stage input),
("t", j) tangent j, ("o", k) graph output k of the forward, ("g", i) the
gradient of primal i, ("v", name) a value one graph hands another.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.fx as fx

from .joint import RECOMPUTE_TAG, JointGraph

Key = tuple  # ("p", i) | ("t", j) | ("o", k) | ("g", i) | ("v", name)


@dataclass
class Part:
    """One graph of the partition, its inputs and outputs as keys."""

    name: str  # "F", "B", "W", "BW"
    gm: fx.GraphModule
    inputs: list[Key]
    outputs: list[Key]


@dataclass
class StageGraphs:
    """The partition of one stage's joint graph."""

    joint: JointGraph
    F: Part
    B: Part
    W: Part
    BW: Part

    def saved_keys(self) -> list[Key]:
        """What F hands to B, W or BW: saved values and the stage inputs they read."""
        later = {k for part in (self.B, self.W, self.BW) for k in part.inputs}
        return [k for k in later if k[0] == "v" and k in set(self.F.outputs)
                or k[0] == "p" and k[1] >= self.first_input]

    @property
    def first_input(self) -> int:
        return len(self.joint.param_names) + len(self.joint.buffer_names)


def split_joint(joint: JointGraph,
                recomputed: Optional[Callable[[fx.Node], bool]] = None) -> StageGraphs:
    """Partition `joint` by the rule in the module docstring; `recomputed(node)` tells
    which forward nodes a recompute region reruns (default: by the region tags the
    trace left, `dropped`)."""
    recomputed = recomputed or dropped
    graph = joint.gm.graph
    nodes = list(graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    placeholders = [n for n in nodes if n.op == "placeholder"]
    primals, tangents = placeholders[:joint.num_primals], placeholders[joint.num_primals:]
    flat = list(next(n for n in nodes if n.op == "output").args[0])
    fwd_outs, grads = flat[:len(joint.outputs)], flat[len(joint.outputs):]
    first_input = len(joint.param_names) + len(joint.buffer_names)
    weight_grads = [(i, g) for i, g in enumerate(grads[:len(joint.param_names)]) if g is not None]
    input_grads = [(i, grads[first_input + i]) for i in joint.grad_inputs
                   if grads[first_input + i] is not None]
    key_of: dict[fx.Node, Key] = {n: ("p", i) for i, n in enumerate(primals)}
    key_of.update((n, ("t", j)) for j, n in enumerate(tangents))
    weights_only = _weights_only(nodes, set(primals[first_input:]) | set(tangents))

    forward = _with_items(_ancestors([o for o in fwd_outs if isinstance(o, fx.Node)]), nodes)
    region = {n for n in forward if recomputed(n) and not _random(n)}
    region -= {n for n in region if _item(n) and n.args[0] not in region}  # tuples never cross
    b_nodes = _with_items(_ancestors([g for _, g in input_grads]) - forward, nodes)
    w_nodes = _ancestors([g for _, g in weight_grads]) - forward - b_nodes
    # recompute: what B or W read inside a region is computed again in B (W gets it from B)
    redo = _closure(_reads(b_nodes | w_nodes) & region, region)
    b_nodes |= redo
    w_nodes -= redo
    b_nodes |= _closure(_reads(b_nodes) & weights_only, forward & weights_only)
    w_nodes |= _closure(_reads(w_nodes) & weights_only, (forward | b_nodes) & weights_only)
    bw_nodes = b_nodes | w_nodes

    def part(name: str, members: set, wanted: list[tuple[Key, object]]) -> Part:
        return _extract(name, graph, members, wanted, key_of, order)

    ig = [(("g", first_input + i), g) for i, g in input_grads]
    wg = [(("g", i), g) for i, g in weight_grads]

    def outside(members: set, wanted: list) -> set:
        """The non-placeholder nodes a graph reads or returns without computing them."""
        return ((_reads(members) | {w for _, w in wanted if isinstance(w, fx.Node)})
                - members - set(placeholders))

    later = outside(b_nodes, ig) | outside(w_nodes, wg) | outside(bw_nodes, ig + wg)
    saved = sorted((n for n in later if n in forward and n not in redo), key=order.__getitem__)
    handed = sorted((n for n in outside(w_nodes, wg) if n in b_nodes), key=order.__getitem__)
    for n in saved + handed:
        key_of[n] = ("v", n.name)
    F = part("F", forward, [(("o", k), o) for k, o in enumerate(fwd_outs)]
             + [(key_of[n], n) for n in saved])
    B = part("B", b_nodes, ig + [(key_of[n], n) for n in handed])
    W = part("W", w_nodes, wg)
    BW = part("BW", bw_nodes, ig + wg)
    return StageGraphs(joint, F, B, W, BW)


def _attention_ops() -> set:
    aten = torch.ops.aten
    names = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
             "scaled_dot_product_attention")
    return {getattr(aten, n) for n in names if hasattr(aten, n)}


def dropped(node: fx.Node) -> bool:
    """Whether a forward node of the joint graph is rerun in the backward rather than saved:
    in a recompute region (its tag), under `full` always, under `selective` unless it is
    matmul work (an op torch's FLOP counter counts) other than attention; a functional
    collective under `full` only (compiler/recompute.dropped's rule: backward communicates
    again), never under `selective`."""
    from torch.utils.flop_counter import flop_registry

    mode = (node.meta.get("custom") or {}).get(RECOMPUTE_TAG)
    if mode is None or node.op != "call_function":
        return False
    packet = getattr(node.target, "overloadpacket", None)
    if packet is not None and packet._qualified_op_name.startswith("_c10d_functional"):
        return mode == "full"
    return mode == "full" or packet in _attention_ops() or packet not in flop_registry


def _ancestors(roots: list) -> set:
    """`roots` and every non-placeholder node they are computed from."""
    seen: set = set()
    stack = [r for r in roots if isinstance(r, fx.Node)]
    while stack:
        n = stack.pop()
        if n in seen or n.op == "placeholder":
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return seen


def _with_items(members: set, nodes: list) -> set:
    """`members` and every `getitem` of a multi-output node in it: tuples never cross graphs."""
    return members | {n for n in nodes if n.op == "call_function"
                      and n.target is operator.getitem and n.args[0] in members}


def _item(n: fx.Node) -> bool:
    return n.op == "call_function" and n.target is operator.getitem


def _reads(members: set) -> set:
    return {a for n in members for a in n.all_input_nodes}


def _closure(start: set, allowed: set) -> set:
    """`start` and everything in `allowed` it is computed from."""
    seen: set = set()
    stack = list(start)
    while stack:
        n = stack.pop()
        if n in seen or n not in allowed:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return seen


def _weights_only(nodes: list, varying: set) -> set:
    """Nodes computed from parameters, buffers and constants alone (no stage input, no
    tangent), random ops excluded: recomputing them where they are read is free of
    activation memory and gives the same value."""
    out: set = set()
    for n in nodes:
        if n.op != "call_function" or _random(n):
            continue
        if all((a.op == "placeholder" and a not in varying) or a in out
               for a in n.all_input_nodes):
            out.add(n)
    return out


def _random(n: fx.Node) -> bool:
    tags = getattr(n.target, "tags", ())
    return torch.Tag.nondeterministic_seeded in tags


def _extract(name: str, graph: fx.Graph, members: set, wanted: list, key_of: dict,
             order: dict) -> Part:
    """A GraphModule computing `wanted` ((key, node or None) pairs) from `members`, its
    inputs the nodes outside `members` it reads (each by its key)."""
    g = fx.Graph()
    env: dict = {}
    outside = sorted({a for n in members for a in n.all_input_nodes if a not in members}
                     | {w for _, w in wanted if isinstance(w, fx.Node) and w not in members},
                     key=order.__getitem__)
    inputs = []
    for a in outside:
        env[a] = g.placeholder(a.name)
        env[a].meta = dict(a.meta)
        inputs.append(key_of[a])
    for n in sorted(members, key=order.__getitem__):
        env[n] = g.node_copy(n, env.__getitem__)
    g.output(tuple(env[w] if isinstance(w, fx.Node) else w for _, w in wanted))
    # the joint graph's constants (get_attr: tensors the trace lifted) come along with it
    gm = fx.GraphModule(graph.owning_module or torch.nn.Module(), g, class_name=f"Stage{name}")
    return Part(name, gm, inputs, [k for k, _ in wanted])


def saved_bytes(graphs: StageGraphs) -> int:
    """Bytes F leaves for the backward of one microbatch: the distinct storages of the
    values it saves and of the stage inputs B/W read (from the traced values' metadata;
    the runtime measures the same on the real tensors)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    placeholders = [n for n in graphs.joint.gm.graph.nodes if n.op == "placeholder"]
    by_key = {("p", i): n for i, n in enumerate(placeholders)}
    produced = dict(zip(graphs.F.outputs, graphs.F.gm.graph.output_node().args[0]))
    storages: dict = {}
    for key in graphs.saved_keys():
        node = produced.get(key, by_key.get(key))
        val = node.meta.get("val") if isinstance(node, fx.Node) else None
        if isinstance(val, torch.Tensor):
            storage = val.untyped_storage()
            storages[StorageWeakRef(storage)] = storage.nbytes()
    return sum(storages.values())
