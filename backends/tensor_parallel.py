"""Tensor parallelism (Megatron-style) over a TP process group, with optional sequence parallel.

`apply_tensor_parallel(module, rules, group)` rewrites a module in place: each
submodule matched by a pattern is replaced by its parallel form, built by
slicing the existing full parameters (so rank r's shard equals the reference's
weights exactly), keeping attribute and parameter names (state_dict keys stay
the reference's; only the shapes are local).

    column  Linear  weight rows (out features) split; output stays split
    row     Linear  weight columns (in features) split; partial outputs summed
    vocab   Embedding rows split (ids outside the shard give 0, then summed);
            Linear (an LM head) column-split with its output gathered to full vocab
    attention modules (`heads` + q/k/v/proj children) whose q/k/v are column
            and proj row parallel run heads // tp local heads (q, k, v share
            one entry into the TP region, as a fused QKV)

`vocab_parallel_loss(graph_module, group)` then keeps a vocab-parallel LM
head's logits split where the graph only feeds them to `F.cross_entropy`,
computing the loss from the shards (`vocab_parallel_cross_entropy`).

The conjugate operators are autograd Functions: `f` (identity forward,
all-reduce backward) where a replicated activation enters a column-parallel
layer, `g` (all-reduce forward, identity backward) after a row-parallel one.

Sequence parallel (`rules.sequence_parallel`): activations outside TP regions
are split along the sequence dimension (dim -2) over the TP group, so norms,
dropout and residual adds work on 1/tp of the tokens. A column-parallel layer
all-gathers its input (backward: reduce-scatter), a row-parallel layer
reduce-scatters its output (backward: all-gather), a vocab embedding
reduce-scatters, a replicated embedding keeps its rank's positions. The module
itself enters the region by splitting its floating inputs and leaves it by
gathering the outputs that are sequence shards (dim -2 of length T / tp, T read
from the inputs), so what crosses its boundary is full-sized.
Replicated parameters used on sequence shards (norms, row-parallel biases) get
partial gradients: `sync_sequence_parallel_grads` sums them over the group.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from ..compiler.patterns import matches_any
from ..errors import PipeplanError

SEQ_DIM = -2


# ------------------------------------------------------------ group helpers
def _size(group) -> int:
    return dist.get_world_size(group)


def _rank(group) -> int:
    return dist.get_rank(group)


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    x = x.clone()
    dist.all_reduce(x, group=group)
    return x


def _all_gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _split(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    return x.chunk(_size(group), dim=dim)[_rank(group)].contiguous()


def _reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    parts = [p.contiguous() for p in x.chunk(_size(group), dim=dim)]
    out = torch.empty_like(parts[0])
    dist.reduce_scatter(out, parts, group=group)
    return out


def _check_divides(size: int, group, what: str) -> None:
    if size % _size(group):
        raise PipeplanError(f"tensor parallel size {_size(group)} does not divide {what} ({size})")


# ------------------------------------------------- conjugate autograd operators
class _CopyToRegion(torch.autograd.Function):
    """f: identity forward; backward all-reduces the partial input gradients."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    """g: all-reduce forward (sum the partial outputs); identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherLastDim(torch.autograd.Function):
    """All-gather the split last dim into a replicated tensor; backward keeps the own slice."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, -1, ctx.group), None


class _ScatterSeq(torch.autograd.Function):
    """Enter the sequence-parallel region: keep this rank's positions; backward all-gathers."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, SEQ_DIM, ctx.group), None


class _GatherSeq(torch.autograd.Function):
    """Leave the sequence-parallel region to a replicated consumer; backward keeps own slice."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, SEQ_DIM, ctx.group), None


class _GatherSeqToTP(torch.autograd.Function):
    """All-gather the sequence into a TP region; the region's gradients are partial sums."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, SEQ_DIM, ctx.group), None


class _ReduceScatterSeq(torch.autograd.Function):
    """Sum a TP region's partial outputs, keeping this rank's positions; backward all-gathers."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, SEQ_DIM, ctx.group), None


def copy_to_tp(x, group):
    return _CopyToRegion.apply(x, group)


def reduce_from_tp(x, group):
    return _ReduceFromRegion.apply(x, group)


def gather_last_dim(x, group):
    return _GatherLastDim.apply(x, group)


def scatter_to_sequence(x, group):
    return _ScatterSeq.apply(x, group)


def gather_from_sequence(x, group):
    return _GatherSeq.apply(x, group)


def gather_sequence_to_tp(x, group):
    return _GatherSeqToTP.apply(x, group)


def reduce_scatter_to_sequence(x, group):
    return _ReduceScatterSeq.apply(x, group)


# ------------------------------------------------------------ parallel layers
class ParameterSlicer:
    """Slices full parameters once per (parameter, dim), so tied weights stay tied.

    Share one slicer between all stage modules of a rank: a weight tied across
    two of its stages (embedding and LM head in a V schedule) then stays one
    Parameter, as it was before the rewrite.
    """

    def __init__(self, group):
        self.group = group
        # (id(full), dim) -> (full, shard); holding `full` keeps its id from being reused
        self._memo: dict[tuple[int, int], tuple[nn.Parameter, nn.Parameter]] = {}

    def shards(self) -> list[nn.Parameter]:
        return [shard for _, shard in self._memo.values()]

    def __call__(self, p: Optional[nn.Parameter], dim: int) -> Optional[nn.Parameter]:
        if p is None:
            return None
        key = (id(p), dim)
        if key not in self._memo:
            shard = _split(p.detach(), dim, self.group).clone()
            self._memo[key] = (p, nn.Parameter(shard, requires_grad=p.requires_grad))
        return self._memo[key][1]


class ColumnParallelLinear(nn.Module):
    """Linear with output features split; `gather_output` re-assembles them (LM head)."""

    def __init__(self, linear: nn.Linear, group, sliced: ParameterSlicer, sequence_parallel=False,
                 gather_output=False):
        super().__init__()
        _check_divides(linear.out_features, group, "output features of a column-parallel Linear")
        self.group, self.sequence_parallel, self.gather_output = group, sequence_parallel, gather_output
        self.weight = sliced(linear.weight, 0)
        self.bias = sliced(linear.bias, 0)
        self.out_start = _rank(group) * (linear.out_features // _size(group))
        self.tp_shard_dims = {"weight": 0, "bias": 0}

    def enter(self, x):
        """Bring a replicated (or sequence-sharded) input into the TP region."""
        if self.sequence_parallel:
            return gather_sequence_to_tp(x, self.group)
        return copy_to_tp(x, self.group)

    def local(self, x):
        """This rank's output features, for an input already in the TP region."""
        return F.linear(x, self.weight, self.bias)

    def forward(self, x):
        y = self.local(self.enter(x))
        return gather_last_dim(y, self.group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """Linear with input features split; partial products summed, then the full bias added."""

    def __init__(self, linear: nn.Linear, group, sliced: ParameterSlicer, sequence_parallel=False):
        super().__init__()
        _check_divides(linear.in_features, group, "input features of a row-parallel Linear")
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = sliced(linear.weight, 1)
        self.bias = linear.bias  # replicated
        self.tp_shard_dims = {"weight": 1}

    def forward(self, x):
        y = F.linear(x, self.weight)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence(y, self.group)
        else:
            y = reduce_from_tp(y, self.group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split over the vocabulary; each id is looked up by its owner rank."""

    def __init__(self, emb: nn.Embedding, group, sliced: ParameterSlicer, sequence_parallel=False):
        super().__init__()
        _check_divides(emb.num_embeddings, group, "the vocabulary of a vocab-parallel Embedding")
        if emb.padding_idx is not None or emb.max_norm is not None:
            raise PipeplanError("vocab-parallel Embedding with padding_idx or max_norm is not "
                                "supported yet")
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = sliced(emb.weight, 0)
        per = emb.num_embeddings // _size(group)
        self.vocab_start, self.vocab_stop = _rank(group) * per, (_rank(group) + 1) * per
        self.tp_shard_dims = {"weight": 0}

    def forward(self, ids):
        outside = (ids < self.vocab_start) | (ids >= self.vocab_stop)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        y = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence(y, self.group)
        return reduce_from_tp(y, self.group)


class HeadParallelAttention(nn.Module):
    """Causal multi-head attention on this rank's heads (q/k/v column, proj row parallel).

    The layout of examples/models/gpt.py:Attention; its forward reads the model
    width from the input, which is wrong for a head shard, so the module is
    replaced by this one: the same math with widths taken from the local q.
    q, k and v share one entry into the TP region (as Megatron's fused QKV).
    """

    def __init__(self, attn: nn.Module, group):
        super().__init__()
        _check_divides(attn.heads, group, "the attention heads")
        self.heads = attn.heads // _size(group)
        self.q, self.k, self.v, self.proj = attn.q, attn.k, attn.v, attn.proj

    def forward(self, x):
        # One entry for all three projections: one all-reduce of the input gradient
        # (sequence parallel: one all-gather and one reduce-scatter), not three.
        x = self.q.enter(x)
        q, k, v = self.q.local(x), self.k.local(x), self.v.local(x)
        b, t, width = q.shape
        h = self.heads

        def split_heads(z):
            return z.view(b, t, h, width // h).transpose(1, 2)

        y = F.scaled_dot_product_attention(split_heads(q), split_heads(k), split_heads(v),
                                           is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, width))


# ------------------------------------------------------------ vocab-parallel CE
class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy from logits split over the vocabulary (never gathered)."""

    @staticmethod
    def forward(ctx, logits, targets, vocab_start, group):
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 up; fp64 kept
        row_max = logits.max(dim=-1).values
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - row_max.unsqueeze(-1)
        width = logits.shape[-1]
        local_t = targets - vocab_start
        inside = (local_t >= 0) & (local_t < width)
        picked = shifted.gather(-1, local_t.clamp(0, width - 1).unsqueeze(-1)).squeeze(-1)
        picked = picked.masked_fill(~inside, 0.0)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        dist.all_reduce(picked, group=group)
        dist.all_reduce(sum_exp, group=group)
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), local_t, inside)
        return sum_exp.log() - picked

    @staticmethod
    def backward(ctx, grad):
        softmax, local_t, inside = ctx.saved_tensors
        g = softmax.clone()
        rows = inside.nonzero(as_tuple=True)
        g[rows + (local_t[rows],)] -= 1.0
        return g * grad.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor,
                                 vocab_start: int, group) -> torch.Tensor:
    """Per-token loss (shape of `targets`) from this rank's vocab slice of the logits."""
    flat = logits.reshape(-1, logits.shape[-1])
    loss = _VocabParallelCrossEntropy.apply(flat, targets.reshape(-1), vocab_start, group)
    return loss.view(targets.shape)


IGNORE_INDEX = -100  # F.cross_entropy's default


class VocabParallelLoss(nn.Module):
    """`F.cross_entropy(logits, targets)` (mean, ignore_index -100) on vocab-split logits."""

    def __init__(self, vocab_start: int, group):
        super().__init__()
        self.vocab_start, self.group = vocab_start, group

    def forward(self, logits, targets):
        valid = targets != IGNORE_INDEX
        per_token = vocab_parallel_cross_entropy(logits, targets, self.vocab_start, self.group)
        return (per_token * valid).sum() / valid.sum()


def _is_flatten_to_rows(node: fx.Node, source: fx.Node) -> bool:
    """`source.flatten(0, -2)`: rows of logits, the vocabulary dim kept last."""
    return (node.op == "call_method" and node.target == "flatten"
            and tuple(node.args) == (source, 0, -2) and not node.kwargs)


def _is_plain_cross_entropy(node: fx.Node, logits: fx.Node) -> bool:
    defaults = {"weight": None, "size_average": None, "ignore_index": IGNORE_INDEX,
                "reduce": None, "reduction": "mean", "label_smoothing": 0.0}
    return (node.op == "call_function" and node.target is F.cross_entropy
            and len(node.args) == 2 and node.args[0] is logits
            and all(defaults.get(k, object()) == v for k, v in node.kwargs.items()))


def vocab_parallel_loss(gm: fx.GraphModule, group) -> list[str]:
    """Keep a vocab-parallel LM head's logits split when the graph only takes their loss.

    Rewrites `F.cross_entropy(head(x).flatten(0, -2), t)` to a `VocabParallelLoss`
    on the local logits: the [tokens, vocab] logits are never gathered. Heads
    whose logits are used otherwise keep gathering them. Returns the heads rewritten.
    """
    done = []
    for node in list(gm.graph.nodes):
        if node.op != "call_module":
            continue
        head = gm.get_submodule(node.target)
        if not (isinstance(head, ColumnParallelLinear) and head.gather_output):
            continue
        users = list(node.users)
        if len(users) != 1 or not _is_flatten_to_rows(users[0], node):
            continue
        flat = users[0]
        losses = list(flat.users)
        if len(losses) != 1 or not _is_plain_cross_entropy(losses[0], flat):
            continue
        ce = losses[0]
        name = node.target.replace(".", "_") + "_vocab_loss"
        gm.add_submodule(name, VocabParallelLoss(head.out_start, group))
        with gm.graph.inserting_before(ce):
            new = gm.graph.call_module(name, ce.args)
        ce.replace_all_uses_with(new)
        gm.graph.erase_node(ce)
        head.gather_output = False
        done.append(node.target)
    if done:
        gm.recompile()
    return done


# ------------------------------------------------------------------ rewriting
@dataclass(frozen=True)
class TensorParallelRules:
    """Which submodules (plan module-path patterns) become which parallel form."""

    column: tuple[str, ...] = ()
    row: tuple[str, ...] = ()
    vocab: tuple[str, ...] = ()
    sequence_parallel: bool = False

    @staticmethod
    def from_plan(tensor_spec) -> "TensorParallelRules":
        return TensorParallelRules(tuple(tensor_spec.column), tuple(tensor_spec.row),
                                   tuple(tensor_spec.vocab), tensor_spec.sequence_parallel)

    def kind_of(self, name: str) -> Optional[str]:
        for kind in ("column", "row", "vocab"):
            if matches_any(name, getattr(self, kind)):
                return kind
        return None


@dataclass(frozen=True)
class TensorParallelResult:
    rewrites: dict = field(default_factory=dict)  # qualified module name -> kind
    sequence_partial: tuple[str, ...] = ()  # params whose grads are partial under SP


def replace_submodule(root: nn.Module, name: str, new: nn.Module) -> None:
    """Put `new` where the submodule `name` is (its attribute on its parent)."""
    parent, _, leaf = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, leaf, new)


def _parallel_form(kind: str, name: str, mod: nn.Module, group, sliced, sp: bool) -> nn.Module:
    if kind in ("column", "row") and isinstance(mod, nn.Linear):
        cls = ColumnParallelLinear if kind == "column" else RowParallelLinear
        return cls(mod, group, sliced, sp)
    if kind == "vocab" and isinstance(mod, nn.Embedding):
        return VocabParallelEmbedding(mod, group, sliced, sp)
    if kind == "vocab" and isinstance(mod, nn.Linear):
        return ColumnParallelLinear(mod, group, sliced, sp, gather_output=True)
    raise PipeplanError(f"tensor parallel: cannot make {type(mod).__name__} {name!r} "
                        f"{kind}-parallel (column/row take a Linear, vocab an Embedding or Linear)")


def _rewrite_attention(root: nn.Module, group) -> list[str]:
    """Replace attention modules whose q/k/v became column-parallel by a head-local form."""
    done = []
    for name, mod in list(root.named_modules()):
        children = [getattr(mod, c, None) for c in ("q", "k", "v")]
        if not any(isinstance(c, ColumnParallelLinear) for c in children):
            continue
        if not (hasattr(mod, "heads") and all(isinstance(c, ColumnParallelLinear) for c in children)
                and isinstance(getattr(mod, "proj", None), RowParallelLinear)):
            raise PipeplanError(
                f"tensor parallel: {name or 'the module'} splits q/k/v but is not an attention "
                f"module pipeplan can shard by heads (needs `heads`, column-parallel q, k, v and "
                f"row-parallel proj; a traced stage must keep attention as a leaf module)")
        replace_submodule(root, name, HeadParallelAttention(mod, group))
        done.append(name)
    return done


def own_positions(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's sequence shard of a replicated tensor, by plain slicing.

    Its backward fills the other positions with zeros: what flows back to
    parameters is partial (summed over the group with the other replicated
    parameters' gradients), unlike `scatter_to_sequence`, whose all-gather
    backward suits activations that need their whole gradient.
    """
    n = x.shape[SEQ_DIM] // _size(group)
    return x.narrow(SEQ_DIM, _rank(group) * n, n)


def _own_positions_hook(group):
    def hook(module, inputs, output):
        return own_positions(output, group)
    return hook


def _enter_sequence_parallel(root: nn.Module, group) -> None:
    """Split floating inputs along the sequence on entry, gather sequence shards on exit.

    The full sequence length T is read on entry (dim -2 of a floating input, or
    the last dim of integer ids); an output whose dim -2 is T / tp is a shard
    and is gathered, anything else (full logits, a scalar loss) passes as is.
    """
    tp = _size(group)
    seen = {}

    def is_activation(x):
        return torch.is_tensor(x) and x.is_floating_point() and x.dim() >= 2

    def pre(module, args):
        lengths = [a.shape[SEQ_DIM] if is_activation(a) else a.shape[-1]
                   for a in args if torch.is_tensor(a) and a.dim() >= 1]
        seen["seq"] = lengths[0] if lengths else None
        for n in lengths:
            _check_divides(n, group, "the sequence length (sequence parallel)")
        return tuple(scatter_to_sequence(a, group) if is_activation(a) else a for a in args)

    def leave(o):
        if is_activation(o) and seen["seq"] is not None and o.shape[SEQ_DIM] * tp == seen["seq"]:
            return gather_from_sequence(o, group)
        return o

    def post(module, args, out):
        return tuple(leave(o) for o in out) if isinstance(out, tuple) else leave(out)

    root.register_forward_pre_hook(pre)
    root.register_forward_hook(post)


def apply_tensor_parallel(module: nn.Module, rules: TensorParallelRules, group,
                          slicer: Optional[ParameterSlicer] = None) -> TensorParallelResult:
    """Rewrite `module` in place for the TP group; returns what was rewritten.

    `slicer`: shared by the stage modules of one rank (see ParameterSlicer).
    """
    sp = rules.sequence_parallel
    sliced = slicer if slicer is not None else ParameterSlicer(group)
    rewrites = {}
    for name, mod in list(module.named_modules()):
        kind = rules.kind_of(name) if name else None
        if kind is not None:
            replace_submodule(module, name, _parallel_form(kind, name, mod, group, sliced, sp))
            rewrites[name] = kind
    for name in _rewrite_attention(module, group):
        rewrites[name] = "attention"
    partial: list[str] = []
    if sp:
        for mod in module.modules():
            if isinstance(mod, nn.Embedding):  # a replicated embedding: keep own positions
                mod.register_forward_hook(_own_positions_hook(group))
        _enter_sequence_parallel(module, group)
        # Every replicated parameter now sees only this rank's positions (norms,
        # row biases, embeddings, a replicated LM head, MoE layers): its gradient
        # is partial, tied copies alike.
        sharded = {id(p) for p in sliced.shards()}
        partial = [n for n, p in module.named_parameters() if id(p) not in sharded]
    return TensorParallelResult(rewrites, tuple(partial))


def sync_sequence_parallel_grads(module: nn.Module, names: Iterable[str], group) -> None:
    """Sum the partial gradients of replicated parameters used on sequence shards."""
    params = dict(module.named_parameters())
    for n in names:
        p = params[n]
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)


def tp_shard_dims(module: nn.Module) -> dict[str, int]:
    """Qualified parameter name -> the dim it is split on, for every TP-sharded parameter."""
    dims = {}
    for name, mod in module.named_modules():
        for p, dim in getattr(mod, "tp_shard_dims", {}).items():
            if getattr(mod, p, None) is not None:
                dims[f"{name}.{p}" if name else p] = dim
    return dims


def gather_full(tensor: torch.Tensor, dim: Optional[int], group) -> torch.Tensor:
    """The full tensor of a TP shard split on `dim` (None: replicated, returned as a copy)."""
    return tensor.detach().clone() if dim is None else _all_gather(tensor.detach(), dim, group)


def gather_full_state(module: nn.Module, group) -> dict[str, torch.Tensor]:
    """state_dict with every TP-sharded tensor all-gathered to its full (reference) shape."""
    dims = tp_shard_dims(module)
    return {key: gather_full(value, dims.get(key), group)
            for key, value in module.state_dict().items()}
