"""Tensor parallelism as a rewrite of a stage GraphModule: the model's own ops on DTensors.

`apply_tensor_parallel(gm, rules, group)` shards the parameters the plan's
patterns name (`<module>.weight`, `<module>.bias`), then edits the graph so
that every tensor in it is a DTensor over the tp group (dtensor.py's nodes):

* received stage inputs and buffers enter as Replicate; batch fields, export's lifted
  constants and the values the graph makes from them alone (`arange`, masks, T5's
  shifted labels) stay plain tensors until they meet those, and enter there as
  Replicate (compiler/parallel/tp.graph_made_uses); replicated parameters as Replicate
  (under sequence parallel with a partial gradient, summed over tp once per step);
* a column (or vocab) parameter enters as Shard(0) -- Linear weights are
  [out, in], so the output features split -- and a row parameter as Shard(1)
  (swapped for a weight the graph applies stored [in, out]: GPT-2's Conv1D,
  compiler/parallel/tp.LinearUse);
* at a column-parallel use (`linear(x, W)`, `x @ W.T`, `addmm(b, x, W)`), x is
  redistributed to Replicate
  first: nothing forward (all-gather of the sequence under sequence parallel),
  and backward the partial input gradients all-reduced (reduce-scattered);
  column uses reading one value share one redistribution (Megatron's fused QKV);
  a column Linear whose output the graph cuts into parts (Phi-3's qkv_proj) holds
  its 1/tp of every part and its cuts are redone on that order (fused.py);
* a row-parallel use computes `linear(x, W)` (`mm(x, W)` for `addmm(b, x, W)`) on
  the split features (a Partial sum), redistributes it to Replicate -- all-reduce --
  or to Shard(seq) under sequence parallel -- reduce-scatter -- and only then adds
  the bias;
* a vocab-parallel embedding's output is redistributed as a row output;
* a column/vocab Linear whose logits go only to their cross-entropy as rows
  (`cross_entropy(logits.flatten(0, -2), t)`, or transformers' own loss:
  compiler/parallel/tp.loss_of_logits) keeps them sharded: the loss runs under torch's
  loss_parallel; a vocab Linear used otherwise gathers its logits;
* any other mean-reduced `cross_entropy` / `nll_loss` (the model's own loss) runs as
  `CountedMean`: on logits sharded along their rows (a whole LM head under sequence
  parallel), its summed loss over the weight its targets count, as the op defines its mean;
* stage outputs leave as full local tensors (sequence shards all-gathered).

Between those points the model's own ops run unchanged (views to heads,
RoPE, GQA's repeat, masks, SiLU ...): DTensor keeps global shapes, so the
captured literal shapes stay right, and its sharding propagation keeps heads
and features split -- but for two ops it would gather, run on the local blocks
instead (dtensor.py): attention (`HeadLocal`) and `baddbmm` over heads folded
into the batch (`BatchLocal`: BLOOM's ALiBi scores). A leaf call (fx
`call_module` of an unsplit module with parameters) sees its parameters as
Replicate DTensors for the call. Nothing
is chosen by attribute names: only the plan's patterns and the graph's uses.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.nn.utils.stateless import _reparametrize_module

from ....compiler.capture.blocks import ATTENTION, COLLECTIVE, TRACED_IN, module_path
from ....compiler.compiled import BATCH, CONSTANT
from ....compiler.parallel.tp import (EMBEDDINGS, LINEARS, MEAN_LOSSES, LinearUse,
                                      TensorParallelRules, counted_mean, cross_entropy_call,
                                      embedding_weight, graph_made_uses, linear_uses,
                                      loss_of_logits, shard_dim)
from ....errors import PipeplanError
from .dtensor import (BatchLocal, CountedMean, HeadLocal, Redistribute, ReplicatedParameter,
                      ToDTensor, ToLocal, VocabParallelLoss, WholeValues,
                      decompose_outside_fake, has_sharding_strategy,
                      views_follow_the_local_layout)
from .fused import SEGMENTS, fused_parameters, recut
from .params import SHARD_DIMS, ParameterSlicer, set_parameter

SEQ = "shard:-2"
SDPA = [F.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention.default]  # sequence parallel splits dim -2 ([..., seq, features])
BADDBMM = [torch.baddbmm, torch.ops.aten.baddbmm.default, "baddbmm"]  # (a method call's name)


@dataclass(frozen=True)
class TensorParallelResult:
    rewrites: dict = field(default_factory=dict)  # qualified module name -> kind
    sequence_partial: tuple[str, ...] = ()  # params whose grads are partial under SP


def _mesh(group, gm: nn.Module) -> DeviceMesh:
    p = next(iter(gm.parameters()), None)
    device = p.device.type if p is not None else "cpu"
    if device == "meta":  # stages are rewritten before their storage exists (model.fill_stages)
        device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    return DeviceMesh.from_group(group, device)


class _Builder:
    """Inserts the conversion modules (one instance per kind) and nodes calling them."""

    def __init__(self, gm: fx.GraphModule, mesh: DeviceMesh):
        self.gm, self.mesh, self.count = gm, mesh, 0
        self._modules: dict[str, str] = {}

    def module(self, key: str, make) -> str:
        if key not in self._modules:
            name = "tp_" + key.replace(":", "").replace("-", "m")
            self.gm.add_submodule(name, make())
            self._modules[key] = name
        return self._modules[key]

    def after(self, node: fx.Node, key: str, make, only=None) -> fx.Node:
        """Insert `module(node)` right after node and route node's other users (those in
        `only`, if given) to it."""
        with self.gm.graph.inserting_after(node):
            new = self.gm.graph.call_module(self.module(key, make), (node,))
        node.replace_all_uses_with(new, delete_user_cb=lambda u: u is not new and (
            only is None or u in only))
        return self.served(new, node)

    def before(self, user: fx.Node, value: fx.Node, key: str, make) -> fx.Node:
        with self.gm.graph.inserting_before(user):
            new = self.gm.graph.call_module(self.module(key, make), (value,))
        return self.served(new, user)

    def served(self, new: fx.Node, node: fx.Node) -> fx.Node:
        """`new` belongs to the module `node` was traced in (a recompute region stays one
        run of nodes)."""
        new.meta[TRACED_IN] = module_path(node)
        return new

    def to_dtensor(self, spec):
        return lambda: ToDTensor(self.mesh, spec)

    def redistribute(self, spec):
        return lambda: Redistribute(self.mesh, spec)


def _functional_form(gm: fx.GraphModule, node: fx.Node) -> None:
    """A call_module of a split Linear/Embedding -> the functional op on its get_attr nodes."""
    mod = gm.get_submodule(node.target)
    g = gm.graph
    with g.inserting_before(node):
        w = g.get_attr(f"{node.target}.weight")
        if isinstance(mod, nn.Linear):
            b = g.get_attr(f"{node.target}.bias") if mod.bias is not None else None
            new = g.call_function(F.linear, (node.args[0], w, b))
        elif isinstance(mod, nn.Embedding):
            new = g.call_function(F.embedding, (node.args[0], w, mod.padding_idx, mod.max_norm,
                                                mod.norm_type, mod.scale_grad_by_freq, mod.sparse))
        else:
            raise PipeplanError(f"tensor parallel: {node.target} is a {type(mod).__name__}; "
                                "only Linear and Embedding modules can be split")
    new.meta = dict(node.meta)
    for attr in new.all_input_nodes:
        if attr.op == "get_attr":
            attr.meta[TRACED_IN] = module_path(node)
    node.replace_all_uses_with(new)
    g.erase_node(node)


def _leaf_hooks(mod: nn.Module, convert) -> None:
    """Reparametrize a leaf module's own tensors with DTensors for the duration of a call."""
    stack = []

    def pre(m, args):
        values = {n: convert(n, t) for n, t in
                  list(m.named_parameters(remove_duplicate=False))
                  + list(m.named_buffers(remove_duplicate=False))}
        ctx = _reparametrize_module(m, values)
        ctx.__enter__()
        stack.append(ctx)

    def post(m, args, out):
        stack.pop().__exit__(None, None, None)

    mod.register_forward_pre_hook(pre)
    mod.register_forward_hook(post)


def _local_hooks(mod: nn.Module, split_tokens: bool = False) -> None:
    """A leaf that communicates by itself (pipeplan's expert-parallel layer) runs on this
    rank's local tensors; its tensor outputs take its first input's placement back.

    `split_tokens` (EP across TP: the TP peers are in one EP group and hold different
    experts): every input is first redistributed to Shard(0), so each TP rank hands
    the layer its 1/tp share of the token rows (from Replicate: a local slice, no
    communication; backward: an all-gather of the rows' gradients); the output rows,
    Shard(0), are redistributed back to the first input's placement (from Shard(0) to
    Replicate: an all-gather; backward: each rank keeps its rows' gradient, or a
    reduce-scatter of a partial one)."""
    seen = []

    def local(a):
        if not isinstance(a, DTensor):
            return a
        if split_tokens:
            a = a.redistribute(a.device_mesh, [Shard(0)])
        return a.to_local()

    def pre(m, args):
        first = next((a for a in args if isinstance(a, DTensor)), None)
        seen.append(first)
        return tuple(local(a) for a in args)

    def post(m, args, out):
        like = seen.pop()
        if like is None:
            return out

        def back(o):
            if not isinstance(o, torch.Tensor) or isinstance(o, DTensor):
                return o
            mesh = like.device_mesh
            if split_tokens and o.dim() >= 1:
                shape = torch.Size((like.shape[0],) + tuple(o.shape[1:]))
                rows = DTensor.from_local(o, mesh, [Shard(0)], run_check=False, shape=shape,
                                          stride=_contiguous_stride(shape))
                return rows.redistribute(mesh, like.placements if o.dim() == like.dim()
                                         else [Replicate()])
            p = like.placements if o.dim() == like.dim() else [Replicate()]
            return DTensor.from_local(o, mesh, p, run_check=False)
        return tuple(back(o) for o in out) if isinstance(out, tuple) else back(out)

    mod.register_forward_pre_hook(pre)
    mod.register_forward_hook(post)


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(stride))


def apply_tensor_parallel(gm: fx.GraphModule, rules: TensorParallelRules, group,
                          slicer: Optional[ParameterSlicer] = None,
                          local_modules: frozenset = frozenset(),
                          split_tokens: bool = False) -> TensorParallelResult:
    """Rewrite stage `gm` in place for the TP group; returns what was split.

    `slicer`: shared by the stage modules of one rank (see ParameterSlicer);
    `local_modules`: leaf calls that run on local tensors (expert-parallel layers);
    `split_tokens`: those calls take each TP rank's share of the token rows (EP
    across TP; see `_local_hooks`).
    """
    if not isinstance(gm, fx.GraphModule):
        raise PipeplanError("tensor parallel rewrites a captured stage graph (fx.GraphModule); "
                            f"got {type(gm).__name__}")
    decompose_outside_fake()  # (a joint trace of the rewritten stage: graphs mode)
    views_follow_the_local_layout()  # (meta strides a kernel does not keep)
    sp = rules.sequence_parallel
    sliced = slicer if slicer is not None else ParameterSlicer(group)
    mesh = _mesh(group, gm)
    b = _Builder(gm, mesh)
    g = gm.graph
    rewrites: dict[str, str] = {}

    # 0. in-place ops on values the graph makes, none of their aliases read after, run out
    #    of place: DTensor refuses an in-place op whose operand's placement it must change
    out_of_place(g)

    # 1. split Linear/Embedding leaf calls become functional ops on get_attr nodes
    for node in list(g.nodes):
        if node.op == "call_module" and rules.kind_of(node.target):
            _functional_form(gm, node)

    # 2. shard the parameters the patterns name (one shard per tied parameter and dim); a
    #    fused Linear's (its output cut into parts) holds its 1/tp of every part (fused.py)
    dims: dict[str, int] = {}
    uses = linear_uses(g, gm)
    fused = fused_parameters(uses)
    in_out = {use.module for use in uses.values() if use.in_out}  # weights stored [in, out]
    for name, p in list(gm.named_parameters(remove_duplicate=False)):
        owner, _, leaf = name.rpartition(".")
        kind = rules.kind_of(owner)
        dim = shard_dim(kind, leaf, owner in in_out) if kind else None
        if dim is None:
            continue
        set_parameter(gm, name, sliced(p, dim, fused.get(name)))
        dims[name] = dim
        rewrites[owner] = kind

    # 3. the collectives each style implies, around the uses of split parameters
    out_spec = SEQ if sp else "replicate"
    entered: dict[fx.Node, fx.Node] = {}
    moved: dict[fx.Node, fx.Node] = {}  # a node whose users now read its redistribution
    for node in list(g.nodes):
        if node.op in ("call_method", "call_function") and node.target in BADDBMM:
            name = b.module("batch_local", lambda: BatchLocal(torch.baddbmm))
            node.meta[TRACED_IN] = module_path(node)
            node.op, node.target = "call_module", name
            continue
        if node.op != "call_function":
            continue
        use = uses.get(node)
        if use is not None and _attr(use.weight) in dims:
            w = _attr(use.weight)
            kind = rules.kind_of(use.module)
            if kind == "row":
                _row(b, node, use, out_spec)
                continue
            x = moved.get(use.x, use.x)  # (an embedding's output read by a Linear directly)
            if x not in entered:
                entered[x] = b.before(node, x, "replicate_in", b.redistribute("replicate"))
                entered[x].meta[COLLECTIVE] = sp  # all-gathers the sequence (else a no-op)
            node.replace_input_with(x, entered[x])
            loss = loss_of_logits(node)
            if w in fused:
                recut(gm, node, dist.get_world_size(group))
            elif loss is not None:
                _vocab_loss(b, loss)
                rewrites[w.rpartition(".")[0]] = kind + "+loss"
            elif kind == "vocab":
                b.after(node, "gather", b.redistribute("replicate")).meta[COLLECTIVE] = True
        elif node.target in EMBEDDINGS and _attr(embedding_weight(node)) in dims:
            moved[node] = b.after(node, "out_" + out_spec, b.redistribute(out_spec))
            moved[node].meta[COLLECTIVE] = True
        elif node.target in SDPA:
            name = b.module(f"heads_{SDPA.index(node.target)}", lambda: HeadLocal(node.target))
            node.meta[TRACED_IN], node.meta[ATTENTION] = module_path(node), True
            node.op, node.target = "call_module", name

    # 3b. the model's own mean losses count their targets across row shards (CountedMean)
    for node in list(g.nodes):
        found = counted_mean(node)
        if found is not None:
            _counted_mean(b, node, *found)

    # 3c. an op DTensor has no sharding strategy for runs on the whole values (WholeValues)
    for node in list(g.nodes):
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) \
                and not has_sharding_strategy(node.target):
            op = node.target
            node.meta[TRACED_IN] = module_path(node)
            node.op, node.target = "call_module", b.module(
                "whole_" + str(op).replace(".", "_"), lambda: WholeValues(op))

    # 4. every tensor the graph reads becomes a DTensor
    partial = []
    params = dict(gm.named_parameters(remove_duplicate=False))
    for node in list(g.nodes):
        if node.op == "placeholder" and not node.meta.get(BATCH):  # (batch: graph_made_uses)
            b.after(node, "replicate", b.to_dtensor("replicate"))
        elif node.op == "get_attr":
            if node.target in dims:
                spec = f"shard:{dims[node.target]}"
                b.after(node, spec, b.to_dtensor(spec))
            elif sp and node.target in params and params[node.target].requires_grad:
                b.after(node, "partial_grad", lambda: ReplicatedParameter(mesh))
                partial.append(node.target)
            elif not node.meta.get(CONSTANT):  # (a constant: graph_made_uses)
                b.after(node, "replicate", b.to_dtensor("replicate"))
    for node, users in graph_made_uses(gm):  # (its uses on plain values stay plain)
        b.after(node, "replicate", b.to_dtensor("replicate"), only=set(users))

    # 5. leaf calls see their own parameters as DTensors
    for node in list(g.nodes):
        if node.op == "call_module" and node.target in local_modules:
            _local_hooks(gm.get_submodule(node.target), split_tokens)
            if sp and not split_tokens:  # (split: each rank's experts see their own tokens)
                partial += [node.target + "." + n for n, p in
                            gm.get_submodule(node.target).named_parameters(remove_duplicate=False)
                            if p.requires_grad]
        elif node.op == "call_module" and not node.target.startswith("tp_"):
            mod = gm.get_submodule(node.target)
            prefix = node.target + "."
            rep = ReplicatedParameter(mesh) if sp else ToDTensor(mesh)
            if any(True for _ in mod.parameters()) or any(True for _ in mod.buffers()):
                # by name, not by type: under a joint trace (compile.mode = graphs) the
                # module's parameters are the trace's plain tensors, and a plain Replicate
                # conversion would hand back their gradients all-reduced every microbatch
                # (then summed again once per step)
                params_of = {n for n, _ in mod.named_parameters(remove_duplicate=False)}
                _leaf_hooks(mod, lambda n, t, rep=rep, params_of=params_of: rep(t)
                            if n in params_of else ToDTensor(mesh)(t))
                if sp:
                    partial += [prefix + n for n, p in mod.named_parameters(remove_duplicate=False)
                                if p.requires_grad]

    # 6. stage outputs leave as full local tensors
    out = next(n for n in g.nodes if n.op == "output")
    local = b.module("to_local", ToLocal)
    with g.inserting_before(out):
        out.args = (fx.node.map_arg(out.args[0], lambda n: g.call_module(local, (n,))),)

    setattr(gm, SHARD_DIMS, dims)
    setattr(gm, SEGMENTS, {n: fused[n] for n in dims if n in fused})
    g.lint()
    gm.recompile()
    return TensorParallelResult(rewrites, tuple(dict.fromkeys(partial)))


def out_of_place(g: fx.Graph) -> list[fx.Node]:
    """Each ATen in-place op (`x.scatter_(...)`, `out.add_(...)`) whose operand the graph made
    itself, and none of whose aliases (the operand's views and what it is a view of) is read
    after it, becomes its out-of-place form, and the operand's later readers read the result:
    the same values, since nothing else could see the write. DTensor refuses an in-place op
    whose operand's placement it would have to change (Llama 4's router scatters its top-k
    into a `full_like` of its sequence-sharded logits); out of place it redistributes the
    operand as for any op. Operands that may alias an input, a parameter or a buffer, and
    ops with no out-of-place form, are left as they are. Returns the ops changed."""
    order = {n: i for i, n in enumerate(g.nodes)}
    changed = []
    for node in list(g.nodes):
        functional = _functional_overload(node)
        if functional is None:
            continue
        x = node.args[0]
        aliases = _aliases(x)
        if aliases is None or any(order[u] > order[node] for a in aliases - {x}
                                  if order[a] < order[node] for u in a.users):
            continue  # (an alias made before the write and read after it)
        later = [u for u in x.users if order[u] > order[node]]
        node.target = functional
        for u in later:
            u.replace_input_with(x, node)
        changed.append(node)
    return changed


def _functional_overload(node: fx.Node):
    """The out-of-place OpOverload of an in-place ATen call on a node (`aten.scatter_.src` ->
    `aten.scatter.src`: same overload, same arguments, the first not written), or None."""
    t = node.target
    if node.op != "call_function" or not isinstance(t, torch._ops.OpOverload) \
            or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    first = t._schema.arguments[0] if t._schema.arguments else None
    if first is None or first.alias_info is None or not first.alias_info.is_write \
            or not t._schema.name.endswith("_") or t._schema.name.endswith("__") \
            or torch.Tag.nondeterministic_seeded in t.tags:  # (a random fill: as written)
        return None
    packet = getattr(torch.ops.aten, t._schema.name.split("::")[-1][:-1], None)
    other = getattr(packet, t._overloadname, None) if packet is not None else None
    if other is None or [a.name for a in other._schema.arguments] != \
            [a.name for a in t._schema.arguments] or other._schema.arguments[0].alias_info:
        return None
    return other


def _aliases(x: fx.Node) -> Optional[set]:
    """The nodes that may share x's storage (x, what it views, their views, in-place results
    on them), or None when that reaches a value the graph did not make (placeholder,
    get_attr) or a reader whose aliasing no schema states (a module or method call)."""
    root = x
    while True:
        up = _viewed(root)
        if up is False:
            return None
        if up is None:
            break
        root = up
    if root.op != "call_function":
        return None
    found, todo = {root}, [root]
    while todo:
        for u in todo.pop().users:
            up = _viewed(u)
            if up is False:  # (a module or method call might keep a view of it)
                return None
            if u not in found and up in found:
                found.add(u)
                todo.append(u)
    return found


def _viewed(node: fx.Node):
    """The node `node`'s value aliases (a view or an in-place op's first operand; getitem of
    a view-returning op), None for a fresh value, False when unknown."""
    if node.op in ("placeholder", "get_attr", "output"):
        return None
    if node.op == "call_function" and node.target is operator.getitem:
        src = node.args[0]
        if not isinstance(src, fx.Node):
            return False
        rets = getattr(src.target, "_schema", None)
        if rets is None:
            return False
        return src.args[0] if any(r.alias_info is not None for r in rets.returns) else None
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    rets = node.target._schema.returns
    if len(rets) == 1 and rets[0].alias_info is not None:
        return node.args[0] if node.args and isinstance(node.args[0], fx.Node) else False
    return None


def _attr(node) -> Optional[str]:
    return node.target if isinstance(node, fx.Node) and node.op == "get_attr" else None


def add_bias(summed, bias):
    """A row layer's bias added to its summed product, in the product's dtype: the Linear's
    own (under autocast the model's `linear(x, W, b)` is bf16 with its bias; a float32
    bias added after the sum would promote the layer's output, and all it feeds, to
    float32)."""
    return summed + bias.to(summed.dtype)


def _row(b: _Builder, node: fx.Node, use: LinearUse, out_spec: str) -> None:
    """linear(x, W, bias) -> redistribute(linear(x, W)) + bias (addmm(bias, x, W) ->
    redistribute(mm(x, W)) + bias): sum the partial products (all-reduce, or
    reduce-scatter to sequence shards), then add the replicated bias."""
    g = b.gm.graph
    bias = use.bias
    if node.target in LINEARS:
        node.args, node.kwargs = (node.args[0], node.args[1]), {}
    elif bias is not None:  # addmm
        node.target, node.args = torch.ops.aten.mm.default, node.args[1:]
    end = b.after(node, "out_" + out_spec, b.redistribute(out_spec))
    end.meta[COLLECTIVE] = True
    if bias is not None:
        with g.inserting_after(end):
            add = b.served(g.call_function(add_bias, (end, bias)), node)
        end.replace_all_uses_with(add, delete_user_cb=lambda u: u is not add)


def _counted_mean(b: _Builder, node: fx.Node, x, t, kwargs: dict) -> None:
    """loss(x, t, ...) -> CountedMean(loss)(x, t, **its other arguments by keyword)."""
    op, total = node.target, MEAN_LOSSES[node.target][1]
    key = f"counted_mean_{getattr(op, '__name__', op)}".replace(".", "_")
    node.meta[TRACED_IN] = module_path(node)
    node.op, node.target = "call_module", b.module(key, lambda: CountedMean(op, total))
    node.args, node.kwargs = (x, t), kwargs


def _vocab_loss(b: _Builder, ce: fx.Node) -> None:
    g = b.gm.graph
    logits, targets, kwargs = cross_entropy_call(ce)  # (F's keywords, for either form)
    name = b.module(f"vocab_loss_{b.count}", lambda: VocabParallelLoss(**kwargs))
    b.count += 1
    with g.inserting_before(ce):
        new = g.call_module(name, (logits, targets))
    ce.replace_all_uses_with(new)
    g.erase_node(ce)
