"""Shape and cost propagation: run the captured graph once on meta tensors.

For every node this records the value it produces (a meta tensor, or a Python
value such as a size), its forward FLOPs (torch's FlopCounterMode, which knows
matmul, attention, convolution and einsum through their aten decompositions),
how many aten ops its forward dispatches (each costs host time; an attention
call counts as its one fused kernel), and what autograd saves for backward
(saved-tensor hooks): one `Saved` record per storage, keyed by the node that
produced it and naming the value or parameter it holds (a cast copy: what it
was cast from); parameters are not counted. compiler/estimate/activations.py
walks the records. Nothing is allocated: parameters of a real model are
replaced by meta stand-ins. `MetaRun(gm, autocast=torch.bfloat16)` runs on fake
CPU tensors under autocast instead (meta tensors have no autocast): the
records a bf16 run saves.

Attention is costed as a fused kernel would run it (torch's CPU flash kernel:
q, k, v, a mask, the output laid out as the kernel lays it, one float32 per
row), not as the meta math path runs it -- but for a mask that takes a gradient,
where the kernel itself runs the math path.
Ops whose output shape depends on data (`nonzero` in a leaf MoE's dispatch)
run as if everything were selected: shapes stay computable, costs are upper
bounds (costs.py scales a leaf MoE back to top-k).

A block whose nodes and inputs repeat one already run (a layer stack's layers) is not
run again: replay.py gives it that run's results, renamed (the same records a run gives).

Running ops on meta tensors imports torch._dynamo (torch's Python meta
kernels are wrapped to disable it: ~2 s per process). A run's results can be
recorded (`Propagation.record`) and replayed in another process compiling the
same model (`Propagation.replay`): the runtime's ranks replay rank 0's
(backends/runtime/agreement.py), so only rank 0 pays for the meta run.
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
import weakref
from typing import Any, Iterable, Optional

import torch
import torch.fx as fx
from torch.func import functional_call
from torch.utils._pytree import tree_map_only
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from ..compiled import ValueSpec
from .replay import Replays
from .work import Work, WorkLog, attention_work

_META = torch.device("meta")
SDPA = {torch.nn.functional.scaled_dot_product_attention,
         torch.ops.aten.scaled_dot_product_attention.default}


class MetaRunError(Exception):
    """A node could not run on meta tensors (e.g. an op whose output shape depends on data)."""

    def __init__(self, node: fx.Node, error: BaseException):
        self.node, self.error = node, error
        super().__init__(f"{node.format_node()}: {type(error).__name__}: {error}")


@dataclass(frozen=True)
class Saved:
    """One storage a node's forward saves for backward: `key` names the storage (the node
    that first produced it, `<node>#<k>`), `owner` what it holds (a cast copy: the
    value or parameter it was cast from); `dims`: the saved tensor's rank (a 0-d scalar
    is never split)."""

    key: str
    nbytes: int
    owner: str  # the node that produced it; "param:<name>" for a parameter's cast
    dims: int = 1
    source: str = ""  # the key of the storage it is a cast copy of (autocast), if one


@dataclass(frozen=True)
class NodeCost:
    flops: float  # forward FLOPs
    saved_bytes: int  # activation bytes kept for backward
    ops: int = 0  # aten ops the forward dispatches (each costs host time: cpu_probe.py)
    work: Work = Work()  # its matmuls by shape and the bytes its other ops move (work.py)
    saves: tuple = ()  # Saved, each storage once per node (activations.py walks them)
    outs: tuple = ()  # (key, bytes) of the storages of the node's tensor output(s)
    tensor_out: bool = False  # the output is one tensor (not a tuple)


@dataclass(frozen=True)
class MetaSpec:
    """A meta tensor as plain data (picklable): what a replay rebuilds."""

    shape: tuple
    stride: tuple
    dtype: torch.dtype
    requires_grad: bool

    @staticmethod
    def of(t: torch.Tensor) -> "MetaSpec":
        return MetaSpec(tuple(t.shape), tuple(t.stride()), t.dtype, bool(t.requires_grad))

    def build(self) -> torch.Tensor:
        t = torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=_META)
        return t.requires_grad_(self.requires_grad) if self.dtype.is_floating_point else t


class Propagation:
    """The values and costs of a whole model's meta run by node name, shareable between
    processes compiling the same plan (the graph's node names are deterministic)."""

    _active: Optional["Propagation"] = None  # the one recording or replaying now

    def __init__(self, table: Optional[dict] = None):
        self.table = {} if table is None else table  # node name -> (value with MetaSpecs, cost)
        self.replaying = table is not None

    @classmethod
    @contextlib.contextmanager
    def record(cls):
        """Within: every shared MetaRun's results are recorded into the yielded Propagation."""
        with cls._activated(Propagation()) as p:
            yield p

    @classmethod
    @contextlib.contextmanager
    def replay(cls, table: dict):
        """Within: shared MetaRuns take their results from `table` instead of running."""
        with cls._activated(Propagation(table)) as p:
            yield p

    @classmethod
    @contextlib.contextmanager
    def _activated(cls, p: "Propagation"):
        before, cls._active = cls._active, p
        try:
            yield p
        finally:
            cls._active = before


class MetaRun:
    """Executes graph nodes on meta tensors, incrementally; results stay queryable by node."""

    def __init__(self, gm: fx.GraphModule, autocast: Optional[torch.dtype] = None,
                 blocks: Iterable[str] = ()):
        """`autocast`: run as under `torch.autocast("cpu", autocast)`, on fake CPU tensors
        (meta tensors have no autocast): what is saved then is what a bf16 run saves.
        `blocks`: the model's blocks (capture/blocks.py); a block whose segment of the graph
        repeats one already run is replayed from it (replay.py)."""
        self.gm = gm
        self.blocks = tuple(blocks)
        self._replays = Replays(self.blocks) if self.blocks else None
        # replayed storages with keys (replay.py) and tensors with stand-ins (_meta), kept
        # alive so their ids stay theirs
        self._held: list = []
        self.autocast = autocast
        self._device = _META if autocast is None else torch.device("cpu")
        self.values: dict[fx.Node, Any] = {}
        self.costs: dict[fx.Node, NodeCost] = {}
        self._meta: dict[int, torch.Tensor] = {}  # id(real tensor) -> meta stand-in (_held)
        self._param_ids: set[int] = set()
        self._saved: dict[int, torch.Tensor] = {}  # id(base) -> base, counted once
        self._saved_now = 0
        self._keys: dict[int, str] = {}  # id(base) -> storage key (Saved.key)
        self._owners: dict[str, tuple[str, str]] = {}  # key -> (owner, source) (Saved)
        self._param_names: dict[int, str] = {}  # id(meta parameter) -> qualified name
        self._alive: list = []  # bases with keys, kept alive so ids stay unique
        self._node: Optional[fx.Node] = None  # the node running now
        self._saves: dict[str, Saved] = {}  # ... and what it saved
        self._ops = OpCounter(lambda t: id(t._base if t._base is not None else t)
                              in self._param_ids)
        # the model's state its forward writes in place: buffers (a BatchNorm's running
        # statistics), parameters (an Embedding's max_norm renormalising its rows)
        self._ops.on_state = self._touched
        self.sparse_grads: set[str] = set()  # parameters a sparse gradient reaches
        self._buffers = {n for n, _ in gm.named_buffers(remove_duplicate=False)}
        # storage of a parameter's or buffer's stand-in (held: _held) -> its name; by storage,
        # since an op may write through an alias (F.embedding's max_norm renormalises a
        # `weight.contiguous()`)
        self._state_storages: dict[int, str] = {}
        self.state_writes: set[str] = set()

    # ------------------------------------------------------------------ queries
    def value(self, node: fx.Node) -> Any:
        return self.values[node]

    def is_tensor(self, node: fx.Node) -> bool:
        return isinstance(self.values.get(node), torch.Tensor)

    def spec(self, node: fx.Node, name: str | None = None) -> ValueSpec:
        v = self.values[node]
        return ValueSpec(name or node.name, tuple(v.shape), str(v.dtype).removeprefix("torch."),
                         requires_grad=bool(v.requires_grad))

    # ---------------------------------------------------------------- execution
    def run(self, nodes: Iterable[fx.Node], inputs: dict[str, torch.Tensor],
            shared: bool = False) -> None:
        """Run `nodes` (in order) given meta tensors for placeholders by name. `shared`: the
        model's own graph, recorded or replayed under an active `Propagation`."""
        nodes = [n for n in nodes if n.op != "output"]
        p = Propagation._active if shared else None
        if p is not None and p.replaying and all(n.name in p.table for n in nodes):
            for node in nodes:
                value, cost = p.table[node.name]
                self.values[node] = tree_map_only(MetaSpec, MetaSpec.build, value)
                self.costs[node] = cost
            return
        self._execute_all(nodes, inputs)
        if p is not None and not p.replaying:
            p.table.update((n.name, (tree_map_only(torch.Tensor, MetaSpec.of, self.values[n]),
                                     self.costs[n])) for n in nodes)

    def _execute_all(self, nodes: list[fx.Node], inputs: dict[str, torch.Tensor]) -> None:
        # a run for saved records alone (under autocast) takes FLOPs from the meta run
        counter = FlopCounterMode(display=False) if self.autocast is None else _NoFlops()
        # data-dependent shapes (nonzero in a leaf MoE's dispatch) are taken at their largest:
        # every element selected, so costs are upper bounds and shapes stay computable
        # the pack hook reaches this run through a weak reference: the autograd graph's saved
        # variables hold the hook, and this run holds their tensors -- a cycle through C++
        # that Python's collector cannot free (every compile's run and graph were kept)
        me = weakref.ref(self)

        def pack(t: torch.Tensor) -> torch.Tensor:
            run = me()
            return run._pack(t) if run is not None else t

        with self._mode(), counter, self._ops, torch.enable_grad(), _nonzero_selects_all(), \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            replays = self._replays
            for block, seg in replays.segments(nodes) if replays else [(None, nodes)]:
                if block is None:
                    for node in seg:
                        self._execute_one(node, counter, inputs)
                    continue
                start = replays.enter(self, block, seg)
                if start is None:  # replayed
                    continue
                for node in seg:
                    self._execute_one(node, counter, inputs)
                replays.finish(self, block, seg, start)

    def _execute_one(self, node: fx.Node, counter, inputs: dict[str, torch.Tensor]) -> None:
        if node.op == "output":
            return
        before, self._saved_now = counter.get_total_flops(), 0
        ops_before = self._ops.count
        self._node, self._saves = node, {}
        fused = node.op == "call_function" and node.target in SDPA and \
            not _mask_requires_grad(node, self.values)
        if node.op == "placeholder":
            value = inputs[node.target if node.target in inputs else node.name]
            if self.autocast is not None:
                value = self._to_meta(value, parameter=False)
        else:
            try:
                value = self._execute(node)
            except Exception as e:
                raise MetaRunError(node, e) from e
            if fused:
                value = _fused_layout(value, self.values.get(node.args[0]))
        saved = self._saved_now
        outs = self._register(node, value)
        saves = tuple(self._saves.values())
        if fused:
            saved = _fused_attention_saved_bytes(value, node.args, self.values)
            saves = self._fused_attention_saves(node, value, outs)
        flops = float(counter.get_total_flops() - before)
        if flops == 0 and _is_grouped_mm(node):
            flops = _grouped_mm_flops(value, node.args, self.values)
        ops, work = self._ops.count - ops_before, self._ops.log.take()
        if fused:
            ops = 1  # one fused kernel on a device (its meta run is the math path)
            work = attention_work(value, self.values[node.args[0]],
                                  self.values[node.args[1]], flops)
        self.values[node] = value
        self.costs[node] = NodeCost(flops, saved, ops, work, saves, outs,
                                    isinstance(value, torch.Tensor))

    def _execute(self, node: fx.Node) -> Any:
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), self.values.__getitem__)
        # graphs exported from a real model name its device; run them on meta instead
        args, kwargs = torch.utils._pytree.tree_map_only(torch.device, lambda d: self._device,
                                                         (args, kwargs))
        if node.op == "get_attr":
            return self._to_meta(fetch_attr(self.gm, node.target), name=node.target)
        if node.op == "call_function":
            return node.target(*args, **kwargs)
        if node.op == "call_method":
            return getattr(args[0], node.target)(*args[1:], **kwargs)
        if node.op == "call_module":
            module = self.gm.get_submodule(node.target)
            state = {k: self._to_meta(t, name=f"{node.target}.{k}") for k, t in
                     (*module.named_parameters(remove_duplicate=False),
                      *module.named_buffers(remove_duplicate=False))}
            try:
                return functional_call(module, state, tuple(args), kwargs, tie_weights=False)
            except RuntimeError:  # a kernel that cannot run on meta: the captured value
                from .experts_call import captured_value
                value = captured_value(node)
                if value is None:
                    raise
                return value
        raise AssertionError(f"unexpected node op {node.op}")

    def _mode(self):
        """Fake CPU tensors under autocast, or nothing (meta tensors)."""
        if self.autocast is None:
            return contextlib.nullcontext()
        from torch._subclasses.fake_tensor import FakeTensorMode
        stack = contextlib.ExitStack()
        stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
        stack.enter_context(torch.autocast("cpu", dtype=self.autocast))
        return stack

    def _to_meta(self, t: Any, parameter: bool = True, name: str = "") -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        cached = self._meta.get(id(t))
        if cached is None:
            if t.is_meta and self.autocast is None:
                cached = t
            else:
                with self._ops.paused():  # a stand-in, not an op the model runs
                    cached = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype,
                                                 device=self._device)
                    if not parameter and t.requires_grad:
                        cached.requires_grad_(True)
                    if isinstance(t, torch.nn.Parameter):
                        cached = torch.nn.Parameter(cached, requires_grad=t.requires_grad)
            self._meta[id(t)] = cached
            self._meta[id(cached)] = cached
            self._held.append(t)  # its id stays its own while the stand-in is cached
            if isinstance(t, torch.nn.Parameter):
                self._param_ids.add(id(cached))
        if name and id(cached) in self._param_ids:
            self._param_names.setdefault(id(cached), name)
        if name and (id(cached) in self._param_ids or name in self._buffers):
            self._state_storages.setdefault(cached.untyped_storage()._cdata, name)
        return cached

    def _touched(self, func, args: tuple, kwargs: dict) -> None:
        """An op OpCounter.on_state watches: a write into the model's state (`_wrote`), or
        an embedding asked for a sparse gradient of its weight (argument 4)."""
        if func is torch.ops.aten.embedding.default:
            weight = args[0]
            name = self._state_storages.get(weight.untyped_storage()._cdata)
            if name is not None and len(args) > 4 and args[4]:
                self.sparse_grads.add(name)
            return
        self._wrote(func, args, kwargs)

    def _wrote(self, func, args: tuple, kwargs: dict) -> None:
        """Record the buffers and parameters among the arguments `func`'s schema marks
        written (or that it writes without saying so: UNDECLARED_WRITES)."""
        undeclared = UNDECLARED_WRITES[func](args) if func in UNDECLARED_WRITES else ()
        for i, spec in enumerate(func._schema.arguments):
            declared = spec.alias_info is not None and spec.alias_info.is_write
            if not declared and i not in undeclared:
                continue
            t = args[i] if i < len(args) else kwargs.get(spec.name)
            if isinstance(t, torch.Tensor):
                name = self._state_storages.get(t.untyped_storage()._cdata)
                if name is not None:
                    self.state_writes.add(name)

    def renamed(self, old: str, new: str) -> None:
        """A node run as `old` is named `new` now (the model's own loss, renamed "loss"
        after the run): the storages it made are owned by `new` in the records (what
        activations.py looks the owner up by)."""
        self._owners = {k: (new if o == old else o, src) for k, (o, src) in self._owners.items()}
        for node, c in self.costs.items():
            if any(s.owner == old for s in c.saves):
                self.costs[node] = dataclasses.replace(c, saves=tuple(
                    dataclasses.replace(s, owner=new) if s.owner == old else s
                    for s in c.saves))

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t
        if id(base) not in self._param_ids and id(base) not in self._saved:
            self._saved[id(base)] = base  # keep alive so ids stay unique
            self._saved_now += _nbytes(base)
        if id(base) not in self._param_ids and self._node is not None:
            key = self._key(base, self._node)
            self._saves.setdefault(key, Saved(key, _nbytes(base), *self._owners[key][:1],
                                              t.dim(), self._owners[key][1]))
        return t

    def _key(self, base: torch.Tensor, node: fx.Node) -> str:
        """The storage's key, given on first sight to the node producing it."""
        key = self._keys.get(id(base))
        if key is None:
            key = self._keys[id(base)] = f"{node.name}#{len(self._alive)}"
            self._alive.append(base)
            owner, source = node.name, ""
            src = self._ops.copies.get(id(base), (None, None))[1]
            if src is not None:  # a cast copy (autocast): it holds what it was cast from
                src = src._base if src._base is not None else src
                if id(src) in self._param_ids:
                    owner = "param:" + self._param_names.get(id(src), "")
                elif id(src) in self._keys:
                    source = self._keys[id(src)]
                    owner = self._owners[source][0]
            self._owners[key] = (owner, source)
        return key

    def _register(self, node: fx.Node, value: Any) -> tuple:
        """(key, bytes) of the storages `value` (a node's output) lives in."""
        outs = {}
        for t in torch.utils._pytree.tree_leaves(value):
            if isinstance(t, torch.Tensor):
                base = t._base if t._base is not None else t
                if id(base) not in self._param_ids:
                    outs.setdefault(self._key(base, node), _nbytes(base))
        return tuple(outs.items())

    def _fused_attention_saves(self, node: fx.Node, out: torch.Tensor, outs: tuple) -> tuple:
        """What a fused kernel saves: q, k, v and a mask (a copy in the output's dtype where
        they are of another: autocast's cast, a boolean mask made float), the output and
        one float32 per row (torch's CPU flash kernel; CUDA's keep the same)."""
        saves = {}
        mask = _attention_mask(node)
        for i, a in enumerate((*node.args[:3], mask)):
            if not (isinstance(a, fx.Node) and isinstance(self.values.get(a), torch.Tensor)):
                continue
            t = self.values[a]
            base = t._base if t._base is not None else t
            key = self._key(base, a)
            owner, source = self._owners[key]
            if t.dtype == out.dtype:
                saves[key] = Saved(key, _nbytes(base), owner, t.dim(), source)
            else:  # a copy of its own, holding what it was made from; a mask with a
                # dim per head is cast on the heads the op runs (split by tp with them)
                copy = f"{node.name}#cast{i}"
                heads = i == 3 and t.dim() == 4 and t.shape[1] == out.shape[1] > 1
                saves[copy] = Saved(copy, t.numel() * out.element_size(),
                                    node.name if heads else owner, t.dim(), key)
        for key, nbytes in outs:
            saves[key] = Saved(key, nbytes, node.name, out.dim())
        rows = out.numel() // out.shape[-1]
        key = f"{node.name}#lse"
        saves[key] = Saved(key, 4 * rows, node.name, out.dim() - 1)
        return tuple(saves.values())


class _NoFlops(contextlib.nullcontext):
    def get_total_flops(self) -> int:
        return 0


# Ops whose schema does not mark an argument they write: op -> (args -> the indices written).
# native_batch_norm updates running_mean and running_var (arguments 3, 4) in training mode
# (argument 5), yet declares them read-only (functionalization special-cases it).
UNDECLARED_WRITES = {
    torch.ops.aten.native_batch_norm.default: lambda a: (3, 4) if len(a) > 5 and a[5] else (),
}


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched under it (after autograd's decompositions: the kernels
    a device runs one by one); `paused()` leaves out ops that are not the model's."""

    def __init__(self, is_param=lambda t: False):
        super().__init__()
        self.count, self._paused = 0, False
        self.log, self._is_param = WorkLog(), is_param  # each op's work (work.py)
        # id(a cast's output) -> (it, its input): both kept alive, so no later tensor takes
        # the id of a cast output that was freed (and its owner with it)
        self.copies: dict[int, tuple] = {}
        # called with (func, args, kwargs) for every op that writes, and every embedding
        self.on_state = None

    @contextlib.contextmanager
    def paused(self):
        before, self._paused = self._paused, True
        try:
            yield
        finally:
            self._paused = before

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _NORM_STATISTICS:
            out = _statistics_as_the_cpu_kernel_keeps(func, args, out)
        if not self._paused:
            self.count += 1
            self.log.record(func, args, kwargs, out, self._is_param)
            if self.on_state is not None and (func._schema.is_mutable
                                              or func in UNDECLARED_WRITES
                                              or func is torch.ops.aten.embedding.default):
                self.on_state(func, args, kwargs)
        if func is torch.ops.aten._to_copy.default and isinstance(out, torch.Tensor):
            self.copies[id(out)] = (out, args[0])
        return out


# A norm's statistics (mean, rstd) as torch's CPU kernels keep them: float32 when the input
# is 16-bit and the weight float32 (the "mixed type" an autocast run makes: a norm after a
# bf16 Linear), the input's dtype otherwise. Fake tensors give the input's dtype always.
# op -> the index of its weight argument
_NORM_STATISTICS = {torch.ops.aten.native_layer_norm.default: 2,
                    torch.ops.aten.native_group_norm.default: 1}


def _statistics_as_the_cpu_kernel_keeps(func, args: tuple, out):
    x, weight = args[0], args[_NORM_STATISTICS[func]]
    if not (isinstance(out, tuple) and len(out) == 3 and isinstance(weight, torch.Tensor)
            and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == torch.float32):
        return out
    return (out[0],) + tuple(t if t.dtype == torch.float32 else t.float() for t in out[1:])


def _nonzero_selects_all():
    from torch.fx.experimental import _config
    return _config.patch(meta_nonzero_assume_all_nonzero=True)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _fused_layout(out: Any, q: Any) -> Any:
    """A fused attention kernel's output laid out as torch's CPU flash kernel lays it: where
    q's heads are strided inside its positions (q viewed [batch, heads, seq, dim] from a
    [batch, seq, heads, dim] projection: Llama's, a fused QKV's slices), [batch, heads, seq,
    dim] viewed from a [batch, seq, heads, dim] buffer, so the usual transpose back to
    [batch, seq, features] is a view; else (q made contiguous [batch, heads, seq, dim]:
    partial rotary's concatenation, GPT-NeoX's, Phi's) contiguous, and that transpose is a
    copy, a storage of its own the next Linear saves. The meta math path returns it
    contiguous either way."""
    if not isinstance(out, torch.Tensor) or out.dim() != 4:
        return out
    if not (isinstance(q, torch.Tensor) and q.dim() == 4 and q.stride(1) < q.stride(2)):
        return out.contiguous()
    return out.transpose(1, 2).contiguous().transpose(1, 2)


def _attention_mask(node: fx.Node) -> Any:
    """The attn_mask argument of a scaled_dot_product_attention node (None if not given)."""
    return node.kwargs.get("attn_mask", node.args[3] if len(node.args) > 3 else None)


def _mask_requires_grad(node: fx.Node, values: dict) -> bool:
    """Does attention's mask take a gradient (T5's learned position bias)? torch's CPU
    flash kernel has none for it: the op runs its math path (matmuls, softmax), and the
    meta run's records of that path stand."""
    mask = _attention_mask(node)
    t = values.get(mask) if isinstance(mask, fx.Node) else None
    return isinstance(t, torch.Tensor) and t.requires_grad


def _fused_attention_saved_bytes(out: torch.Tensor, args: tuple, values: dict) -> int:
    qkv = [values[a] for a in args[:3] if isinstance(a, fx.Node)]
    rows = out.numel() // out.shape[-1]
    return sum(_nbytes(t) for t in qkv) + _nbytes(out) + 4 * rows


def _is_grouped_mm(node: fx.Node) -> bool:
    """A grouped matmul (torch._grouped_mm, or a library's custom op for it) that torch's
    flop counter has no formula for: experts dispatched by token groups."""
    return node.op == "call_function" and "grouped_mm" in str(node.target)


def _grouped_mm_flops(out: Any, args: tuple, values: dict) -> float:
    """2 · rows · K · N: each output row is one token's product with its expert's [K, N]."""
    first = values.get(args[0]) if args and isinstance(args[0], fx.Node) else None
    if not isinstance(out, torch.Tensor) or not isinstance(first, torch.Tensor):
        return 0.0
    return 2.0 * out.numel() * first.shape[-1]


def fetch_attr(gm: torch.nn.Module, target: str) -> Any:
    """What a get_attr node's dotted `target` names on `gm`."""
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj
