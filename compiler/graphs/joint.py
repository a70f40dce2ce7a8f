"""The joint graph of one stage: forward and backward traced together, functionalised.

`trace_joint(module, inputs, needs_grad)` traces a stage GraphModule with
AOTAutograd (`aot_export_joint_simple`: make_fx under functionalisation and
fake tensors) into one FX graph of aten ops whose placeholders are the
stage's parameters, buffers and inputs (the primals) followed by one tangent
per output that carries a gradient, and whose outputs are the stage outputs
followed by one gradient per primal (None where there is none). The
partition into F / B / W / BW is split.py's.

What cannot be traced jointly is refused with the op named (`JointTraceError`):
a custom `torch.autograd.Function` (its backward is the user's Python, which
AOTAutograd would inline or refuse) unless it is one of `TRACEABLE_FUNCTIONS`
(DTensor's own conversions and redistribution, whose collectives are functional
collectives, an operator's autograd registered with torch.library, and the
ones the parallel rewrites register with `traceable_function`: a backward of
tensor ops only, no host reads), an op whose output shape depends on the
data (`nonzero`, boolean masking: control flow on values), an output that is a
view of an input, a stage that writes a buffer or an input in place.

Recompute rules (`recompute`): the stage graph's nodes inside a matched region
are traced with their region's mode in the joint nodes' meta (`custom`, copied
by the tracer from the node being run), so split.py can leave them unsaved.

A stage output that is one of its inputs unchanged (a skip value forwarded
through a middle stage) is not part of the graph: `JointGraph.passthrough`
maps it to the input, and its gradient is added to that input's.
"""
from __future__ import annotations

import contextlib
import traceback
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback

from ...errors import PipeplanError


class JointTraceError(PipeplanError):
    """A stage that cannot be traced into one forward+backward graph; names the op."""


def _dtensor_functions() -> set:
    from torch.distributed.tensor import _api, _redistribute

    return {_api._FromTorchTensor, _api._ToTorchTensor, _redistribute.Redistribute}


# autograd.Functions AOTAutograd traces inline into the joint graph: forward and backward
# are tensor ops (collectives as functional collectives), nothing read on the host
TRACEABLE_FUNCTIONS: set = set()


def traceable_function(cls: type) -> type:
    """Class decorator: `cls` (a torch.autograd.Function) may be traced into a joint graph."""
    TRACEABLE_FUNCTIONS.add(cls)
    return cls


@dataclass
class JointGraph:
    """One stage's joint graph and what its placeholders and outputs are."""

    gm: fx.GraphModule
    param_names: list[str]  # primals [0, P): the stage's distinct parameters
    buffer_names: list[str]  # primals [P, P+B)
    num_inputs: int  # primals [P+B, P+B+I): the stage inputs, in spec order
    grad_inputs: list[int]  # input positions that receive a gradient
    outputs: list[int]  # stage output positions produced by the graph, in graph order
    passthrough: dict[int, int]  # stage output position -> the input it forwards unchanged
    tangent_outputs: list[int]  # stage output position of each tangent, in order

    @property
    def num_primals(self) -> int:
        return len(self.param_names) + len(self.buffer_names) + self.num_inputs


def stage_outputs_passthrough(module: fx.GraphModule) -> dict[int, int]:
    """Output position -> input position for outputs that are a placeholder itself."""
    placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
    out = next(n for n in module.graph.nodes if n.op == "output").args[0]
    out = out if isinstance(out, (tuple, list)) else (out,)
    return {k: placeholders.index(o) for k, o in enumerate(out)
            if isinstance(o, fx.Node) and o.op == "placeholder"}


RECOMPUTE_TAG = "pipeplan_recompute"  # joint node meta["custom"][...]: the region's mode


class _Tagging(fx.Interpreter):
    """Runs the stage graph node by node, each node's recompute mode (if any) in its meta
    while it runs, so the aten nodes traced from it carry the mode."""

    def __init__(self, module: fx.GraphModule, modes: dict):
        super().__init__(module)
        self.modes = modes

    def run_node(self, n: fx.Node):
        mode = self.modes.get(n)
        if mode is None:
            return super().run_node(n)
        saved = n.meta.get("custom")
        n.meta["custom"] = {**(saved or {}), RECOMPUTE_TAG: mode}
        try:
            return super().run_node(n)
        finally:
            if saved is None:
                del n.meta["custom"]
            else:
                n.meta["custom"] = saved


def _region_modes(module: fx.GraphModule, recompute: Sequence) -> dict:
    from ..recompute import find_regions

    if not recompute or not isinstance(module, fx.GraphModule):
        return {}
    return {n: r.mode for r in find_regions(module.graph, recompute) for n in r.nodes}


def trace_joint(module: fx.GraphModule, inputs: Sequence[torch.Tensor],
                needs_grad: Sequence[bool], on: Optional[str] = None,
                recompute: Sequence = ()) -> JointGraph:
    """Trace `module(*inputs)` forward and backward. `inputs` are example tensors of the
    right shapes and dtypes (real or meta); `needs_grad[i]`: input i gets a gradient.
    Parameters are the module's own (trainable ones get gradients); call under the
    precision context (autocast) the stage runs in. `on`: trace for that device type with
    fake tensors instead of the module's and the inputs' own (the compiler's check of a
    model on the meta device: meta kernels are not the device's -- attention decomposes
    differently, some backward kernels are missing). `recompute`: the plan's rules, whose
    regions' nodes are tagged (RECOMPUTE_TAG)."""
    from torch._functorch.aot_autograd import aot_export_joint_simple
    from torch.func import functional_call
    from torch.nn.utils.stateless import _reparametrize_module

    params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    frozen = [(n, p) for n, p in module.named_parameters() if not p.requires_grad]
    buffers = list(module.named_buffers()) + frozen
    passthrough = stage_outputs_passthrough(module)
    names = [n for n, _ in params] + [n for n, _ in buffers]
    count = len(names)
    kept: list[int] = []
    modes = _region_modes(module, recompute)

    def stage(*args):
        values = dict(zip(names, args[:count]))
        if modes:
            with _reparametrize_module(module, values, tie_weights=True):
                out = _Tagging(module, modes).run(*args[count:])
        else:
            out = functional_call(module, values, tuple(args[count:]), tie_weights=True)
        out = tuple(out) if isinstance(out, (tuple, list)) else (out,)
        kept[:] = [k for k in range(len(out)) if k not in passthrough]
        return tuple(_own(out[k]) for k in kept)

    mode = contextlib.nullcontext()
    if on is not None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        mode = FakeTensorMode()
        with mode:
            params = [(n, torch.empty(p.shape, dtype=p.dtype, device=on)) for n, p in params]
            buffers = [(n, torch.empty(b.shape, dtype=b.dtype, device=on)) for n, b in buffers]
            inputs = [torch.empty(x.shape, dtype=x.dtype, device=on) for x in inputs]
    grad_flags = _fake_forward(module, params, buffers, inputs, needs_grad)
    with mode:
        args = [p.detach().requires_grad_(True) for _, p in params] + \
            [b.detach() for _, b in buffers] + \
            [x.detach().requires_grad_(bool(g) and x.is_floating_point())
             for x, g in zip(inputs, needs_grad)]
    try:
        with mode, fx_traceback.preserve_node_meta(modes != {}):
            gm = aot_export_joint_simple(stage, args, trace_joint=True,
                                         num_params_buffers=count)
    except torch._subclasses.fake_tensor.DynamicOutputShapeException as e:
        raise JointTraceError(f"{e.args[0] if e.args else e}: its output shape depends on the "
                              "values (data-dependent), so no fixed graph computes it"
                              + _site(e)) from None
    except torch._subclasses.fake_tensor.DataDependentOutputException as e:
        raise JointTraceError(f"{e.args[0] if e.args else e}: its result is read as a Python "
                              "value" + (_site(e) or " (data-dependent control flow)")) from None
    except RuntimeError as e:
        if "alias inputs" in str(e) or "mutat" in str(e):
            raise JointTraceError("the stage returns a view of an input or writes an input or "
                                  "buffer in place (" + str(e).split(".")[0] + ")") from None
        raise
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    tangent_outputs = [k for k in kept if grad_flags[k]]
    if len(placeholders) - len(args) != len(tangent_outputs):
        raise JointTraceError(f"the joint graph has {len(placeholders) - len(args)} output "
                              f"gradients, the forward {len(tangent_outputs)}")
    return JointGraph(gm, [n for n, _ in params], [n for n, _ in buffers], len(inputs),
                      [i for i, (x, g) in enumerate(zip(inputs, needs_grad))
                       if g and x.is_floating_point()],
                      list(kept), passthrough, tangent_outputs)


# Frames of the tracing machinery itself, never where a stage's value is read.
_MACHINERY = ("torch/_subclasses/", "torch/_ops.py", "torch/utils/", "torch/_prims",
              "torch/_refs", "torch/_decomp", "torch/fx/", "torch/_tensor.py",
              "torch/_functorch/", "torch/_library/", "torch/_higher_order_ops/",
              "torch/_dynamo/", "torch/overrides.py", "torch/_compile.py")


def _site(error: BaseException) -> str:
    """Where a refused op was reached, from the trace's traceback: the stage graph's line
    that ran it and the innermost frame outside the tracing machinery (the code that read
    the value: the model's, or DTensor's redistribution of that line's operands, e.g. a
    strided shard's offsets read with `.tolist()`); '' when neither is found."""
    frames = traceback.extract_tb(error.__traceback__)
    graph = [f for f in frames if f.filename.startswith("<eval_with_key>") and f.line]
    reader = [f for f in frames if not f.filename.startswith("<")
              and not any(m in f.filename.replace("\\", "/") for m in _MACHINERY)
              and "compiler/graphs/joint.py" not in f.filename.replace("\\", "/")]
    parts = []
    if reader:
        f = reader[-1]
        where = f.filename.replace("\\", "/").split("site-packages/")[-1]
        owner = " (DTensor redistributing that line's operands)" if \
            "torch/distributed/tensor/" in where else ""
        parts.append(f"by {where}:{f.lineno} {f.name} (`{(f.line or '').strip()}`){owner}")
    if graph:
        parts.append(f"in the stage's `{graph[-1].line.strip()}`")
    return (" " + ", ".join(parts)) if parts else ""


def _own(value):
    """A stage output as a tensor of its own: a view (of an input, as OPT's stage 0 hands on
    its mask's slice) copied, since a joint graph cannot return what aliases its inputs;
    the same values either way."""
    return value.clone() if isinstance(value, torch.Tensor) and value._is_view() else value


def _fake_forward(module, params, buffers, inputs, needs_grad) -> list[bool]:
    """A forward on fake tensors with autograd on: which stage outputs require grad (those get
    a tangent); any node of its autograd graph made by a custom torch.autograd.Function is
    refused, by the Function's name."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch.func import functional_call

    fake = next((x.fake_mode for x in [t for _, t in params + buffers] + list(inputs)
                 if isinstance(x, FakeTensor)), None)
    with fake or FakeTensorMode(allow_non_fake_inputs=True) as mode:
        def own(x: torch.Tensor) -> torch.Tensor:
            return x.detach() if isinstance(x, FakeTensor) else mode.from_tensor(x)

        values = {n: own(p).requires_grad_(True) for n, p in params}
        values.update((n, own(b)) for n, b in buffers)
        args = [own(x).requires_grad_(bool(g) and x.is_floating_point())
                for x, g in zip(inputs, needs_grad)]
        try:
            with torch.enable_grad():
                out = functional_call(module, values, tuple(args), tie_weights=True)
        except (torch._subclasses.fake_tensor.DynamicOutputShapeException,
                torch._subclasses.fake_tensor.DataDependentOutputException):
            return []  # trace_joint names the op
    outs = out if isinstance(out, (tuple, list)) else (out,)
    found = _custom_function(torch.utils._pytree.tree_leaves(out))
    if found is not None:
        raise JointTraceError(f"custom autograd.Function {found}: its backward is Python "
                              "code, not part of a traceable graph")
    return [isinstance(o, torch.Tensor) and o.requires_grad for o in outs]


def _traceable(cls: type) -> bool:
    """A Function AOTAutograd may inline: listed, or the autograd of an operator registered
    with torch.library (functional collectives' among them), whose backward that API requires
    to be traceable."""
    import torch._library.autograd as library_autograd

    return cls in TRACEABLE_FUNCTIONS or cls in _dtensor_functions() or \
        cls.__module__ == library_autograd.__name__


def _custom_function(outputs) -> Optional[str]:
    seen, stack = set(), [o.grad_fn for o in outputs
                          if isinstance(o, torch.Tensor) and o.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if isinstance(node, torch.autograd.function.BackwardCFunction) and \
                not _traceable(node._forward_cls):
            cls = node._forward_cls
            return f"{cls.__module__}.{cls.__qualname__}"
        stack.extend(c for c, _ in node.next_functions)
    return None


TRACE_DEVICE = "cpu"  # the compiler traces for this device type (fake tensors, nothing allocated)




# torch's functional collectives (what DTensor and the rewrites issue) -> the estimates' names
COLLECTIVES = {"all_reduce": "allreduce", "all_gather_into_tensor": "allgather",
                "reduce_scatter_tensor": "reduce_scatter", "all_to_all_single": "alltoall"}


def traced_collectives(joint: JointGraph) -> dict[str, tuple[int, int]]:
    """The collectives a joint graph issues per microbatch, forward and backward: op ->
    (calls, bytes handed in), as the estimates name them. On a stage the runtime rewrote
    (backends/parallel/pretrace.py) these are DTensor's own, planned or not: a gather
    DTensor inserts to redistribute a split value shows here as it runs."""
    found: dict[str, tuple[int, int]] = {}
    for n in joint.gm.graph.nodes:
        packet = getattr(n.target, "_overloadpacket", None)
        op = COLLECTIVES.get(getattr(packet, "__name__", "")) \
            if "_c10d_functional" in str(n.target) else None
        value = n.args[0].meta.get("val") if op and isinstance(n.args[0], fx.Node) else None
        if isinstance(value, torch.Tensor):
            calls, nbytes = found.get(op, (0, 0))
            found[op] = (calls + 1, nbytes + value.numel() * value.element_size())
    return found
