"""Tensor-parallel annotations: which parameters the plan's `tensor` patterns split, checked.

The patterns name modules (`model.layers.*.self_attn.q_proj`); what is split
is that module's own parameters as the captured graph uses them:

    column  `<m>.weight` [out, in] and `<m>.bias` split on dim 0 (output features)
    row     `<m>.weight` split on dim 1 (input features); the bias stays whole
    vocab   `<m>.weight` split on dim 0: an embedding table's rows or an LM
            head's output features (its bias too)

A parameter counts as used "Linear-like" where the graph applies it as
`linear(x, weight, bias)` (an fx `call_module` of a Linear, `F.linear`,
`aten.linear`, or `x @ weight.T`: Falcon) or as an embedding table (`F.embedding`,
`aten.embedding`). A weight the graph applies stored [in, out] -- `addmm(b, x, W)`,
`x @ W`: GPT-2's Conv1D -- has its dims swapped (column: dim 1, row: dim 0); its
tokens are flattened to rows, so sequence parallel is refused on it (`LinearUse`).
Everything is checked at compile time against the real shapes and the graph,
so a plan that cannot be split fails at its plan line: tp not dividing the
features, the heads (where the graph views a column output as [..., heads,
head_dim]) or the vocabulary; a pattern whose modules have no Linear-like use;
a weight tied between modules that would split it differently; Megatron's
pairing broken (a column output reaching anything but a row layer or the loss). A
column Linear whose output the graph cuts into parts (fused q/k/v, gate/up) is split
part by part (tp_fused.py).
"""
from __future__ import annotations

import difflib
import functools
import operator
from dataclasses import dataclass
from typing import Optional

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.fx.operator_schemas import normalize_function

from ...dsl.ast import Plan
from ...dsl.errors import PlanError
from ..capture.analysis import SDPA
from ..capture.blocks import module_path
from ..compiled import BATCH, CONSTANT
from ..patterns import matches, matches_any
from .tp_fused import ROWS_RESTORED, find_segments
from .tp_follow import convolution_between, gathered_at, is_view
from .tp_model import HF_STYLES, declared_plan

KINDS = ("column", "row", "vocab")
LINEARS = (F.linear, torch.ops.aten.linear.default)
EMBEDDINGS = (F.embedding, torch.ops.aten.embedding.default)
_FLATTENS = (torch.ops.aten.flatten.using_ints, torch.flatten)


@dataclass(frozen=True)
class TensorParallelRules:
    """Which modules (plan module-path patterns) split their parameters which way."""

    column: tuple[str, ...] = ()
    row: tuple[str, ...] = ()
    vocab: tuple[str, ...] = ()
    sequence_parallel: bool = False
    # the compiled plan's kinds (CompiledPlan.tp_rewrites: qualified module -> kind, from
    # `tp_annotations`); when given, they decide and the patterns are not matched again
    kinds: Optional[tuple[tuple[str, str], ...]] = None

    @staticmethod
    def from_plan(tensor_spec) -> "TensorParallelRules":
        return TensorParallelRules(tuple(tensor_spec.column), tuple(tensor_spec.row),
                                   tuple(tensor_spec.vocab), tensor_spec.sequence_parallel)

    @staticmethod
    def compiled(kinds: dict[str, str], sequence_parallel: bool) -> "TensorParallelRules":
        return TensorParallelRules(sequence_parallel=sequence_parallel,
                                   kinds=tuple(sorted(kinds.items())))

    @functools.cached_property
    def _kind_map(self) -> dict[str, str]:
        return dict(self.kinds or ())

    def kind_of(self, name: str) -> Optional[str]:
        if self.kinds is not None:
            return self._kind_map.get(name)
        for kind in KINDS:
            if matches_any(name, getattr(self, kind)):
                return kind
        return None


def shard_dim(kind: str, leaf: str, in_out: bool = False) -> Optional[int]:
    """The dim a module's parameter `leaf` is split on (None: kept whole); `in_out`: its
    weight is stored [in, out] (LinearUse.in_out), so the feature dims are swapped."""
    if leaf == "weight":
        return (1 if kind == "row" else 0) ^ int(in_out)
    if leaf == "bias" and kind != "row":
        return 0
    return None


def embedding_weight(node: fx.Node):
    return node.args[1] if node.target is F.embedding else node.args[0]


def embedding_ids(node: fx.Node):
    """The indices an embedding call (F's, aten's, or an Embedding module's) looks up."""
    return node.args[1] if node.op == "call_function" and node.target is not F.embedding \
        else node.args[0]


# the graph's mean-reduced losses over class targets -> their reduction values (mean, sum)
MEAN_LOSSES = {F.cross_entropy: ("mean", "sum"), F.nll_loss: ("mean", "sum"),
               **{op: (1, 2) for op in (torch.ops.aten.cross_entropy_loss.default,
                                        torch.ops.aten.nll_loss.default,
                                        torch.ops.aten.nll_loss_nd.default)}}


def counted_mean(node: fx.Node) -> Optional[tuple]:
    """(input, target, the other arguments by keyword) of a call of a MEAN_LOSSES op that
    reduces by the mean: the rewrite runs it on row-sharded logits as its summed loss over
    the weight its targets count (backends' tp/dtensor.CountedMean); None otherwise (a
    call with the legacy `size_average` / `reduce` too)."""
    found = _loss_call(node, MEAN_LOSSES)
    if found is None or found[2]["reduction"] != MEAN_LOSSES[node.target][0]:
        return None
    return found


def _loss_call(node: fx.Node, ops) -> Optional[tuple]:
    """(input, target, the other arguments by keyword) of a call of one of `ops`, its
    arguments normalized by the op's signature; None for other nodes, or a call with the
    legacy `size_average` / `reduce`."""
    if node.op != "call_function" or node.target not in ops:
        return None
    found = normalize_function(node.target, node.args, node.kwargs,
                               normalize_to_only_use_kwargs=True)
    if found is None:
        return None
    kwargs = dict(found.kwargs)
    if kwargs.pop("size_average", None) is not None or kwargs.pop("reduce", None) is not None:
        return None
    return kwargs.pop("input", kwargs.pop("self", None)), kwargs.pop("target"), kwargs


def loss_of_logits(node: fx.Node) -> Optional[fx.Node]:
    """The cross-entropy of node's logits flattened to rows that is node's only use, if it
    is, through ops that act on each logit alone (`per_logit`: Cohere's logit scale,
    Granite's division, Gemma 2's soft-capping, a float cast), which keep vocab-split
    logits split: `cross_entropy(logits.flatten(0, -2), t)` (pipeplan's loss), or
    transformers' own (`loss = model`: `logits.float().view(-1, vocab)`, export's
    `cross_entropy_loss`), without class weights or label smoothing."""
    users = list(node.users)
    while len(users) == 1 and per_logit(users[0], node):
        node = users[0]
        users = list(node.users)
    if len(users) != 1 or not _to_rows(users[0], node):
        return None
    flat = users[0]
    losses = list(flat.users)
    found = cross_entropy_call(losses[0]) if len(losses) == 1 else None
    if found is None or found[0] is not flat or found[2]["weight"] is not None or \
            found[2]["label_smoothing"] != 0.0:
        return None
    return losses[0]


_VIEWS = (torch.ops.aten.view.default, torch.ops.aten.reshape.default,
          torch.ops.aten._unsafe_view.default, torch.reshape)
_CROSS_ENTROPY = (F.cross_entropy, torch.ops.aten.cross_entropy_loss.default)


def _to_rows(flat: fx.Node, logits: fx.Node) -> bool:
    """Is `flat` the logits [..., vocab] flattened to rows [N, vocab]: `flatten(0, -2)`, or a
    view / reshape to (-1 or N, vocab) where the graph's meta value gives vocab?"""
    if flat.op == "call_method" and flat.target == "flatten" or \
            flat.op == "call_function" and flat.target in _FLATTENS:
        return tuple(flat.args[1:]) == (0, -2)
    if not (flat.op == "call_method" and flat.target in ("view", "reshape")
            or flat.op == "call_function" and flat.target in _VIEWS):
        return False
    shape = flat.args[1] if len(flat.args) == 2 and isinstance(flat.args[1], (list, tuple)) \
        else flat.args[1:]
    value = logits.meta.get("val")
    if not isinstance(value, torch.Tensor) or value.dim() < 2 or len(shape) != 2:
        return False
    vocab = value.shape[-1]
    return shape[1] == vocab and shape[0] in (-1, value.numel() // max(vocab, 1))


def cross_entropy_call(node: fx.Node) -> Optional[tuple]:
    """(input, target, the other arguments by keyword, reduction as F names it) of a
    `cross_entropy` call reducing by the mean or the sum (F's or export's aten form); None
    otherwise. What the vocab-parallel loss hands torch's `F.cross_entropy`."""
    found = _loss_call(node, _CROSS_ENTROPY)
    if found is None:
        return None
    kwargs = found[2]
    kwargs["reduction"] = {1: "mean", 2: "sum"}.get(kwargs["reduction"], kwargs["reduction"])
    return found if kwargs["reduction"] in ("mean", "sum") else None


_PER_LOGIT_FNS = {operator.mul, operator.truediv, operator.add, operator.sub, torch.mul,
                  torch.div, torch.add, torch.sub, torch.tanh}
_PER_LOGIT_METHODS = {"mul", "div", "add", "sub", "tanh", "float", "to"}
_CASTS = (torch.ops.aten.to.dtype, torch.ops.aten._to_copy.default)


def per_logit(node: fx.Node, value: fx.Node) -> bool:
    """Does `node` apply one function to each element of `value` alone: a pointwise op whose
    other arguments are numbers, or a dtype cast? (On vocab-split logits it runs on each
    rank's share; a reduction over the vocabulary would not.)"""
    if node.op == "call_method":
        known = node.target in _PER_LOGIT_METHODS
    elif node.op == "call_function":
        t = node.target
        known = t in _PER_LOGIT_FNS or t in _CASTS or (
            isinstance(t, torch._ops.OpOverload) and torch.Tag.pointwise in t.tags)
    else:
        return False
    rest = [a for a in node.args if a is not value] + list(node.kwargs.values())
    return known and value in node.args and \
        all(a is None or isinstance(a, (bool, int, float, torch.dtype)) for a in rest)


# ------------------------------------------------------------ compile-time checks
def tp_annotations(plan: Plan, model: torch.nn.Module) -> dict[str, str]:
    """qualified module -> "column" | "row" | "vocab", checked against the parameters' shapes.
    `tensor.plan = model`, or no `tensor` patterns (unless `plan = patterns`): the model's
    own plan (`model_tp_plan`) or a refusal. `tensor.plan = auto`: none yet (the pairs are
    found in the captured graph: tp_auto.auto_tp_plan)."""
    if plan.tensor.plan == "auto":
        return {}
    if plan.tensor.plan == "model":
        return model_tp_plan(plan, model, "tensor.plan")
    if not any(getattr(plan.tensor, kind) for kind in KINDS):
        if plan.tensor.plan == "patterns":
            raise PlanError.at(plan, "tensor.plan", f"mesh.tp = {plan.mesh.tp} splits nothing: "
                               "tensor.plan = patterns but the section names no column, row "
                               "or vocab patterns", "name the modules to split, or set "
                               "tensor.plan = model to use the model's own plan")
        return model_tp_plan(plan, model)
    tp = plan.mesh.tp
    modules = dict(model.named_modules())
    names = [n for n in modules if n]
    out: dict[str, str] = {}
    for kind in KINDS:
        for i, pattern in enumerate(getattr(plan.tensor, kind)):
            key = f"tensor.{kind}.{i}"
            hits = [n for n in names if matches(n, pattern)]
            if not hits:
                close = difflib.get_close_matches(pattern, names, n=1)
                raise PlanError.at(plan, key, f"no module matches {pattern!r}",
                                   f"did you mean {close[0]!r}?" if close else
                                   "patterns are module paths such as layers.*.attn.q")
            for name in hits:
                _check_shape(plan, key, kind, name, modules[name], tp)
                out.setdefault(name, kind)
    _check_tied(plan, model, out)
    return out


def model_tp_plan(plan: Plan, model: torch.nn.Module, key: str = "mesh.tp") -> dict[str, str]:
    """The split a Hugging Face model declares for itself (tp_model.py: `model.tp_plan` or
    `config.base_model_tp_plan`), checked like the plan's own, errors at `key`; refused
    when the model has none (a tp that split nothing would run every rank on the whole
    model). A plan that distributes experts may use tp ranks for expert parallelism alone."""
    declared = declared_plan(model)
    if not declared:
        if plan.experts is not None and plan.mesh.ep > 1 and key == "mesh.tp":
            return {}
        raise PlanError.at(plan, key, f"mesh.tp = {plan.mesh.tp} splits nothing: the "
                           "plan has no `tensor` patterns and the model declares no tensor-"
                           "parallel plan (tp_plan / config.base_model_tp_plan)",
                           "name Megatron's pairs, e.g. tensor { column = [layers.*.attn.q, "
                           "layers.*.mlp.up]  row = [layers.*.attn.proj, layers.*.mlp.down] }, "
                           "or set mesh.tp = 1")
    modules = dict(model.named_modules())
    out: dict[str, str] = {}
    for pattern, style in declared.items():
        kind = HF_STYLES.get(style)
        if kind is None:
            known = ", ".join(s for s in HF_STYLES)
            raise PlanError.at(plan, key, f"the model's tensor-parallel plan splits "
                               f"{pattern} as {style!r}, which pipeplan's rewrite does not "
                               f"run (it runs {known})",
                               "write the split in a tensor section: column / row / vocab")
        for name in modules:
            if kind and name and matches(name, pattern):
                _check_shape(plan, key, kind, name, modules[name], plan.mesh.tp)
                out.setdefault(name, kind)
    _check_tied(plan, model, out)
    return out


def _check_shape(plan: Plan, key: str, kind: str, name: str, module: torch.nn.Module,
                 tp: int) -> None:
    w = module._parameters.get("weight")
    if w is None or w.dim() != 2:
        raise PlanError.at(plan, key, f"{name} ({type(module).__name__}) has no 2-d `weight` "
                           f"for {kind}-parallel to split",
                           "name the Linear (or Embedding) modules themselves")
    if getattr(module, "max_norm", None) is not None:
        raise PlanError.at(plan, key, f"{name} renormalises its rows (max_norm); a split "
                           "embedding table cannot", "drop max_norm or leave it unsplit")
    if kind != "vocab" and not isinstance(module, torch.nn.Linear):
        return  # the layout its graph uses decides the dim (check_pairing: _check_layouts)
    _check_divides(plan, key, kind, name, w, shard_dim(kind, "weight"), tp)


def _check_divides(plan: Plan, key: str, kind: str, name: str, w, dim: int, tp: int) -> None:
    size = w.shape[dim]
    what = {"column": "output features", "row": "input features",
            "vocab": "vocabulary"}[kind]
    if size % tp:
        said = f"the vocabulary of {name} ({size})" if kind == "vocab" else \
            f"the {size} {what} of {name}"
        raise PlanError.at(plan, key, f"tp = {tp} does not divide {said}",
                           "pad the vocabulary to a multiple of tp" if kind == "vocab" else
                           "pick tp among the divisors of the layer width")


def _holders(model: torch.nn.Module) -> list[list[tuple[str, str]]]:
    """Per parameter (a tied one once), the (module, leaf name) of every holder."""
    out: dict[int, list[tuple[str, str]]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        owner, _, leaf = name.rpartition(".")
        out.setdefault(id(p), []).append((owner, leaf))
    return list(out.values())


def _check_tied(plan: Plan, model: torch.nn.Module, kinds: dict[str, str]) -> None:
    """A weight tied between modules must be split alike in all of them, or not at all."""
    holders = [{owner: shard_dim(kinds[owner], leaf) if kinds.get(owner) else None
                for owner, leaf in held} for held in _holders(model)]
    for owners in holders:
        if len(set(owners.values())) > 1:
            listed = ", ".join(f"{n} ({'dim %d' % d if d is not None else 'not split'})"
                               for n, d in owners.items())
            split = next(n for n, d in owners.items() if d is not None)
            raise PlanError.at(plan, _key_of(plan, kinds[split], split),
                               f"a tied weight would be split differently by its modules: "
                               f"{listed}", "list them all in the same pattern kind")


def _tied_owners(model: torch.nn.Module, used: set[str]) -> set[str]:
    """`used` with every module holding the same weight as one in it: a tied weight is
    named after one of its owners in a captured graph, and which one depends on how it was
    captured (export names BLOOM's tied table after the head on a CPU model, after the
    embedding on meta), so the modules holding it apply it alike (_check_tied splits them
    alike)."""
    owners = [{owner for owner, leaf in held if leaf == "weight"} for held in _holders(model)]
    return used.union(*(o for o in owners if o & used))


def check_pairing(plan: Plan, graph: fx.Graph, model: torch.nn.Module, kinds: dict[str, str],
                  run) -> None:
    """On the captured graph: every split module has a Linear-like use; tp divides the heads
    a column output is viewed as; Megatron's pairing (a column output reaches a row layer,
    or the cross-entropy as vocab-parallel logits; a row layer reads a column output).
    Only tensor values carry features (`run.is_tensor(node)`); sizes read off a tensor do not."""
    if not kinds:
        return
    uses = linear_uses(graph, model)
    linear = {n: use.module for n, use in uses.items()}
    used = _tied_owners(model, set(linear.values()) | set(embedding_calls(graph, model).values()))
    _check_layouts(plan, model, kinds, uses)
    for name, kind in kinds.items():
        if name not in used:
            raise PlanError.at(plan, _key_of(plan, kind, name),
                               f"{name} matches a {kind} pattern but the graph never applies "
                               f"its weight as a Linear or an embedding table",
                               "tensor patterns name modules whose weight the model uses in "
                               "linear(x, weight) or embedding(ids, weight)")
    is_tensor = carries_features(plan, run)
    for node, name in linear.items():
        kind = kinds.get(name)
        if kind in ("column", "vocab") and loss_of_logits(node) is not None:
            continue  # vocab-parallel cross-entropy on the split logits
        if kind == "column":
            key = _key_of(plan, "column", name)
            out = features_out(node, run)
            find_segments(plan, key, name, node, run, out)
            _check_kept(plan, key, name, out, run)
            conv = convolution_between(node, linear, is_tensor)
            if conv is not None:
                raise PlanError.at(plan, key, f"column-parallel {name}'s split output passes "
                                   f"through a convolution (`{conv.name}`) before a row "
                                   "layer: its weight holds every channel, and tp splits "
                                   "no convolution", "leave this projection whole (drop it "
                                   "and its row from the tensor patterns)")
            for hit in first_linears(node, linear, True, is_tensor):
                if hit is None or kinds.get(linear[hit]) != "row":
                    what = "the loss" if hit is None else \
                        f"{linear[hit]}, which is not row-parallel"
                    raise PlanError.at(plan, _key_of(plan, "column", name),
                                       f"column-parallel {name} feeds {what}",
                                       "Megatron pairing: each column-parallel layer's output goes "
                                       "(through elementwise ops or attention) into a row-parallel "
                                       "layer; annotate that layer as row")
        elif kind == "row":
            for hit in first_linears(node, linear, False, is_tensor):
                if hit is None or kinds.get(linear[hit]) != "column":
                    what = "the model input" if hit is None else \
                        f"{linear[hit]}, which is not column-parallel"
                    raise PlanError.at(plan, _key_of(plan, "row", name),
                                       f"row-parallel {name} reads {what}",
                                       "Megatron pairing: a row-parallel layer reads the split "
                                       "features a column-parallel layer computed")
    check_sequence_parallel(plan, graph, model, kinds, run, linear)


def carries_features(plan: Plan, run, inputs: bool = True):
    """Whether a node's value carries features along a path between Linears: a tensor, or a
    split's list of tensors; of the placeholders, the model's inputs but those the data's
    `positions` feed (RoPE angles, not features), or none (`inputs=False`)."""
    positions = {name for name, source in plan.data.inputs
                 if source in ("positions", "document_positions")}

    def is_tensor(n: fx.Node) -> bool:
        if n.op == "placeholder":
            return inputs and n.target not in positions
        value = run.values.get(n)
        return run.is_tensor(n) or isinstance(value, (tuple, list)) and \
            any(isinstance(v, torch.Tensor) for v in value)
    return is_tensor


def check_sequence_parallel(plan: Plan, graph: fx.Graph, model: torch.nn.Module,
                            kinds: dict[str, str], run, linear: Optional[dict] = None) -> None:
    """Under sequence parallel the stream between tp pairs holds 1/tp of the positions; an
    attention op whose queries no column layer computes reads it there, and attention mixes
    positions: refused (splitting only the MLP left attention on sequence shards, which
    crashed in the first forward or, with a mask of the whole length, in its shapes).
    `linear`: linear_calls(graph, model), where the caller has it."""
    if not plan.tensor.sequence_parallel:
        return
    linear = linear_calls(graph, model) if linear is None else linear
    is_tensor = carries_features(plan, run)
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in SDPA:
            continue
        if any(hit is not None and kinds.get(linear[hit]) == "column"
               for hit in first_linears(node.args[0], linear, False, is_tensor)):
            continue
        where = module_path(node)
        raise PlanError.at(plan, "tensor.sequence_parallel",
                           f"attention (node `{node.name}`"
                           + (f" in module `{where}`" if where else "") + ") is not inside a "
                           "tensor-parallel pair: under sequence parallel its input would hold "
                           f"1/{plan.mesh.tp} of the positions, which attention mixes",
                           "split its q, k, v and output projections (column / row), or set "
                           "sequence_parallel = false")


def features_out(node: fx.Node, run) -> fx.Node:
    """Where a Linear use's output has the model's own leading dims: the use itself, or the
    one view back from the rows its tokens were flattened to (Conv1D: addmm on [tokens,
    in], viewed to [..., out]), marked ROWS_RESTORED for the rewrite's recut (fused.py)."""
    users = list(node.users)
    if len(users) != 1 or not is_view(users[0]) or not run.is_tensor(users[0]):
        return node
    before, after = run.value(node).shape, run.value(users[0]).shape
    if len(before) == 2 and len(after) > 2 and after[-1] == before[-1]:
        users[0].meta[ROWS_RESTORED] = True
        return users[0]
    return node


def _check_layouts(plan: Plan, model: torch.nn.Module, kinds: dict[str, str],
                   uses: dict[fx.Node, LinearUse]) -> None:
    """Each split module's weight used in one layout, which tp divides on its split dim;
    a weight stored [in, out] (Conv1D) not under sequence parallel (its op multiplies the
    tokens flattened to rows, whose split is no sequence split)."""
    layouts: dict[str, set] = {}
    for use in uses.values():
        if use.module in kinds:
            layouts.setdefault(use.module, set()).add(use.in_out)
    for name, found in layouts.items():
        kind, key = kinds[name], _key_of(plan, kinds[name], name)
        if len(found) > 1:
            raise PlanError.at(plan, key, f"{name}'s weight is used both as [out, in] "
                               "(x @ W.T) and as [in, out] (x @ W), so no one dim of it "
                               "holds its output features", "leave it out of the patterns")
        in_out = found.pop()
        w = model.get_submodule(name)._parameters["weight"]
        _check_divides(plan, key, kind, name, w, shard_dim(kind, "weight", in_out), plan.mesh.tp)
        if in_out and plan.tensor.sequence_parallel:
            raise PlanError.at(plan, "tensor.sequence_parallel", f"{name} multiplies the tokens "
                               "flattened to rows by a weight stored [in, out] (x @ W: "
                               "GPT-2's Conv1D), whose rows are no sequence shards; sequence "
                               "parallel is not run on it", "set sequence_parallel = false")


def _check_kept(plan: Plan, key: str, name: str, out: fx.Node, run) -> None:
    """Column output `out` keeps its split (whole heads, whole parts on each rank) up to
    the ops that compute with it (tp_follow.py); else refused at `key`."""
    found = gathered_at(out, run, plan.mesh.tp, name)
    if found is not None:
        raise PlanError.at(plan, key, found,
                           "each tensor-parallel rank must hold whole attention heads (GQA: "
                           "tp must divide the key/value heads too; multi-query attention "
                           "keeps its fused projection whole: leave it and its row partner "
                           "out of the patterns)")


@dataclass(frozen=True)
class LinearUse:
    """One application of a module's weight as a Linear: `x @ W^T (+ b)` with W stored
    [out, in] (`linear`, a Linear's call, `x @ W.T` as Falcon writes it), or `x @ W (+ b)`
    with W stored [in, out] (`in_out`: GPT-2's Conv1D, `addmm(b, x, W)` on the tokens
    flattened to rows). Either way the output's last dim is the module's output features."""

    module: str
    x: fx.Node  # the activation operand
    weight: Optional[fx.Node] = None  # its get_attr (None: an fx call of the Linear module)
    bias: Optional[fx.Node] = None  # a bias the same op adds (linear's, addmm's)
    in_out: bool = False


_ADDMMS = (torch.ops.aten.addmm.default, torch.addmm)
_MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.matmul.default, torch.mm, torch.matmul,
            operator.matmul)
_TRANSPOSES = (torch.ops.aten.t.default, torch.ops.aten.numpy_T.default, torch.t)


def _weight(n) -> Optional[fx.Node]:
    """`n` if it reads a module's `.weight` parameter (a get_attr), else None."""
    ok = isinstance(n, fx.Node) and n.op == "get_attr" and n.target.endswith(".weight")
    return n if ok else None


def _transposed_weight(n) -> Optional[fx.Node]:
    """The weight get_attr `n` transposes (W.T, W.t(), t(W), transpose(W, 0, 1),
    permute(W, [1, 0])), else None."""
    if not isinstance(n, fx.Node) or not n.args:
        return None
    w = _weight(n.args[0])
    rest = tuple(n.args[1:])
    if n.op == "call_function" and n.target in _TRANSPOSES and not rest \
            or n.op == "call_method" and n.target == "t" and not rest \
            or n.op == "call_function" and n.target is getattr and rest == ("T",):
        return w
    if n.op == "call_function" and n.target == torch.ops.aten.transpose.int \
            or n.op == "call_method" and n.target == "transpose":
        return w if {d % 2 for d in rest if isinstance(d, int)} == {0, 1} and len(rest) == 2 \
            else None
    if n.op == "call_function" and n.target == torch.ops.aten.permute.default \
            or n.op == "call_method" and n.target == "permute":
        dims = rest[0] if len(rest) == 1 else rest
        ok = all(isinstance(d, int) for d in dims) and [d % 2 for d in dims] == [1, 0]
        return w if ok else None
    return None


def _right_operand(operand) -> tuple[Optional[fx.Node], bool]:
    """(the weight, stored [in, out]?) of a product's right operand: W itself (x @ W) or W
    transposed (x @ W.T); (None, False) when it is neither."""
    w = _weight(operand)
    return (w, True) if w is not None else (_transposed_weight(operand), False)


def linear_use(n: fx.Node, modules: dict) -> Optional[LinearUse]:
    """How `n` applies a module's weight as a Linear (None: it does not)."""
    if n.op == "call_module":
        if isinstance(modules.get(n.target), torch.nn.Linear):
            return LinearUse(n.target, n.args[0])
        return None
    if n.op != "call_function" or len(n.args) < 2:
        return None
    if n.target in LINEARS:
        w, bias = _weight(n.args[1]), n.args[2] if len(n.args) > 2 else n.kwargs.get("bias")
        x, in_out = n.args[0], False
    elif n.target in _ADDMMS and len(n.args) == 3 and not n.kwargs:
        bias, x, operand = n.args
        w, in_out = _right_operand(operand)
    elif n.target in _MATMULS and len(n.args) == 2 and not n.kwargs:
        (x, operand), bias = n.args, None
        w, in_out = _right_operand(operand)
    else:
        return None
    if w is None or not isinstance(x, fx.Node):
        return None
    return LinearUse(w.target.rpartition(".")[0], x, w, bias, in_out)


def linear_uses(graph: fx.Graph, model: torch.nn.Module) -> dict[fx.Node, LinearUse]:
    """Every node of the graph that applies a module's weight as a Linear (`linear_use`)."""
    modules = dict(model.named_modules())
    out = {}
    for n in graph.nodes:
        use = linear_use(n, modules)
        if use is not None:
            out[n] = use
    return out


def linear_calls(graph: fx.Graph, model: torch.nn.Module) -> dict[fx.Node, str]:
    """Graph nodes applying a module's weight as a Linear -> the module's qualified name."""
    return {n: use.module for n, use in linear_uses(graph, model).items()}


def embedding_calls(graph: fx.Graph, model: torch.nn.Module) -> dict[fx.Node, str]:
    modules = dict(model.named_modules())
    out = {}
    for n in graph.nodes:
        if n.op == "call_module" and isinstance(modules.get(n.target), torch.nn.Embedding):
            out[n] = n.target
        elif n.op == "call_function" and n.target in EMBEDDINGS:
            w = embedding_weight(n)
            if isinstance(w, fx.Node) and w.op == "get_attr" and w.target.endswith(".weight"):
                out[n] = w.target.rpartition(".")[0]
    return out


def first_linears(start: fx.Node, linear: dict[fx.Node, str], forward: bool, is_tensor):
    """The first Linear calls reached from `start` along tensor values (None: the graph's
    end, or the model's inputs)."""
    seen, frontier = {start}, list(_next(start, forward, is_tensor))
    while frontier:
        n = frontier.pop()
        if n in seen:
            continue
        seen.add(n)
        if n in linear:
            yield n
        elif n.op in ("output", "placeholder"):
            yield None
        elif n.op != "get_attr":  # parameters are not activations
            following = list(_next(n, forward, is_tensor))
            if forward and not following:
                yield None
            frontier.extend(following)


def _next(n: fx.Node, forward: bool, is_tensor):
    nodes = n.users if forward else n.all_input_nodes
    return [m for m in nodes if m.op == "output" or is_tensor(m)]


def _key_of(plan: Plan, kind: str, name: str) -> str:
    """The plan line that split `name` (mesh.tp: the model's own plan, `model_tp_plan`)."""
    for i, pattern in enumerate(getattr(plan.tensor, kind)):
        if matches(name, pattern):
            return f"tensor.{kind}.{i}"
    if plan.tensor.plan in ("model", "auto"):
        return "tensor.plan"
    return f"tensor.{kind}" if any(getattr(plan.tensor, k) for k in KINDS) else "mesh.tp"


_SIZE_METHODS = {"size", "dim", "numel", "stride", "get_device"}
_SIZE_FUNCTIONS = {torch.ops.aten.sym_size.int, torch.ops.aten.sym_numel.default,
                   torch.ops.aten.sym_stride.int}
_TENSOR_ATTRS = {"T", "mT", "H", "mH", "real", "imag", "data"}


def _is_size_query(n: fx.Node) -> bool:
    if n.op == "call_method":
        return n.target in _SIZE_METHODS
    if n.op == "call_function":
        if n.target is getattr:
            return n.args[1] not in _TENSOR_ATTRS
        return n.target in _SIZE_FUNCTIONS
    return False


def graph_made_uses(gm: fx.GraphModule) -> list[tuple[fx.Node, list[fx.Node]]]:
    """Values a stage graph computes from no received input, parameter or buffer (batch
    fields, constants and what is made from them alone -- T5's labels shifted into decoder
    ids --, factories such as `arange`, masks built from sizes) where they meet values that
    are (a leaf call with parameters or buffers counts as one): the tensor-parallel rewrite
    (backends/parallel/tp/rewrite.py) wraps each there as a Replicate DTensor, every
    microbatch, where it is a tensor (sizes pass through: StageSpec.made counts the
    tensors, what the time model charges, estimate/optime.dtensor_host); with the users
    that meet them. Its other users stay on plain tensors: a value made for both (GPT-J's
    positions, which index its rotary table and build its mask) is wrapped for those
    only."""
    def holds_tensors(n: fx.Node) -> bool:
        mod = gm.get_submodule(n.target)
        return any(True for _ in mod.parameters()) or any(True for _ in mod.buffers())

    tainted: set[fx.Node] = set()
    made = []
    for n in gm.graph.nodes:
        if n.meta.get(BATCH) or n.meta.get(CONSTANT):
            made.append(n)  # a batch field or a constant: plain until it meets a stage value
        elif n.op in ("placeholder", "get_attr") or n.op == "call_module" and holds_tensors(n):
            tainted.add(n)  # (a leaf call with parameters computes with DTensors)
        elif n.op in ("call_function", "call_method", "call_module"):
            if any(a in tainted for a in n.all_input_nodes):
                if not _is_size_query(n):
                    tainted.add(n)
            elif not _is_size_query(n):
                made.append(n)
    uses = [(n, [u for u in n.users if u in tainted]) for n in made]
    return [(n, users) for n, users in uses if users]


def graph_made(gm: fx.GraphModule) -> list[fx.Node]:
    """The graph-made values that meet stage values (graph_made_uses, without the uses)."""
    return [n for n, _ in graph_made_uses(gm)]
