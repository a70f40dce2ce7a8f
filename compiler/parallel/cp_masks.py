"""Attention masks and positions under context parallel: the model's own mask code, run on
the whole sequence.

The model is captured at one cp rank's slice of the sequence (S/cp), so a mask tensor it
builds for `scaled_dot_product_attention` is the mask of a sequence S/cp long: wrong for
every rank (its queries see keys of the whole sequence). `whole_sequence_masks` rewrites
the captured graph so that each SDPA mask is the model's own mask code evaluated on the
whole sequence:

1. The model is captured a second time at the whole length S (`capture_whole`). Graphs
   captured at both lengths pair up node by node (deterministic names and targets; a
   model whose code branches on the length is refused). An `arange(0, n)` whose length is
   S/cp in one and S in the other numbers the sequence: it is marked POSITIONS and
   renumbered to each rank's global positions at run time (backends/parallel/cp/positions.py)
   -- the positions torch.export bakes as a literal length, which fx ties by its `x.shape`;
   a constant sliced to S/cp rows from a start (S in the twin) is marked POSITION_SLICE and
   taken at the rank's positions (`mark_positions`, run before the locality walk).
2. For each SDPA call taking a mask, the mask's backward slice (everything it is computed
   from) must reach only the model's inputs (token ids, positions, a padding mask: values
   every rank can gather) and constants. A slice reaching a parameter, a buffer or a module
   call is refused at the plan line with the node named: the mask would depend on an
   activation, which no rank holds for the whole sequence.
3. The slice taken from the whole-length graph becomes a program (`WholeSequenceMask`,
   a call_module node replacing the mask argument) whose inputs are the model inputs it
   reads. At run time each of them is gathered over the cp group in the data layout's order
   (a contiguous block per rank, or ring attention's chunks r and 2cp-1-r), and the model's
   own code computes the [.., S, S] mask. Ulysses uses it whole (its head block where the
   mask has one per head); ring attention takes, per K/V block, the rows of this rank's
   positions and the columns of the block's (backends/parallel/cp/ring.py).

The local mask code, dead after the rewrite, is removed.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch
import torch.fx as fx
from torch import nn
from torch.utils._pytree import tree_map_only

from ...dsl.ast import Plan
from ...dsl.errors import PlanError
from ..capture.analysis import fetch_attr
from .cp import (ARANGE, LITERAL, POSITION_SLICE, POSITIONS, WHOLE_MASK, attention_nodes,
                 attn_mask, sdpa_arguments)



class WholeSequenceMask(nn.Module):
    """The model's own mask code (`program`, from the whole-length capture) on whole-sequence
    inputs. `gather(tensor, dim)` (set by the runtime, backends/parallel/cp/positions.py)
    gathers one input over the cp group along its sequence dim in the sequence's order;
    without it (the compiler's meta run) the whole-length shapes are made up on meta."""

    cp_rule = "full"  # to the locality walk: no slice of the sequence in it (a constant)

    def __init__(self, program: fx.GraphModule, seq_dims: tuple, cp: int):
        super().__init__()
        self.program, self.seq_dims, self.cp = program, seq_dims, cp
        self.gather: Optional[Callable] = None
        self._device: Optional[torch.device] = None

    def forward(self, like: torch.Tensor, *inputs):
        """`like`: the attention's query, whose device the mask is made on (export spells
        the capture device out in the program's factory ops)."""
        if like.device != self._device:
            self._move(like.device)
        whole = []
        for t, dim in zip(inputs, self.seq_dims):
            if dim is None:
                whole.append(t)
            elif self.gather is not None:
                whole.append(self.gather(t, dim))
            elif t.device.type == "meta":
                whole.append(torch.cat([t] * self.cp, dim))
            else:
                raise RuntimeError("WholeSequenceMask runs under context parallel only "
                                   "(its inputs are gathered over the cp group)")
        return self.program(*whole)

    def _move(self, device: torch.device) -> None:
        for n in self.program.graph.nodes:
            n.args, n.kwargs = tree_map_only(torch.device, lambda d: device, (n.args, n.kwargs))
        self.program.recompile()
        self._device = device


def capture_whole(plan: Plan, model: nn.Module):
    """The model captured at the whole sequence length (a plan with cp = 1 otherwise alike)."""
    from ..capture.capture import capture
    from ..capture.traced import example_inputs

    whole = dataclasses.replace(plan, mesh=dataclasses.replace(plan.mesh, cp=1))
    return capture(whole, model, example_inputs(whole))


def _key(plan: Plan) -> str:
    return "context.method" if "context.method" in plan.spans else "mesh.cp"


def _arange_range(node: fx.Node):
    """(start, end, step) of an arange call, literal ints or nodes."""
    a, kw = node.args, node.kwargs
    if len(a) >= 2:
        return a[0], a[1], a[2] if len(a) > 2 else kw.get("step", 1)
    return kw.get("start", 0), a[0] if a else kw.get("end"), kw.get("step", 1)


SLICE = torch.ops.aten.slice.Tensor


def mark_positions(plan: Plan, gm: fx.GraphModule, run, whole: "Whole",
                   seq_inputs: dict) -> int:
    """Mark what numbers this rank's slice of the sequence from 0 where the model's code
    reads only the length, as torch.export bakes it (a literal S/cp, S in the whole-length
    twin): each `arange(0, S/cp)` (POSITIONS) and each slice of a constant -- a parameter,
    a buffer, a table whose shape does not follow the sequence -- to S/cp rows from a start
    along a dim (POSITION_SLICE: dim and start; BERT's `position_ids[:, :seq]`). The runtime
    takes both at the rank's own positions (backends/parallel/cp/positions.py). The
    locality walk (cp_locality.py) follows a slice's rows as laid along the sequence; an
    arange (LITERAL) it leaves unfollowed, as the masks built from it are rebuilt whole
    (whole_sequence_masks, cp_regions.py). Returns how many; captures the whole length
    only where there is a candidate."""
    if plan.mesh.cp == 1:
        return 0
    local, full = plan.data.seq_len // plan.mesh.cp, plan.data.seq_len
    aranges = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in ARANGE
               and not n.meta.get(POSITIONS) and _arange_range(n)[1] == local]
    inputs = model_inputs(gm, seq_inputs)
    slices = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is SLICE
              and POSITION_SLICE not in n.meta and _constant_slice(n, run, inputs, local)]
    if not (aranges or slices):
        return 0
    twins = {n.name: n for n in whole.module.graph.nodes}
    marked = 0
    for n in aranges:
        twin = twins.get(n.name)
        if twin is None or twin.target != n.target:
            continue
        (s0, _, st0), (s1, e1, st1) = _arange_range(n), _arange_range(twin)
        if s0 == s1 == 0 and st0 == st1 == 1 and e1 == full:
            n.meta[POSITIONS] = LITERAL
            marked += 1
    for n in slices:
        twin = twins.get(n.name)
        dim, start, _, _ = _slice_range(n)
        if twin is None or twin.target is not SLICE \
                or _slice_range(twin) != (dim, start, start + full, 1) \
                or _shape(twin.args[0], whole.module) != tuple(run.value(n.args[0]).shape):
            continue
        n.meta[POSITION_SLICE] = (dim % run.value(n.args[0]).dim(), start)
        marked += 1
    return marked


def _slice_range(node: fx.Node):
    """(dim, start, end, step) of an aten slice call; a start of None is 0."""
    a = list(node.args) + [None] * (5 - len(node.args))
    dim = a[1] if a[1] is not None else node.kwargs.get("dim", 0)
    start = a[2] if a[2] is not None else node.kwargs.get("start", 0)
    end = a[3] if a[3] is not None else node.kwargs.get("end")
    step = a[4] if a[4] is not None else node.kwargs.get("step", 1)
    return dim, 0 if start is None else start, end, step


def _constant_slice(node: fx.Node, run, inputs: set[str], local: int) -> bool:
    """`node` slices a parameter, buffer or constant (none of the model's `inputs`) to
    `local` rows from a start along a dim longer than that."""
    src = node.args[0]
    if not isinstance(src, fx.Node) or src.op not in ("placeholder", "get_attr") \
            or src.target in inputs:
        return False
    dim, start, end, step = _slice_range(node)
    value = run.value(src)
    return isinstance(value, torch.Tensor) and isinstance(dim, int) and isinstance(start, int) \
        and step == 1 and end == start + local and value.shape[dim] > local


def _shape(node: fx.Node, gm: fx.GraphModule):
    """The shape of a placeholder's or get_attr's value in `gm` (None if unknown): the
    sliced constant must be the same shape in both captures (not follow the sequence)."""
    value = fetch_attr(gm, node.target) if node.op == "get_attr" else node.meta.get("val")
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def _slice(mask: fx.Node) -> list[fx.Node]:
    """What `mask` is computed from (itself included), in graph order."""
    seen, todo = set(), [mask]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        todo.extend(n.all_input_nodes)
    return [n for n in mask.graph.nodes if n in seen]


def _check_slice(plan: Plan, sdpa: fx.Node, nodes: list[fx.Node], gm: fx.GraphModule,
                 inputs: set[str]) -> None:
    """Refuse a mask computed from anything but the model's inputs and constants."""
    for n in nodes:
        why = None
        if n.op == "placeholder" and n.target not in inputs:
            why = f"reads `{n.target}`, which is not a model input"
        elif n.op == "get_attr":
            user = next((u for u in n.users if u in nodes), n)
            why = (f"reads the model tensor `{n.target}` (at node `{user.name}`): the mask "
                   "would depend on weights or an activation")
        elif n.op == "call_module":
            why = (f"calls module `{n.target}` (node `{n.name}`): the mask would depend on "
                   "an activation")
        if why:
            raise PlanError.at(
                plan, _key(plan), f"the attention mask of `{sdpa.name}` {why}; context "
                f"parallel (cp = {plan.mesh.cp}) evaluates the model's mask code on the whole "
                "sequence, which it can do only for a mask computed from the model's inputs "
                "(token ids, positions, a padding mask) and constants",
                "compute the mask from positions (or pass none and use is_causal), or train "
                "without mesh.cp")


def _program(whole_gm: fx.GraphModule, mask: fx.Node) -> tuple[fx.GraphModule, list[str]]:
    """The whole-length graph's mask slice as a GraphModule of the model inputs it reads."""
    nodes = _slice(mask)
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    names = []
    for n in nodes:
        if n.op == "placeholder":
            env[n] = g.placeholder(n.target)
            names.append(n.target)
        else:
            env[n] = g.node_copy(n, env.__getitem__)
    g.output(env[mask])
    return fx.GraphModule(whole_gm, g, class_name="WholeMask"), names


def _erase_dead(graph: fx.Graph, nodes: list[fx.Node]) -> None:
    for n in reversed(nodes):
        if n.op != "placeholder" and not n.users:
            graph.erase_node(n)


class Whole:
    """The whole-length capture, made once when first asked for (cp_regions.py shares it)."""

    def __init__(self, plan: Plan, model: nn.Module):
        self.plan, self.model, self._captured = plan, model, None

    @property
    def module(self) -> fx.GraphModule:
        if self._captured is None:
            self._captured = capture_whole(self.plan, self.model)
        return self._captured.module

    def twin(self, node: fx.Node, what: str) -> fx.Node:
        """`node`'s twin at the whole length (same name and target), else refused."""
        twin = next((n for n in self.module.graph.nodes if n.name == node.name), None)
        plan = self.plan
        if twin is None or twin.target != node.target or not same_call(
                (node.args, node.kwargs), (twin.args, twin.kwargs),
                plan.data.seq_len // plan.mesh.cp, plan.data.seq_len):
            raise PlanError.at(plan, _key(plan), f"the model's graph at the whole sequence "
                               f"length has no {what} `{node.name}` like the one at S/cp = "
                               f"{plan.data.seq_len // plan.mesh.cp}: its code depends on "
                               "the length, so it cannot be rebuilt for the whole sequence",
                               "train this model without mesh.cp")
        return twin


def same_call(a, b, local: int, full: int) -> bool:
    """Two nodes' arguments alike: the same nodes by name, the same constants, except an int
    that is the sequence's length in each (S/cp here, S there)."""
    if isinstance(a, fx.Node) or isinstance(b, fx.Node):
        return isinstance(a, fx.Node) and isinstance(b, fx.Node) and a.name == b.name
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_call(x, y, local, full) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_call(a[k], b[k], local, full) for k in a)
    if type(a) is int and type(b) is int:
        return a == b or (a == local and b == full)
    return a == b or (isinstance(a, torch.device) and isinstance(b, torch.device))


def model_inputs(gm: fx.GraphModule, seq_inputs: dict) -> set[str]:
    return {n.target for n in gm.graph.nodes if n.op == "placeholder"} & set(seq_inputs)


def add_whole_value(plan: Plan, gm: fx.GraphModule, run, whole: Whole, user: fx.Node,
                    local: fx.Node, like: fx.Node, seq_inputs: dict) -> fx.Node:
    """A WholeSequenceMask node (inserted before `user`, its first user, on `like`'s
    device) computing the whole-sequence value of `local` -- a function of the model's
    inputs -- by the model's own code taken from the whole-length capture; it replaces
    `local` for every user, and `local`'s own code, dead, is removed."""
    inputs = model_inputs(gm, seq_inputs)
    for n in _slice(local):
        if n.op != "placeholder":
            whole.twin(n, "node")
    twin = whole.twin(local, "value")
    _check_slice(plan, user, _slice(twin), whole.module, inputs)
    program, names = _program(whole.module, twin)
    dims = []
    for name in names:
        d = sorted(seq_inputs[name])
        if len(d) > 1:
            raise PlanError.at(plan, _key(plan), f"the attention mask of `{user.name}` reads "
                               f"input `{name}`, which has {len(d)} sequence dims",
                               "give the input one `seq` dim")
        dims.append(d[0] if d else None)
    target = _free(gm, "cp_mask")
    gm.add_submodule(target, WholeSequenceMask(program, tuple(dims), plan.mesh.cp))
    placeholders = {n.target: n for n in gm.graph.nodes if n.op == "placeholder"}
    with gm.graph.inserting_before(user):
        new = gm.graph.call_module(target, (like,) + tuple(placeholders[n] for n in names))
    new.meta[WHOLE_MASK] = True
    new.meta["nn_module_stack"] = user.meta.get("nn_module_stack", {})
    local_nodes = _slice(local)
    local.replace_all_uses_with(new)  # every user (each layer's attention) takes it whole
    _erase_dead(gm.graph, local_nodes)
    run.run([new], {})
    return new


def _free(gm: fx.GraphModule, prefix: str) -> str:
    i = 0
    while hasattr(gm, f"{prefix}_{i}"):
        i += 1
    return f"{prefix}_{i}"


def whole_sequence_masks(plan: Plan, gm: fx.GraphModule, run, whole: Whole,
                         seq_inputs: dict) -> int:
    """Rewrite `gm` in place (module docstring): replace every SDPA mask by the model's mask
    code on the whole sequence. Returns the masks rewritten.
    `seq_inputs`: each model input's sequence dims (cp_locality.sequence_inputs)."""
    if plan.mesh.cp == 1:
        return 0
    masked = [n for n in attention_nodes(gm.graph) if isinstance(attn_mask(n), fx.Node)
              and not attn_mask(n).meta.get(WHOLE_MASK)]
    if not masked:
        return 0
    inputs = model_inputs(gm, seq_inputs)
    for node in masked:  # before capturing again: refuse what cannot run whatever it shows
        _check_slice(plan, node, _slice(attn_mask(node)), gm, inputs)
    for node in masked:
        if attn_mask(node).meta.get(WHOLE_MASK):
            continue  # the mask another attention call shares, rebuilt already
        whole.twin(node, "attention")
        add_whole_value(plan, gm, run, whole, node, attn_mask(node),
                        sdpa_arguments(node.args, node.kwargs)["query"], seq_inputs)
    gm.recompile()
    return len(masked)





