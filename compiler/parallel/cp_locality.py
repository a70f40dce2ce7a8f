"""Sequence locality (mesh.cp): how every op of the captured graph touches the sequence dim.

Context parallel gives each cp rank a slice of every sequence and runs the model's ops on
that slice; only attention is rewritten to see the others (backends/parallel/cp). That is
exact only if every other op treats positions independently. `sequence_locality` follows
the sequence dimension from the inputs named `seq` in `model.inputs` through the graph
(views, transposes and broadcasts move it; a `linear` or a norm keeps it) and classifies
each op that touches it:

* per-position: its output at a position depends on that position alone (pointwise ops,
  a linear, a norm over features, a reduction over another dim, the experts call);
* attention: `scaled_dot_product_attention` (the op the cp methods rewrite);
* mixing: it combines positions -- a convolution over the sequence, cumsum or a scan
  (indexing single positions), a reduction, softmax, sort or pooling over the sequence, a
  matmul contracting it, a shift or a concatenation along it.

`check_locality` refuses, at the `context.method` (or `mesh.cp`) line, the first mixing op
outside attention -- naming it and its module -- and an op it has no rule for that touches
the sequence, since "unknown" is not proven per-position. The table of rules
(compiler/parallel/cp_rules.py: one entry per op name, torch-level and aten names alike) is
the only place that knows ops; compiler/parallel/cp_rows.py holds its rules for token rows
(flattened and repeated rows, a sort whose order only permutes rows and is undone: MoE
dispatch), whose values here may be a sort's order (cp_rows.Tag) or rows it permutes
(SeqDims.perm): ops taking them go through `cp_rows.on_sorted`, and rows still in sorted
order at the prediction are refused.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from ...dsl.ast import Plan
from ...dsl.errors import PlanError
from ..capture.analysis import SDPA
from ..capture.blocks import module_path
from .cp import LITERAL, POSITION_SLICE, POSITIONS, sdpa_arguments
from .cp_rows import Tag, on_sorted, sorted_by
from .cp_rules import (MODULE_RULES, RULES, Dims, Mixing, NoRule, Op, attention, pointwise,
                       same_as_first)



def op_name(node: fx.Node, gm: fx.GraphModule) -> tuple[str, Optional[nn.Module]]:
    """The name the rules know `node`'s op by (aten overloads by their packet name, leaf
    modules by MODULE_RULES), and the module a call_module node calls."""
    if node.op == "call_method":
        return node.target, None
    if node.op == "call_module":
        mod = gm.get_submodule(node.target)
        # a module may name its rule (cp_regions.UlyssesRegion: attention run whole)
        return MODULE_RULES.get(type(mod), getattr(mod, "cp_rule", None)
                                or f"{type(mod).__name__} (module)"), mod
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target.__name__.split(".")[0], None
    return getattr(target, "__name__", str(target)), None


def _rule(node: fx.Node, name: str, per_token: frozenset):
    if node.op == "call_module" and node.target in per_token:
        return same_as_first  # the experts call: each token routed on its own
    if isinstance(node.target, torch._ops.OpOverload) and torch.Tag.pointwise in node.target.tags:
        return pointwise  # aten's own tag: element by element
    return RULES.get(name)


def sequence_inputs(plan: Plan) -> dict[str, Dims]:
    """Each model input's dims named `seq` in model.inputs."""
    return {spec.name: Dims(i for i, d in enumerate(spec.shape) if d == "seq")
            for spec in plan.model.inputs}


def _ancestors(end: fx.Node) -> set[fx.Node]:
    """What `end` is computed from, not looking into attention masks: a mask built on the
    local slice is compiler/parallel/cp.py's question (`check_context`), not a per-position
    one."""
    seen, todo = set(), [end]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        inputs = n.all_input_nodes
        if n.op == "call_function" and n.target in SDPA:
            mask = sdpa_arguments(n.args, n.kwargs)["attn_mask"]
            inputs = [a for a in inputs if a is not mask]
        todo.extend(inputs)
    return seen


def sequence_locality(gm: fx.GraphModule, run, inputs: dict[str, Dims], end: fx.Node,
                      per_token: frozenset = frozenset(), seq: Optional[dict] = None):
    """Walk the graph up to `end` (the model's prediction); yield (node, kind, detail)
    for each op touching the sequence: kind "per-position", "attention", "mixing" (detail:
    how) or "unknown" (detail: why no rule applies). `per_token`: module paths called as
    one per-token op (the experts calls). `seq`: filled with each node's sequence dims
    (compiler/parallel/cp_regions.py reads them)."""
    seq = {} if seq is None else seq
    keep = _ancestors(end)
    for node in gm.graph.nodes:
        if node not in keep:
            continue
        if node.op == "placeholder":
            seq[node] = inputs.get(node.target, inputs.get(node.name, Dims()))
            continue
        if node.op in ("get_attr", "output"):
            continue
        if POSITION_SLICE in node.meta:  # cp_masks.mark_positions: a constant's rows
            seq[node] = Dims({node.meta[POSITION_SLICE][0]})
            yield node, "positions", ""
            continue
        if node.meta.get(POSITIONS) == LITERAL:
            continue  # renumbered at run time; its uses are not followed (masks read it)
        sized = _sequence_size(node, seq)
        if sized is not None:  # a shape or length of the sequence, or arange over it
            seq[node] = sized
            if sized == POSITIONS_DIMS:
                node.meta[POSITIONS] = True
                yield node, "positions", ""
            continue
        touched = [a for a in pytree.tree_leaves((node.args, node.kwargs))
                   if isinstance(a, fx.Node) and _carries(seq.get(a))]
        if not touched:
            continue
        if not any(isinstance(v, torch.Tensor) for v in pytree.tree_leaves(run.value(node))):
            continue  # sizes, dims: no positions in them
        name, module = op_name(node, gm)
        rule = _rule(node, name, per_token)
        perm = next((p for p in (sorted_by(seq.get(a)) for a in touched) if p), None)
        if rule is None and perm is None:
            yield node, "unknown", f"no rule for `{name}`"
            return
        try:
            op = Op(node, run, seq, name, module)
            seq[node] = rule(op) if perm is None else on_sorted(op, perm, rule)
        except Mixing as e:
            yield node, "mixing", str(e)
            return
        except NoRule as e:
            yield node, "unknown", f"`{name}`: {e}"
            return
        yield node, "attention" if rule is attention else "per-position", ""
    perm = sorted_by(seq.get(end))
    if perm is not None:  # rows still in a sort's order reach the prediction
        yield end, "mixing", (f"comes out in the order `{perm.node.name}` sorts the "
                              "positions in, never put back")


POSITIONS_DIMS = Dims({0})
_LENGTH = "length"  # seq[node] of an int that is the local sequence length
ARANGE_NAMES = ("arange",)


class _Shape(tuple):
    """seq[node] of a shape (`x.shape`, `x.size()`): the dims of it that are the sequence."""


def _sequence_size(node: fx.Node, seq: dict):
    """What `node` is when it reads the sequence's size or numbers its positions: a _Shape,
    _LENGTH, or POSITIONS_DIMS for `arange(length)` (start 0, step 1) -- the positions this
    rank's slice holds, which the runtime renumbers globally
    (backends/parallel/cp/positions.py); None otherwise."""
    args = node.args
    name = getattr(node.target, "__name__", node.target) if node.op != "call_method" \
        else node.target
    name = name.split(".")[0] if isinstance(name, str) else name
    got = [seq.get(a) if isinstance(a, fx.Node) and sorted_by(seq.get(a)) is None else None
           for a in args]  # the length of sorted rows is not the sequence's
    first = got[0] if got else None
    if name == "getattr" and len(args) == 2 and args[1] == "shape" and _carries(first):
        return _Shape(first)
    if name == "size" and _carries(first):
        return _Shape(first) if len(args) == 1 else (_LENGTH if args[1] in first else None)
    if name == "sym_size" and _carries(first):
        return _LENGTH if args[1] in first else None
    if name == "getitem" and isinstance(first, _Shape) and isinstance(args[1], int):
        return _LENGTH if args[1] in first else None
    if name in ARANGE_NAMES:
        start, end = (args[0], args[1]) if len(args) >= 2 else (0, args[0] if args else None)
        step = args[2] if len(args) > 2 else node.kwargs.get("step", 1)
        if start == 0 and step == 1 and isinstance(end, fx.Node) and seq.get(end) == _LENGTH:
            return POSITIONS_DIMS
    return None


def _carries(got) -> bool:
    if isinstance(got, Tag):
        return True
    if isinstance(got, frozenset):
        return bool(got)
    if isinstance(got, (tuple, list)):
        return any(_carries(g) for g in got)
    return False


# attention written out (q @ k^T, softmax over the keys, @ v) mixes positions in these ops
EAGER_OPS = ("softmax", "_softmax", "log_softmax", "matmul", "bmm", "baddbmm")
EAGER_HINT = ("attention written out as matmul and softmax (eager) is not recognised as "
              "attention: context parallel rewrites scaled_dot_product_attention calls; select "
              "the model's SDPA attention (attn_implementation = \"sdpa\" for transformers) "
              "or train without mesh.cp")


def check_locality(plan: Plan, gm: fx.GraphModule, run, end: fx.Node,
                   per_token: frozenset = frozenset()) -> None:
    """Refuse (at `context.method`, else `mesh.cp`) the first op outside attention that
    mixes positions along the sequence, or that no rule covers."""
    if plan.mesh.cp == 1:
        return
    key = "context.method" if "context.method" in plan.spans else "mesh.cp"
    for node, kind, detail in sequence_locality(gm, run, sequence_inputs(plan), end, per_token):
        if kind not in ("mixing", "unknown"):  # positions: marked for the runtime
            continue
        where = module_path(node)
        module = f" in module `{where}`" if where else ""
        name, _ = op_name(node, gm)
        labels = _labels_only(plan, node)
        if plan.model.loss == "model" and labels:
            raise PlanError.at(
                plan, key, f"`{name}` (node `{node.name}`){module} computes on "
                f"`{labels}` alone ({detail}): the model's own loss (loss = model) shifts "
                "the labels the data feeds it along the sequence (transformers: pad, then a "
                f"slice), which split over cp = {plan.mesh.cp} ranks would pair each rank's "
                "last position with no label",
                "let pipeplan compute the loss: loss = cross_entropy (its targets come "
                "shifted by the data) where the model returns its logits first; or train "
                "without mesh.cp")
        if kind == "mixing":
            raise PlanError.at(
                plan, key, f"`{name}` (node `{node.name}`){module} {detail}: it mixes "
                "positions outside attention, so split over cp = "
                f"{plan.mesh.cp} ranks it would compute another function than the model",
                EAGER_HINT if name in EAGER_OPS else
                "context parallel splits the sequence and rewrites only attention "
                "(scaled_dot_product_attention); a model with convolutions, scans, "
                "cumulative sums or pooling over the sequence cannot run split: train "
                "it without mesh.cp")
        raise PlanError.at(
            plan, key, f"cannot prove `{name}` (node `{node.name}`){module} treats "
            f"sequence positions one by one ({detail}); context parallel runs only ops "
            "known to be per-position outside attention",
            "train this model without mesh.cp, or report the op so its rule can be added "
            "(compiler/parallel/cp_locality.py, RULES)")


def _labels_only(plan: Plan, node: fx.Node) -> Optional[str]:
    """The input `node` is computed from alone, transitively (no parameter, buffer or
    constant, no other input), if the data feeds it the tokens (`labels = tokens`): the
    labels a model's own loss shifts; else None."""
    fed = {name for name, source in plan.data.inputs if source == "tokens"}
    seen, todo, read = set(), [node], set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "get_attr":
            return None
        if n.op == "placeholder":
            read.add(n.target)
        todo += n.all_input_nodes
    return next(iter(read)) if len(read) == 1 and read <= fed else None
