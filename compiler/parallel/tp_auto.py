"""`tensor { plan = auto }`: Megatron's column/row pairs found in the captured graph, for a
model that declares no split of its own and a plan that names none.

Within each of the model's blocks (capture/blocks.py), a Linear (in any form
`tp.linear_use` reads: a Linear's call, `x @ W.T`, GPT-2's Conv1D) is a column layer when
every Linear its output reaches first is a row layer of its block, through ops that keep
each feature apart (activations and attention within heads; no norm and no reduction over
the dim that carries the split: a norm within each head after the view to heads is
head-local), and a row layer when every Linear its input comes from first is a column
layer of its block; a side without its other is dropped, to a fixed point. So q, k, v -> o
and gate, up -> down in a transformer block (the projections that read the residual stream,
and those that write it back), BLOOM's and GPT-NeoX's fused QKV -> dense, GPT-2's c_attn ->
c_proj; attention whose q is normalised over every head (OLMo 2) stays whole, over each
head's own dims (Qwen 3, Gemma 3) is split. A path to the
model's inputs (a mask, positions) is not a Linear and does not count. Modules are chosen
by the graph's dataflow, never by their names; a module applied in several places must be
the same kind at each. The vocabulary is split as Megatron splits it (`vocab_split`: the
LM head whose logits go only to the loss, the embedding tables the token inputs index).
The pairs are then checked as a written split is (shapes, tied weights, then
`check_pairing` on the graph), and `pipeplan verify` proves the run.
"""
from __future__ import annotations

import torch
from torch import fx

from ...dsl.ast import Plan
from ...dsl.errors import PlanError
from ..capture.blocks import block_of, blocks_of, within
from .ep import moe_modules
from .tp import _check_shape, _check_tied, _holders, carries_features, embedding_calls, \
    embedding_ids, features_out, first_linears, linear_uses, loss_of_logits, tp_annotations
from .tp_follow import REDUCTIONS, between, gathered_at, is_convolution, reduced_dims, \
    split_dims

KEY = "tensor.plan"


def tp_split(plan: Plan, model: torch.nn.Module, graph: fx.Graph, run) -> dict[str, str]:
    """What tp splits, on the captured graph: the pairs it shows (`tensor.plan = auto`), else
    the plan's patterns or the model's own plan (tp.tp_annotations). The driver and the
    planner both ask here."""
    if plan.tensor.plan == "auto":
        return auto_tp_plan(plan, graph, model, run)
    return tp_annotations(plan, model)


def auto_tp_plan(plan: Plan, graph: fx.Graph, model: torch.nn.Module, run) -> dict[str, str]:
    """qualified module -> "column" | "row": the pairs the graph shows, checked like a
    written split; refused at `tensor.plan` where there are none."""
    blocks = set(blocks_of(model))
    uses = linear_uses(graph, model)
    linear = {n: u.module for n, u in uses.items()}
    experts = moe_modules(plan, model)  # expert parallelism's, not tp's
    home = {n: block_of(m, blocks) for n, m in linear.items()
            if not any(within(m, e) for e in experts)}

    is_tensor = carries_features(plan, run, inputs=False)  # (masks, positions: no path)
    def firsts(node: fx.Node, forward: bool) -> set:
        start = node if forward else uses[node].x
        if not forward and start in linear:  # the input is a Linear's output itself
            return {start}
        return set(first_linears(start, linear, forward, is_tensor))

    ahead = {n: firsts(n, True) for n in home}
    behind = {n: firsts(n, False) for n in home}

    def local(n: fx.Node, others: set) -> bool:
        return bool(others) and None not in others and all(
            m in home and m is not n and home[m] == home[n] is not None for m in others)

    rows = {n for n in home if local(n, behind[n])}
    columns = {n for n in home if local(n, ahead[n])
               and not _mixes_features(n, linear, is_tensor, run, graph, plan.mesh.tp)
               and gathered_at(features_out(n, run), run, plan.mesh.tp) is None}
    while True:  # a pair needs both sides: drop either until none is left without its other
        kept = ({n for n in columns if ahead[n] <= rows},
                {n for n in rows if behind[n] <= columns})
        if kept == (columns, rows):
            # a Linear left both reads a column's split and writes one a row reads (Doge's
            # dt_proj, from v's output into the attention scores): neither split runs it
            if not columns & rows:
                break
            kept = (columns - rows, rows - columns)
        columns, rows = kept
    kinds: dict[str, str] = {}
    for nodes, kind in ((columns, "column"), (rows, "row")):
        for n in nodes:
            kinds.setdefault(linear[n], kind)
    # a module applied in several places (a layer shared by every layer: ALBERT) is one
    # kind at every use, else it stays whole
    for n, name in linear.items():
        if name in kinds and kinds[name] != _kind_at(n, columns, rows):
            kinds.pop(name)
    vocab = vocab_split(plan, graph, model, run)[0]
    if not kinds:  # (the vocabulary alone: every block's compute repeated on each tp rank)
        alone = (f"; only the vocabulary could split: `vocab = [{', '.join(vocab)}]` splits "
                 "just it, every block then whole on each rank" if vocab else "")
        raise PlanError.at(plan, KEY, f"tensor.plan = auto found no column/row pairs to split "
                           f"over tp = {plan.mesh.tp}: no Linear in a block of the model feeds "
                           "only Linears of its block that read nothing else" + alone,
                           "name the modules to split in column / row lists")
    for name in vocab:
        kinds.setdefault(name, "vocab")
    modules = dict(model.named_modules())
    for name, kind in kinds.items():
        _check_shape(plan, KEY, kind, name, modules[name], plan.mesh.tp)
    _check_tied(plan, model, kinds)
    return dict(sorted(kinds.items()))


def left_whole(plan: Plan, graph: fx.Graph, model: torch.nn.Module, run,
               kinds: dict[str, str]) -> dict[str, str]:
    """The Linears of the model's blocks that `plan = auto` leaves whole because tp could not
    keep their output split (tp_follow.py: heads tp does not divide, multi-query's one k/v
    head cut off a fused projection), each with why; `check` lists them beside the split.
    (Their pair partners stay whole with them: a pair needs both sides.)"""
    blocks = set(blocks_of(model))
    out: dict[str, str] = {}
    for node, use in linear_uses(graph, model).items():
        if use.module in kinds or use.module in out or block_of(use.module, blocks) is None:
            continue
        why = gathered_at(features_out(node, run), run, plan.mesh.tp, use.module)
        if why is not None:
            out[use.module] = why
    out.update(vocab_split(plan, graph, model, run)[1])  # a head: why its vocabulary stays whole
    return dict(sorted(out.items()))


def vocab_split(plan: Plan, graph: fx.Graph, model: torch.nn.Module, run) \
        -> tuple[list[str], dict[str, str]]:
    """Megatron's split of the vocabulary, found in the graph: each LM head whose logits go
    only to the cross-entropy (tp.loss_of_logits: the loss then runs vocab-parallel on each
    rank's share of the logits), and each embedding table the model's token inputs index
    (along tensor values from an input, not positions made by `arange`) with as many rows
    as those logits have classes (the data's vocabulary where no head feeds the loss).
    Returns (the modules split, module -> why one stays whole: tp does not divide its
    vocabulary, it renormalises its rows, or its weight is tied to a module not split so)."""
    modules = dict(model.named_modules())
    uses, embeddings = linear_uses(graph, model), embedding_calls(graph, model)
    heads = {use.module: node for node, use in uses.items() if loss_of_logits(node) is not None}
    classes = {int(run.value(n).shape[-1]) for n in heads.values()} or {plan.data.vocab}
    is_input = carries_features(plan, run)
    tables = {name for node, name in embeddings.items() if _indexed_by_inputs(node, is_input)}
    found = {n for n in set(heads) | tables if _table_rows(modules.get(n)) in classes}
    whole = {n: f"tp = {plan.mesh.tp} does not divide its vocabulary ({_table_rows(modules[n])})"
             for n in found if _table_rows(modules[n]) % plan.mesh.tp}
    whole.update({n: "it renormalises its rows (max_norm)" for n in found
                  if getattr(modules[n], "max_norm", None) is not None})
    applied = {use.module for use in uses.values()} | set(embeddings.values())
    # per parameter, its holders; one the graph never applies can follow the split only as
    # a table of its own (its `weight`: BART's and T5's `shared`), not as ALBERT's MLM head
    # holding its decoder's bias
    tied = [({owner for owner, _ in held},
             all(leaf == "weight" for owner, leaf in held if owner not in applied))
            for held in _holders(model)]
    while True:  # a tied parameter is split in every holder or in none
        split = found - set(whole)
        cut = [(owners, owners & split) for owners, follows in tied
               if owners & split and not (owners & applied <= split and follows)]
        if not cut:
            break
        for owners, mine in cut:
            others = ", ".join(sorted(owners - split))
            for owner in sorted(mine):
                whole.setdefault(owner, f"a parameter of it is tied to {others}, not split so")
    return sorted(split.union(*(owners for owners, _ in tied if owners & split))), whole


def _table_rows(module) -> int:
    w = getattr(module, "_parameters", {}).get("weight")
    return int(w.shape[0]) if w is not None and w.dim() == 2 else -1


def _indexed_by_inputs(node: fx.Node, is_input) -> bool:
    """Do an embedding's indices come from the model's inputs along tensor values (token
    ids; not positions made by `arange`, nor buckets computed from them)?"""
    ids = embedding_ids(node)
    seen, frontier = set(), [ids] if isinstance(ids, fx.Node) else []
    while frontier:
        n = frontier.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder" and is_input(n):
            return True
        frontier.extend(m for m in n.all_input_nodes if is_input(m))
    return False


# ops that combine the features of a position (a split one would need them all)
_NORMS = {"layer_norm", "native_layer_norm", "rms_norm", "_fused_rms_norm", "group_norm",
          "native_group_norm", "batch_norm", "native_batch_norm", "instance_norm",
          "normalize"}
_SHAPED_NORMS = {"layer_norm", "native_layer_norm", "rms_norm", "_fused_rms_norm"}  # (x, shape)
_NORM_MODULES = (torch.nn.LayerNorm, torch.nn.GroupNorm, torch.nn.RMSNorm,
                 torch.nn.modules.batchnorm._BatchNorm, torch.nn.modules.instancenorm._InstanceNorm)


def _mixes_features(column: fx.Node, linear: dict, is_tensor, run, graph: fx.Graph,
                    tp: int) -> bool:
    """Whether the ops between a column candidate's output and the Linears it reaches first
    combine the features tp splits: a norm or a reduction over the dim that carries the
    split (tp_follow.split_dims: after a view to heads, a norm over each head's dims keeps
    the heads apart, as Qwen 3's and Gemma 3's q_norm / k_norm; OLMo 2's over every head
    does not); where the split's place is not followed, a norm, or a reduction over the
    last dim. Megatron's pair runs head-local ops only (activations, attention within each
    head, a norm within each head)."""
    gm = graph.owning_module
    split = split_dims(column, run, tp, lambda n: n in linear or n.op == "output")
    return any(_combines_features(n, run, gm, split)
               for n in between(column, linear, is_tensor))


def _combines_features(n: fx.Node, run, gm, split: dict) -> bool:
    """Does n combine features of the split: over the dim that carries it where
    `split` follows it into n, else (conservatively) any norm, or a reduction over the
    last dim."""
    if is_convolution(n):  # its weight holds every channel: the split ones' too
        return True
    x = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
    at = split.get(x)
    if n.op == "call_module":
        mod = gm.get_submodule(n.target)
        if not isinstance(mod, _NORM_MODULES):
            return False
        shape = getattr(mod, "normalized_shape", None)
        return at is None or shape is None or at >= run.value(x).dim() - len(shape)
    if n.op not in ("call_function", "call_method"):
        return False
    target = n.target
    name = target if isinstance(target, str) else \
        target.__name__.split(".")[0] if isinstance(target, torch._ops.OpOverload) else \
        getattr(target, "__name__", "")
    value = run.values.get(x) if x is not None else None
    if name in _NORMS:
        shape = n.args[1] if len(n.args) > 1 and name in _SHAPED_NORMS else None
        return at is None or not isinstance(shape, (list, tuple)) or \
            at >= value.dim() - len(shape)
    if name not in REDUCTIONS:
        return False
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return True
    dims = reduced_dims(n, value.dim())
    if dims is None:
        return True  # over every dim
    return (at if at is not None else value.dim() - 1) in dims


def _kind_at(n: fx.Node, columns: set, rows: set):
    return "column" if n in columns else "row" if n in rows else None
