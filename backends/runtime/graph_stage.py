"""One pipeline stage run as compiled graphs (`compile.mode = graphs | inductor`).

The stage's joint forward+backward graph (compiler/graphs/joint.py), partitioned into
F, B, W and BW (compiler/graphs/split.py), is traced on the first microbatch
(again only if a later one has other shapes) and then only called: no autograd
tape is built. Per microbatch the runner keeps, between F and its backward,
exactly the values F returned for B and W (and the stage inputs they read),
and between B and W what B hands to W and the output gradients W reads.
Parameters and buffers are read live at each call, so the optimizer's in-place
updates are seen. Recompute rules are a partition choice: F does not save what
their regions rerun, B recomputes it (compiler/graphs/split.py). Weight gradients go into `.grad` as `StageRunner` puts them
(the first taken, later microbatches added in place), so gradient
accumulation, the DP/ZeRO sync, clipping, tied weights and the non-finite
flags work on them unchanged.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Optional, Sequence

import torch

from ...compiler.compiled import StageSpec
from ...compiler.graphs.split import Part, StageGraphs, split_joint
from ...compiler.graphs.joint import JointGraph, trace_joint
from .stage import StageRunner


@dataclass
class _Compiled:
    graphs: StageGraphs
    calls: dict = field(default_factory=dict)  # part name -> callable


@dataclass
class _Pending:
    """What one microbatch keeps from F (and then B) for its backward."""

    values: dict  # key -> tensor: saved values, stage inputs, then tangents and handed values
    compiled: _Compiled  # the graphs its F ran (its inputs' shapes)
    after_b: bool = False


class GraphStageRunner(StageRunner):
    """Executes F / B / W / BW of one stage as its partitioned joint graph."""

    def __init__(self, spec: StageSpec, module: torch.nn.Module, is_last: bool,
                 loss_scale: float = 1.0,
                 autocast: Callable[[], ContextManager] = contextlib.nullcontext,
                 compile_part: Optional[Callable[[Part], Callable]] = None,
                 joint: Optional[JointGraph] = None, recompute: Sequence = ()):
        super().__init__(spec, module, is_last, loss_scale, split_weights=False,
                         autocast=autocast)
        self.compile_part = compile_part or (lambda part: part.gm)
        self.recompute = tuple(recompute)  # the plan's rules: what F leaves for B to rerun
        self._by_shape: dict[tuple, _Compiled] = {}
        self._compiled: Optional[_Compiled] = None
        self.trace_seconds = 0.0  # tracing and partitioning (and inductor), all shapes
        self.handed_bytes: Optional[dict[int, int]] = None  # B -> W, with measure_saved()
        if joint is not None:  # traced by the compiler on meta tensors (same stage graph)
            self._add(_input_key(joint), joint)

    def _add(self, key: tuple, joint: JointGraph) -> None:
        start = time.perf_counter()
        graphs = split_joint(joint)
        device = self.device
        for part in (graphs.F, graphs.B, graphs.W, graphs.BW):
            on_device(part.gm, device)
        self._by_shape[key] = _Compiled(graphs, {p.name: self.compile_part(p)
                                                 for p in (graphs.F, graphs.B, graphs.W,
                                                           graphs.BW)})
        self.trace_seconds += time.perf_counter() - start

    # ----------------------------------------------------------------- graphs
    def graphs_for(self, inputs: Sequence[torch.Tensor]) -> StageGraphs:
        key = tuple((tuple(x.shape), x.dtype) for x in inputs)
        if key not in self._by_shape:
            start = time.perf_counter()
            needs = [i in self.grad_inputs and x.is_floating_point()
                     for i, x in enumerate(inputs)]
            with self.autocast():
                joint = trace_joint(self.module, inputs, needs, recompute=self.recompute)
            self.trace_seconds += time.perf_counter() - start
            self._add(key, joint)
        self._compiled = self._by_shape[key]  # the graphs of the microbatch in F now
        return self._compiled.graphs

    def _state(self) -> list[torch.Tensor]:
        """The live parameter and buffer primals, in the joint graph's order."""
        j = self._compiled.graphs.joint
        return [self.module.get_parameter(n) for n in j.param_names] + \
            [_param_or_buffer(self.module, n) for n in j.buffer_names]

    def _call(self, part: Part, values: dict) -> dict:
        state = self._state()
        args = [state[k[1]] if k[0] == "p" and k[1] < len(state) else values[k]
                for k in part.inputs]
        with torch.no_grad():
            out = self._compiled.calls[part.name](*[a.detach() for a in args])
        return dict(zip(part.outputs, out))

    # ---------------------------------------------------------------- forward
    def forward(self, mb: int, inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        g = self.graphs_for(inputs)
        first = g.first_input
        values = {("p", first + i): x for i, x in enumerate(inputs)}
        with self.draws(mb):  # (traced above without them: the graph holds no generator)
            produced = self._call(g.F, values)
        j = g.joint
        outputs = tuple(inputs[j.passthrough[k]] if k in j.passthrough
                        else produced[("o", j.outputs.index(k))]
                        for k in range(len(j.outputs) + len(j.passthrough)))
        if self.is_last:
            self.last_loss = outputs[0].detach()
        if not torch.is_grad_enabled():  # a no-grad forward (balance.py): no backward follows
            return outputs
        values.update(produced)
        keep = {k: values[k] for k in g.saved_keys()}
        if self.saved_bytes is not None:
            self.saved_bytes[mb] = tensor_bytes(keep.values(), self.params)
        self._saved[mb] = _Pending(keep, self._compiled)
        return outputs

    # --------------------------------------------------------------- backward
    def _tangents(self, pending: _Pending, out_grads) -> None:
        """The incoming gradient of each output that has one (zeros where none came)."""
        j = self._compiled.graphs.joint
        tangents = [n for n in self._compiled.graphs.joint.gm.graph.nodes
                    if n.op == "placeholder"][j.num_primals:]
        for t, (k, node) in enumerate(zip(j.tangent_outputs, tangents)):
            val = node.meta["val"]
            if self.is_last:
                g = torch.full(val.shape, self.loss_scale, dtype=val.dtype, device=self.device)
            else:
                if out_grads is None:
                    raise RuntimeError(f"stage {self.spec.index}'s backward got no output "
                                       "gradients")
                g = out_grads[k]
                if g is None:
                    g = torch.zeros(val.shape, dtype=val.dtype, device=self.device)
            pending.values[("t", t)] = g

    @property
    def device(self) -> torch.device:
        p = next(iter(self.params), None)
        return p.device if p is not None else torch.device("cpu")

    def _input_grads_of(self, produced: dict, out_grads) -> dict[str, torch.Tensor]:
        g = self._compiled.graphs
        j = g.joint
        grads = {}
        for i in j.grad_inputs:
            x = produced.get(("g", g.first_input + i))
            grads[i] = x
        for k, i in j.passthrough.items():  # a forwarded input: its output's gradient too
            if i in grads and out_grads is not None and out_grads[k] is not None:
                grads[i] = out_grads[k] if grads[i] is None else grads[i] + out_grads[k]
        out = {}
        for i, x in grads.items():
            ref = self.spec.inputs[i]
            if x is None:
                val = [n for n in j.gm.graph.nodes if n.op == "placeholder"][g.first_input + i]
                x = torch.zeros(val.meta["val"].shape, dtype=val.meta["val"].dtype,
                                device=self.device)
            out[ref.name] = x
        return out

    def backward_input(self, mb: int, out_grads=None) -> dict[str, torch.Tensor]:
        """B: gradients of the float upstream inputs; keeps what W reads."""
        pending = self._saved[mb]
        self._compiled = pending.compiled
        g = self._compiled.graphs
        self._tangents(pending, out_grads)
        produced = self._call(g.B, pending.values)
        grads = self._input_grads_of(produced, out_grads)
        need = set(g.W.inputs)
        pending.values = {k: v for k, v in {**pending.values, **produced}.items() if k in need}
        pending.after_b = True
        if self.handed_bytes is not None:  # what B adds for W: handed values, tangents
            self.handed_bytes[mb] = tensor_bytes(
                [v for k, v in pending.values.items() if k[0] == "t" or k in set(g.B.outputs)],
                self.params)
        return grads

    def backward_weight(self, mb: int) -> None:
        """W: weight gradients, accumulated into `.grad`; frees the microbatch's values."""
        pending = self._saved.pop(mb)
        self._compiled = pending.compiled
        self.last_grad_norm = None
        if not pending.after_b:
            raise RuntimeError(f"W(stage {self.spec.index}, mb {mb}) ran before its B")
        g = self._compiled.graphs
        produced = self._call(g.W, pending.values)
        self._add_weight_grads(produced, [])
        self._grads_done()

    def backward_full(self, mb: int, out_grads=None) -> dict[str, torch.Tensor]:
        """BW: input and weight gradients in one graph; frees the microbatch's values."""
        pending = self._saved.pop(mb)
        self._compiled = pending.compiled
        self.last_grad_norm = None
        g = self._compiled.graphs
        self._tangents(pending, out_grads)
        produced = self._call(g.BW, pending.values)
        grads = self._input_grads_of(produced, out_grads)
        self._add_weight_grads(produced, list(grads.values()) + list(out_grads or ()))
        self._grads_done()
        return grads

    def _add_weight_grads(self, produced: dict, others: list) -> None:
        j = self._compiled.graphs.joint
        by_name = {n: produced.get(("g", i)) for i, n in enumerate(j.param_names)}
        named = dict(self.module.named_parameters())
        grads = {id(named[n]): gr for n, gr in by_name.items() if gr is not None}
        self._accumulate([grads.get(id(p)) for p in self.params], others)

    def measure_saved(self) -> None:
        super().measure_saved()
        self.handed_bytes = {}


def _input_key(joint: JointGraph) -> tuple:
    """The (shape, dtype) of each stage input the joint graph was traced for."""
    placeholders = [n for n in joint.gm.graph.nodes if n.op == "placeholder"]
    first = len(joint.param_names) + len(joint.buffer_names)
    return tuple((tuple(n.meta["val"].shape), n.meta["val"].dtype)
                 for n in placeholders[first:first + joint.num_inputs])


def on_device(gm: torch.fx.GraphModule, device: torch.device) -> None:
    """The devices a graph names as constants (factory ops traced on meta tensors) set to
    `device`, in place."""
    for node in gm.graph.nodes:
        node.args, node.kwargs = torch.utils._pytree.tree_map_only(
            torch.device, lambda _: device, (node.args, node.kwargs))
    gm.recompile()


def _param_or_buffer(module: torch.nn.Module, name: str) -> torch.Tensor:
    try:
        return module.get_buffer(name)
    except AttributeError:
        return module.get_parameter(name)


def tensor_bytes(tensors, params) -> int:
    """Bytes of the distinct storages of `tensors`, parameters' own storages left out."""
    skip = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[int, int] = {}
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        s = t.untyped_storage()
        if s.data_ptr() not in skip:
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())
