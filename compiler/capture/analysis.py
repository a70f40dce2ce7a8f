"""Shape and cost propagation: run the captured graph once on meta tensors.

For every node this records the value it produces (a meta tensor, or a Python
value such as a size), its forward FLOPs (torch's FlopCounterMode, which knows
matmul, attention, convolution and einsum through their aten decompositions),
how many aten ops its forward dispatches (each costs host time; an attention
call counts as its one fused kernel), and the bytes autograd saves for backward (saved-tensor hooks; parameters are
not counted, and a tensor saved by several ops counts once). Nothing is
allocated: parameters of a real model are replaced by meta stand-ins.

Attention is costed as a fused kernel would run it (FlashAttention saves q, k,
v, the output and one float per row), not as the meta math path runs it.
Ops whose output shape depends on data (`nonzero` in a leaf MoE's dispatch)
run as if everything were selected: shapes stay computable, costs are upper
bounds (costs.py scales a leaf MoE back to top-k).

Running ops on meta tensors imports torch._dynamo (torch's Python meta
kernels are wrapped to disable it: ~2 s per process). A run's results can be
recorded (`Propagation.record`) and replayed in another process compiling the
same model (`Propagation.replay`): the runtime's ranks replay rank 0's
(backends/runtime/agreement.py), so only rank 0 pays for the meta run.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterable, Optional

import torch
import torch.fx as fx
from torch.func import functional_call
from torch.utils._pytree import tree_map_only
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from ..compiled import ValueSpec
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
class NodeCost:
    flops: float  # forward FLOPs
    saved_bytes: int  # activation bytes kept for backward
    ops: int = 0  # aten ops the forward dispatches (each costs host time: cpu_probe.py)
    work: Work = Work()  # its matmuls by shape and the bytes its other ops move (work.py)


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

    def __init__(self, gm: fx.GraphModule):
        self.gm = gm
        self.values: dict[fx.Node, Any] = {}
        self.costs: dict[fx.Node, NodeCost] = {}
        self._meta: dict[int, torch.Tensor] = {}  # id(real tensor) -> meta stand-in
        self._param_ids: set[int] = set()
        self._saved: dict[int, torch.Tensor] = {}  # id(base) -> base, counted once
        self._saved_now = 0
        self._ops = OpCounter(lambda t: id(t._base if t._base is not None else t)
                              in self._param_ids)

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
        counter = FlopCounterMode(display=False)
        # data-dependent shapes (nonzero in a leaf MoE's dispatch) are taken at their largest:
        # every element selected, so costs are upper bounds and shapes stay computable
        with counter, self._ops, torch.enable_grad(), _nonzero_selects_all(), \
                torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            for node in nodes:
                if node.op == "output":
                    continue
                before, self._saved_now = counter.get_total_flops(), 0
                ops_before = self._ops.count
                if node.op == "placeholder":
                    value = inputs[node.target if node.target in inputs else node.name]
                else:
                    try:
                        value = self._execute(node)
                    except Exception as e:
                        raise MetaRunError(node, e) from e
                saved = self._saved_now
                if node.op == "call_function" and node.target in SDPA:
                    saved = _fused_attention_saved_bytes(value, node.args, self.values)
                flops = float(counter.get_total_flops() - before)
                if flops == 0 and _is_grouped_mm(node):
                    flops = _grouped_mm_flops(value, node.args, self.values)
                ops, work = self._ops.count - ops_before, self._ops.log.take()
                if node.op == "call_function" and node.target in SDPA:
                    ops = 1  # one fused kernel on a device (its meta run is the math path)
                    work = attention_work(value, self.values[node.args[0]],
                                          self.values[node.args[1]], flops)
                self.values[node] = value
                self.costs[node] = NodeCost(flops, saved, ops, work)

    def _execute(self, node: fx.Node) -> Any:
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), self.values.__getitem__)
        # graphs exported from a real model name its device; run them on meta instead
        args, kwargs = torch.utils._pytree.tree_map_only(torch.device, lambda d: _META,
                                                         (args, kwargs))
        if node.op == "get_attr":
            return self._to_meta(_fetch_attr(self.gm, node.target))
        if node.op == "call_function":
            return node.target(*args, **kwargs)
        if node.op == "call_method":
            return getattr(args[0], node.target)(*args[1:], **kwargs)
        if node.op == "call_module":
            module = self.gm.get_submodule(node.target)
            state = {k: self._to_meta(t) for k, t in
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

    def _to_meta(self, t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        cached = self._meta.get(id(t))
        if cached is None:
            if t.is_meta:
                cached = t
            else:
                with self._ops.paused():  # a stand-in, not an op the model runs
                    cached = torch.empty_like(t, device="meta")
                    if isinstance(t, torch.nn.Parameter):
                        cached = torch.nn.Parameter(cached, requires_grad=t.requires_grad)
            self._meta[id(t)] = cached
            self._meta[id(cached)] = cached
            if isinstance(t, torch.nn.Parameter):
                self._param_ids.add(id(cached))
        return cached

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t
        if id(base) not in self._param_ids and id(base) not in self._saved:
            self._saved[id(base)] = base  # keep alive so ids stay unique
            self._saved_now += _nbytes(base)
        return t


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched under it (after autograd's decompositions: the kernels
    a device runs one by one); `paused()` leaves out ops that are not the model's."""

    def __init__(self, is_param=lambda t: False):
        super().__init__()
        self.count, self._paused = 0, False
        self.log, self._is_param = WorkLog(), is_param  # each op's work (work.py)

    @contextlib.contextmanager
    def paused(self):
        before, self._paused = self._paused, True
        try:
            yield
        finally:
            self._paused = before

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self._paused:
            self.count += 1
            self.log.record(func, args, kwargs, out, self._is_param)
        return out


def _nonzero_selects_all():
    from torch.fx.experimental import _config
    return _config.patch(meta_nonzero_assume_all_nonzero=True)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


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


def _fetch_attr(gm: torch.nn.Module, target: str) -> Any:
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj
