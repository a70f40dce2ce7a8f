"""Ulysses on attention the model writes out itself (eager attention: soft-capping, any ops
between q, k, v and the output), run whole on each rank's heads.

Under Ulysses each rank holds, inside attention, whole sequences of heads/cp heads, so any
per-head computation may mix positions there. `ulysses_regions` finds, for each op the
sequence-locality walk (cp_locality.py) calls mixing, the region around it:

* its output: the first node after the mixing op that every later use of the region goes
  through, 4-d [batch, heads, seq, head_dim] with the sequence at dim 2 (before o_proj);
* its inputs: walking back from the output, the first values carrying the sequence at dim 2
  alone, 4-d (the head-shaped q, k and v); anything else it reads must not carry the
  sequence (numbers) or be a mask computed from the model's inputs, which is rebuilt on
  the whole sequence (cp_masks.py), or a weight (GPT-OSS's sinks), whose head dim is
  found where it meets a value with known heads (`_weight_heads`) and whose block of
  heads each rank takes.

The region becomes one call_module node (`UlyssesRegion`, its rule "attention" for the
locality walk) over the same inputs. At run time q, k, v go through the all-to-alls
(sequence -> heads), the region runs on whole sequences, and its output goes back. The
region it runs is the model's own nodes taken from the whole-length capture
(cp_masks.capture_whole), with the literal head counts export baked into views and
expands divided by cp: the heads are followed through the region by the same rule table
(cp_rules.py, seeded with dim 1 of q, k, v), and the rewritten region is checked on meta
tensors to map [B, H/cp, S, D] to [B, H/cp, S, D]. What cannot be found or rewritten
exactly is refused at the plan line with the reason. Ring attention runs only SDPA.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.fx as fx
from torch import nn

from ...dsl.ast import Plan
from ...dsl.errors import PlanError
from .cp import REGION
from .cp_heads import split_heads
from .cp_rules import Dims, Mixing, NoRule, Op



class _NotARegion(Exception):
    """No attention region around the mixing op: the locality check refuses it."""


class UlyssesRegion(nn.Module):
    """The model's own attention region run on whole sequences of this rank's heads.
    `program(q, k, v, *sides)` works on [B, H/cp, S, D]; `heads_to_seq` / `seq_to_heads`
    and `head_block` (set by the runtime, backends/parallel/cp/ulysses.py) move between
    layouts; without them (the compiler's meta run) the layouts are made up on meta."""

    cp_rule = "scaled_dot_product_attention"

    def __init__(self, program: fx.GraphModule, cp: int, side_heads: tuple):
        super().__init__()
        self.program, self.cp, self.side_heads = program, cp, side_heads
        self.to_heads: Optional[Callable] = None
        self.to_seq: Optional[Callable] = None
        self.block: Optional[Callable] = None  # block(t, dim): this rank's 1/cp along dim

    def forward(self, q, k, v, *sides):
        """`sides`: what else the region reads -- a mask rebuilt on the whole sequence, a
        weight (GPT-OSS's sinks), a number; each with a head dim in `side_heads` is cut to
        this rank's heads (a weight's gradient then lands in its own heads' rows, summed
        over the cp group with every gradient)."""
        if self.to_heads is not None:
            q, k, v = (self.to_heads(t) for t in (q, k, v))
            sides = tuple(x if d is None else self.block(x, d)
                          for x, d in zip(sides, self.side_heads))
            return self.to_seq(self.program(q, k, v, *sides))
        if q.device.type != "meta":
            raise RuntimeError("UlyssesRegion runs under context parallel only")
        s, h = q.shape[2], q.shape[1]
        heads = [torch.cat([t.narrow(1, 0, t.shape[1] // self.cp)] * self.cp, 2)
                 for t in (q, k, v)]
        sides = tuple(x if d is None else x.narrow(d, 0, x.shape[d] // self.cp)
                      for x, d in zip(sides, self.side_heads))
        out = self.program(*heads, *sides)  # what a rank computes: H/cp heads, S positions
        return torch.cat([out] * self.cp, 1).narrow(2, 0, s).narrow(1, 0, h)


def _key(plan: Plan) -> str:
    return "context.method" if "context.method" in plan.spans else "mesh.cp"


def _refuse(plan: Plan, node: fx.Node, why: str):
    raise PlanError.at(plan, _key(plan), f"Ulysses cannot run the attention around "
                       f"`{node.name}` on whole sequences: {why}",
                       "use the model's SDPA attention (attn_implementation = \"sdpa\"), "
                       "or train without mesh.cp")


def _output(plan: Plan, gm: fx.GraphModule, start: fx.Node, run, seq: dict) -> fx.Node:
    """The first node after `start` that every later use of what `start` feeds goes
    through (live set of one), head-shaped: 4-d, the sequence at dim 2 alone. Sequence
    dims past `start` follow the rules, a mixing op keeping what it mixes (`_inside`)."""
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    live = {start}
    seq[start] = _inside(start, gm, run, seq)
    for n in list(graph.nodes)[order[start] + 1:]:
        if n.op == "output":
            break
        if any(a in live for a in n.all_input_nodes):
            live.add(n)
            seq[n] = _inside(n, gm, run, seq)
        live = {x for x in live if x is n or any(order[u] > order[n] for u in x.users)}
        if live == {n} and seq.get(n) == Dims({2}) and run.is_tensor(n) \
                and run.value(n).dim() == 4:
            return n
    raise _NotARegion()


def _inside(n: fx.Node, gm: fx.GraphModule, run, seq: dict):
    """`n`'s sequence dims inside an attention region: by its rule; where the rule says it
    mixes positions, the dims it keeps (a softmax or a concatenation: its inputs'; a
    matmul: those not contracted); None when unknown."""
    from .cp_locality import _rule, op_name
    from .cp_rules import _dim_list, cat, getitem, matmul, narrow, reduction, slice_

    if not isinstance(run.values.get(n), torch.Tensor):
        return None
    name, module = op_name(n, gm)
    rule = _rule(n, name, frozenset())
    op = Op(n, run, seq, name, module)
    try:
        return rule(op) if rule is not None else None
    except Mixing:
        pass
    except NoRule:
        return None
    if rule is reduction:  # over the keys: what is left indexes no key any more
        x = n.args[0]
        nd = op.ndim(x)
        over = _dim_list(op.arg(1, "dim"), nd) or list(range(nd))
        keep = bool(op.arg(2, "keepdim", False))
        dims = Dims(d if keep else d - sum(o < d for o in over)
                    for d in op.dims(x) if d not in over)
        return (dims, dims) if isinstance(op.out, (tuple, list)) else dims
    if rule in (cat, slice_, narrow, getitem):  # along the keys: they stay keys
        if rule is cat:
            return Dims(set().union(*(op.dims(t) for t in n.args[0])))
        return op.dims(n.args[0])
    if rule is matmul:
        a, b = n.args[0], n.args[1]
        na, nb, no = op.ndim(a), op.ndim(b), op.out.dim()
        keep = {no - 2 if d == na - 2 else d + no - na for d in op.dims(a) if d != na - 1}
        keep |= {no - 1 if d == nb - 1 else d + no - nb for d in op.dims(b) if d != nb - 2}
        return Dims(keep)
    ins = [a for a in op.tensor_inputs()]
    if ins and all(tuple(op.value(a).shape) == tuple(op.out.shape) for a in ins):
        return Dims(set().union(*(op.dims(a) for a in ins)))
    return None


def _region(plan: Plan, mixing: fx.Node, out: fx.Node, seq: dict, masks: Callable, run
            ) -> tuple[list[fx.Node], list[fx.Node], list[fx.Node]]:
    """(nodes in graph order, [q, k, v] inputs, side inputs) of the region ending at `out`."""
    inside, heads, sides, params, todo = set(), [], [], [], [out]
    while todo:
        n = todo.pop()
        if n in inside:
            continue
        inside.add(n)
        for a in n.all_input_nodes:
            dims = seq.get(a)
            if a in inside or a in heads or a in sides:
                continue
            if isinstance(dims, frozenset) and dims == Dims({2}) and run.is_tensor(a) \
                    and run.value(a).dim() == 4:
                heads.append(a)
            elif not any(isinstance(x, torch.Tensor)
                         for x in torch.utils._pytree.tree_leaves(run.values.get(a))):
                if dims not in (None, Dims()):  # a length or shape of the local slice
                    _refuse(plan, mixing, f"it reads `{a.name}`, the sequence's length on "
                                          "one rank's slice, computed outside it")
                sides.append(a)  # a number that is not the sequence's (a scale): as it is
            elif masks(a):
                sides.append(a)
            elif a.op == "get_attr":
                params.append(a)
            elif a.op in ("placeholder", "call_module"):
                raise _NotARegion()
            else:
                todo.append(a)
    if len(heads) != 3:
        raise _NotARegion([h.name for h in heads])
    order = list(out.graph.nodes)
    heads.sort(key=order.index)
    return [n for n in order if n in inside], heads, sides + params


def _program(whole: fx.GraphModule, nodes, heads, sides, out) -> fx.GraphModule:
    twins = {n.name: n for n in whole.graph.nodes}
    g, env = fx.Graph(), {}
    for n in (*heads, *sides):
        env[twins[n.name]] = g.placeholder(n.name)
    for n in nodes:
        t = twins.get(n.name)
        if t is None or t.target != n.target:
            raise KeyError(n.name)
        env[t] = g.node_copy(t, env.__getitem__)
    g.output(env[twins[out.name]])
    return fx.GraphModule(whole, g, class_name="UlyssesProgram")


def ulysses_regions(plan: Plan, gm: fx.GraphModule, run, whole, seq_inputs: dict,
                    end: fx.Node, per_token: frozenset = frozenset()) -> int:
    """Under Ulysses, replace each attention region around a mixing op by a UlyssesRegion
    call (module docstring), in place; returns how many. `whole`: cp_masks.Whole."""
    if plan.mesh.cp == 1 or plan.context is None or plan.context.method != "ulysses":
        return 0
    from .cp_locality import sequence_locality

    count = 0
    while True:
        seq: dict = {}
        mixing = None
        for node, kind, _ in sequence_locality(gm, run, seq_inputs, end, per_token, seq):
            if kind in ("mixing", "unknown"):
                mixing = node if kind == "mixing" else None
                break
        if mixing is None:  # none left (or an op without a rule: check_locality says so)
            if count:
                gm.recompile()
            return count
        try:
            _replace_region(plan, gm, run, whole, seq_inputs, mixing, seq, count)
        except _NotARegion:  # a mixing op outside attention: check_locality names it
            if count:
                gm.recompile()
            return count
        count += 1


def _replace_region(plan, gm, run, whole, seq_inputs, mixing, seq, index) -> None:
    from .cp_masks import _slice, add_whole_value, model_inputs

    cp = plan.mesh.cp
    inputs = model_inputs(gm, seq_inputs)
    cache: dict = {}

    def from_inputs(a: fx.Node) -> bool:  # a value computed from the model's inputs alone
        if a not in cache:
            cache[a] = all(n.op not in ("get_attr", "call_module") and
                           (n.op != "placeholder" or n.target in inputs) for n in _slice(a)) \
                and any(n.op == "placeholder" or n.op == "call_function" for n in _slice(a))
        return cache[a]

    if plan.mesh.tp > 1:
        _refuse(plan, mixing, "attention regions are not split by tensor parallelism")
    out = _output(plan, gm, mixing, run, seq)
    nodes, heads, sides = _region(plan, mixing, out, seq, from_inputs, run)
    for h in heads:
        if run.value(h).shape[1] % cp:
            _refuse(plan, mixing, f"cp = {cp} does not divide the {run.value(h).shape[1]} "
                                  f"heads of `{h.name}`")
    for n in nodes:
        whole.twin(n, "node")  # the same call at the whole length, else refused
    try:
        program = _program(whole.module, nodes, heads, sides, out)
    except KeyError as e:
        _refuse(plan, mixing, f"node {e} differs at the whole sequence length")
    for i, a in enumerate(sides):  # each side tensor: the model's code on the whole sequence
        if run.is_tensor(a) and a.op != "get_attr":
            sides[i] = add_whole_value(plan, gm, run, whole, nodes[0], a, heads[0], seq_inputs)
    metas = [_whole_meta(run.value(h), cp, 2) for h in heads] + \
        [run.value(s) for s in sides]
    head_dims = [Dims({1})] * 3 + [None if s.op == "get_attr" else  # a weight: inferred
                                   Dims({run.value(s).dim() - 3}) if run.is_tensor(s)
                                   and run.value(s).dim() >= 3 and run.value(s).shape[-3] > 1
                                   else Dims() for s in sides]
    try:
        why = split_heads(program, [_on_meta(m) for m in metas], head_dims, cp)
    except Exception as e:  # noqa: BLE001 - the region does not run on the whole sequence
        why = f"its ops do not run on the whole sequence ({type(e).__name__}: {e})"
    if why:
        _refuse(plan, mixing, why)
    side_heads = tuple(next(iter(d)) if d else None for d in head_dims[3:])
    want = list(_whole_meta(run.value(out), cp, 2).shape)
    want[1] //= cp
    try:
        got = program(*[_heads_meta(m, d, cp) for m, d in zip(metas, head_dims)])
    except Exception as e:  # noqa: BLE001 - any failure: the rewrite is not exact
        _refuse(plan, mixing, f"its heads could not be split ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''})")
    if list(got.shape) != want:
        _refuse(plan, mixing, f"split over cp its output is {tuple(got.shape)}, not {want}")
    target = f"cp_region_{index}"
    gm.add_submodule(target, UlyssesRegion(program, cp, side_heads))
    with gm.graph.inserting_before(out):
        new = gm.graph.call_module(target, (*heads, *sides))
    new.meta[REGION] = True
    new.meta["nn_module_stack"] = out.meta.get("nn_module_stack", {})
    out.replace_all_uses_with(new)
    for n in reversed(nodes):
        if not n.users:
            gm.graph.erase_node(n)
    run.run([new], {})


def _whole_meta(t: torch.Tensor, cp: int, dim: int) -> torch.Tensor:
    shape = list(t.shape)
    shape[dim] *= cp
    return torch.empty(shape, dtype=t.dtype, device="meta")


def _on_meta(t):
    return torch.empty(t.shape, dtype=t.dtype, device="meta") if isinstance(t, torch.Tensor) \
        else t


def _heads_meta(t: torch.Tensor, dims, cp: int):
    if not isinstance(t, torch.Tensor):
        return t
    shape = list(t.shape)
    for d in dims:
        shape[d] //= cp
    return torch.empty(shape, dtype=t.dtype, device="meta")

