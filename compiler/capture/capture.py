"""Capture a model as one flat FX graph whose attributes are the model's own tensors.

Two front ends produce the same thing (a `Captured`):

* `fx`: `torch.fx.symbolic_trace` semantics, with the plan's leaf-module patterns
  traced as opaque calls. Readable graphs of torch-level ops; fails on
  data-dependent Python control flow and on decorated `*args/**kwargs` forwards.
* `export`: `torch.export.export(strict=False)`, then parameters, buffers and
  constants turned back into `get_attr` nodes under their original names.
  Captures current transformers models (with `use_cache=False`).

`auto` tries fx first and falls back to export, recording why. When capture
fails, the error names the module and the source line that broke it.

Both keep the experts module of each MoE layer (compiler/parallel/ep.py) as one
`call_module` node calling the model's own module: a leaf under fx; under
export a custom-op placeholder while tracing, turned back into the module call
(compiler/capture/experts_call.py).
"""
from __future__ import annotations

import contextlib
import copy
import inspect
import io
import logging
import operator
import traceback
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from ...dsl.ast import Plan
from ...dsl.errors import PlanError
from . import functions
from .experts_call import opaque_experts, restore_experts_calls
from ..compiled import CONSTANT
from ..patterns import matches

CAPTURE_METHODS = ("auto", "fx", "export")


@dataclass(frozen=True)
class Captured:
    module: fx.GraphModule  # attributes are the model's tensors/modules under original names
    inputs: tuple[str, ...]  # placeholder i is batch field inputs[i]
    outputs: Any  # the model's output structure, with fx Nodes as leaves
    method: str  # "fx" | "export"
    reason: str  # why this method (auto mode: why fx was not used)


class CaptureFailed(Exception):
    """One front end failed; `where` names the module and source line."""

    def __init__(self, method: str, error: BaseException, where: str):
        self.method, self.error, self.where = method, error, where
        super().__init__(f"{method}: {type(error).__name__}: {_first_line(error)} ({where})")


def capture(plan: Plan, model: torch.nn.Module, example: dict[str, torch.Tensor]) -> Captured:
    """Capture `model` called on `example` (batch field -> tensor) as the plan asks.

    The experts modules of the plan's MoE layers (compiler/parallel/ep.py) stay one opaque
    call each under both front ends (compiler/capture/experts_call.py). A custom
    `torch.autograd.Function` the forward calls loses its backward in either front end:
    refused at the model line unless its backward is proven to be autograd's gradient of
    its forward (compiler/capture/functions.py)."""
    with functions.recording() as calls:
        captured = _capture(plan, model, example)
    if calls:  # (fx: its proxies have no shapes; one more forward records them)
        functions.record_shapes(calls, lambda: model(**example, **_training_kwargs(model,
                                                                                   example)))
        wrong = functions.check(calls)
        if wrong is not None:
            fn, why = wrong
            raise PlanError.at(plan, "model.source", f"the model's forward calls the autograd "
                               f"Function `{functions.describe(fn)}`, whose backward a "
                               f"captured graph does not run (fx and export trace through its "
                               f"forward), and {why}: the stages would train with another "
                               "gradient than the model's",
                               "compute that part without a custom autograd.Function, or "
                               "with one whose backward is its forward's gradient")
    return captured


def _capture(plan: Plan, model: torch.nn.Module, example: dict[str, torch.Tensor]) -> Captured:
    from ..parallel.ep import experts_modules

    experts = tuple(experts_modules(plan, model).values())
    method = plan.model.capture
    if method not in CAPTURE_METHODS:
        raise PlanError.at(plan, "model.capture", f"unknown capture method {method!r}",
                           f"one of: {', '.join(CAPTURE_METHODS)}")
    try:
        if method == "fx":
            return capture_fx(model, example, plan.model.leaf_modules, "the plan asks for fx",
                              experts)
        if method == "export":
            return capture_export(model, example, "the plan asks for export", experts)
    except CaptureFailed as e:
        raise _capture_error(plan, [e]) from e.error
    try:
        return capture_fx(model, example, plan.model.leaf_modules,
                          "auto: torch.fx.symbolic_trace succeeded", experts)
    except CaptureFailed as fx_failure:
        try:
            return capture_export(model, example, f"auto: fx failed ({fx_failure}), "
                                  "captured with torch.export (non-strict)", experts)
        except CaptureFailed as export_failure:
            raise _capture_error(plan, [fx_failure, export_failure]) from export_failure.error


# ---------------------------------------------------------------------------- fx
class _LeafTracer(fx.Tracer):
    """symbolic_trace's tracer, also treating modules matching the plan's patterns as leaves."""

    def __init__(self, patterns: tuple[str, ...], names: tuple[str, ...] = ()):
        super().__init__()
        self.patterns, self.names = patterns, frozenset(names)

    def is_leaf_module(self, m: torch.nn.Module, qualname: str) -> bool:
        return (qualname in self.names or any(matches(qualname, p) for p in self.patterns)
                or super().is_leaf_module(m, qualname))

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict) -> Any:
        """A parameter read directly (RMSNorm.weight) becomes get_attr by its qualified name.
        fx searches all named_parameters for each such read (quadratic in depth); this looks
        the name up in a table built once."""
        if isinstance(attr_val, torch.nn.Parameter):
            if getattr(self, "_param_names", None) is None:
                self._param_names = {id(p): n for n, p in self.root.named_parameters()}
            name = self._param_names.get(id(attr_val))
            if name is not None:
                if name not in parameter_proxy_cache:
                    parameter_proxy_cache[name] = self.create_proxy("get_attr", name, (), {})
                return parameter_proxy_cache[name]
        return super().getattr(attr, attr_val, parameter_proxy_cache)


# Each model's fx graphs, by what a trace reads besides the model's code (leaf patterns,
# experts modules, the inputs given, every module's training flag): no shape enters a
# symbolic trace, so the planner's captures of one model at other microbatch sizes and cp
# values copy the graph (fx's Graph.__deepcopy__) instead of tracing it again. Kept only for
# traces that called no custom autograd Function (capture() records those calls as the
# trace makes them), and dropped with the model.
_TRACES: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()


def _trace_fx(model: torch.nn.Module, example: dict, leaf_modules: tuple[str, ...],
              experts: tuple[str, ...]) -> fx.Graph:
    key = (tuple(leaf_modules), tuple(experts), tuple(example),
           tuple(m.training for m in model.modules()))
    traced = _TRACES.get(model, {}).get(key)
    if traced is None:
        tracer = _LeafTracer(tuple(leaf_modules), experts)
        with functions.recording() as calls:
            try:
                traced = tracer.trace(model, concrete_args=_defaults_not_given(model, example))
            except Exception as e:
                raise CaptureFailed("fx", e, _where(model, e, tracer)) from e
        if calls:
            return traced
        _TRACES.setdefault(model, {})[key] = traced
    return copy.deepcopy(traced)


def capture_fx(model: torch.nn.Module, example: dict, leaf_modules: tuple[str, ...],
               reason: str, experts: tuple[str, ...] = ()) -> Captured:
    """`experts`: qualified names of experts modules, traced as leaf calls."""
    graph = _trace_fx(model, example, leaf_modules, experts)
    _drop_specialised_arguments(graph, example)
    names = tuple(n.target for n in graph.nodes if n.op == "placeholder")
    missing = [n for n in names if n.lstrip("*") not in example]
    if missing:  # forward takes inputs the plan does not describe
        raise CaptureFailed("fx", TypeError(
            f"forward takes {', '.join(names)}; the plan's model.inputs give "
            f"{', '.join(example)}"), "model.forward")
    output = next(n for n in graph.nodes if n.op == "output")
    outputs = output.args[0]
    graph.erase_node(output)
    return Captured(fx.GraphModule(model, graph), names, outputs, "fx", reason)


def _drop_specialised_arguments(graph: fx.Graph, example: dict) -> None:
    """Remove the placeholders fx keeps for arguments traced at their defaults, and their guards."""
    def erase(node: fx.Node) -> None:
        for user in list(node.users):
            erase(user)
        graph.erase_node(node)
    for node in [n for n in graph.nodes
                 if n.op == "placeholder" and n.target not in example and n.args]:
        erase(node)
    for node in graph.nodes:  # a given input keeps no default (inputs are appended after it)
        if node.op == "placeholder" and node.args:
            node.args = ()


# ------------------------------------------------------------------------ export
def capture_export(model: torch.nn.Module, example: dict, reason: str,
                   experts: tuple[str, ...] = ()) -> Captured:
    """`experts`: qualified names of experts modules, kept as call_module nodes."""
    # the example inputs go where the model's tensors are (export fakes them either way):
    # meta inputs would meet a real model's buffers in ops that mix them (transformers'
    # RoPE: position_ids * inv_freq when position_ids is an input)
    held = next(iter(model.parameters()), None)
    device = held.device if held is not None else torch.device("meta")
    try:
        with _quiet_torch_logs(), opaque_experts(model, experts), \
                _on_cpu_if_meta(model, device) as place:
            example = {k: place(v) if isinstance(v, torch.Tensor) and v.is_meta else v
                       for k, v in example.items()}
            ep = torch.export.export(model, (), {**example, **_training_kwargs(model, example)},
                                     strict=False)
            constants = {k: place.original.get(id(v), v) for k, v in ep.constants.items()}
    except Exception as e:
        raise CaptureFailed("export", e, _where(model, e, None)) from e
    sig = ep.graph_signature
    from torch.export.graph_signature import ConstantArgument, InputKind, OutputKind
    if any(s.kind not in (OutputKind.USER_OUTPUT,) for s in sig.output_specs):
        mutated = [s.target for s in sig.output_specs if s.kind != OutputKind.USER_OUTPUT]
        raise CaptureFailed("export", RuntimeError(
            f"forward mutates state in place: {', '.join(map(str, mutated))}"),
            "state updates (e.g. BatchNorm running stats) are not supported in a pipeline stage")
    attrs = dict(model.named_parameters(remove_duplicate=False))
    attrs.update(model.named_buffers(remove_duplicate=False))
    attrs.update(constants)
    graph, env, inputs = fx.Graph(), {}, []
    spec_of = {s.arg.name: s for s in sig.input_specs}
    for node in ep.graph.nodes:
        if node.op == "placeholder":
            spec = spec_of[node.name]
            if isinstance(spec.arg, ConstantArgument):  # e.g. use_cache=False: a constant
                env[node] = spec.arg.value
            elif spec.kind == InputKind.USER_INPUT:
                name = _user_input_name(ep, spec, len(inputs))
                env[node] = graph.placeholder(name)
                inputs.append(name)
            else:
                env[node] = graph.get_attr(spec.target)
                if spec.kind == InputKind.CONSTANT_TENSOR:  # `torch.tensor(literal)`
                    env[node].meta[CONSTANT] = True
        elif node.op == "output":
            flat = [env[a] if isinstance(a, fx.Node) else a for a in node.args[0]]
            outputs = pytree.tree_unflatten(flat, ep.call_spec.out_spec)
        else:
            _copy_node(node, graph, env, ep.graph_module)
    called = restore_experts_calls(graph)
    used = {n.target for n in graph.nodes if n.op == "get_attr"}
    root = {t: attrs[t] for t in used}
    root.update((name, model.get_submodule(name)) for name in called)
    return Captured(fx.GraphModule(root, graph), tuple(inputs), outputs, "export", reason)


_GRAD_MODE = torch.ops.higher_order.wrap_with_set_grad_enabled


def _copy_node(node: fx.Node, graph: fx.Graph, env: dict, owner: nn.Module) -> None:
    """One node of the exported graph into `graph` (`lift_fresh_copy` as the clone it is).
    A region the forward runs under `torch.no_grad()` (export keeps it as a higher-order op,
    `wrap_with_set_grad_enabled`, over a graph of its own: DeepSeek-V3.2's indexer picks its
    top-k there) is inlined, its inputs detached (`_inline_grad_mode`). Any other such
    region (`wrap_with_autocast`) is refused, naming it: its body is not one of the
    model's tensors."""
    if node.op == "call_function" and node.target is torch.ops.aten._assert_tensor_metadata.default:
        return  # export's own guards; they pin the capture device and say nothing new
    if node.op == "call_function" and node.target is torch.ops.aten.lift_fresh_copy.default:
        # `torch.tensor(literal)` in the forward (T5's, BART's and GPT-Neo's mask values):
        # a fresh copy of a constant, which is what clone computes; DTensor (tensor
        # parallel stages) has a sharding strategy for clone and none for lift_fresh_copy
        env[node] = graph.call_function(torch.ops.aten.clone.default, (env[node.args[0]],))
        env[node].meta = dict(node.meta)
        return
    if node.op == "get_attr" and isinstance(getattr(owner, node.target, None), fx.GraphModule) \
            and node.users and all(u.target is _GRAD_MODE for u in node.users):
        env[node] = getattr(owner, node.target)  # inlined where it is called
        return
    if node.op == "call_function" and node.target is _GRAD_MODE:
        env[node] = _inline_grad_mode(node, graph, env)
        return
    if node.op == "call_function" and node.target is operator.getitem \
            and isinstance(env.get(node.args[0]), tuple):  # an inlined region's output
        env[node] = env[node.args[0]][node.args[1]]
        return
    if node.op == "get_attr" and isinstance(getattr(owner, node.target, None), fx.GraphModule):
        users = ", ".join(sorted({str(u.target) for u in node.users}))
        raise CaptureFailed("export", RuntimeError(
            f"the forward holds a region export keeps as a higher-order op ({users})"),
            "run that region's code without changing the grad or autocast mode inside "
            "the forward")
    env[node] = graph.node_copy(node, env.__getitem__)


def _inline_grad_mode(node: fx.Node, graph: fx.Graph, env: dict) -> tuple:
    """The body of `wrap_with_set_grad_enabled(enabled, body, *operands)` copied in place;
    under `enabled=False` each tensor operand is read through `aten.detach` first, so no
    gradient flows through the region (what running it under no_grad means: its outputs do
    not require grad). Returns the body's outputs (the region's getitems read them)."""
    enabled, body, *operands = node.args
    values = []
    for a in operands:
        v = env[a] if isinstance(a, fx.Node) else a
        if not enabled and isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor):
            v = graph.call_function(torch.ops.aten.detach.default, (v,))
            v.meta = {**node.meta, "val": a.meta["val"]}
        values.append(v)
    module, inner = env[body], {}
    places = iter(values)
    for n in module.graph.nodes:
        if n.op == "placeholder":
            inner[n] = next(places)
        elif n.op == "output":
            return tuple(inner[a] if isinstance(a, fx.Node) else a for a in n.args[0])
        else:
            _copy_node(n, graph, inner, module)
    raise AssertionError("a graph without an output")


def gradless_parameters(graph: fx.Graph, params: set) -> tuple[str, ...]:
    """The parameters (of `params`, qualified names) the graph reads only through
    `aten.detach`: a region run under no_grad (`_inline_grad_mode`) or the forward's own
    `.detach()`. The model gives them no gradient, so single-process training never steps
    them (an optimizer skips a parameter whose grad is None); the runtime trains them as
    frozen (backends/runtime/trainer.py), so no dp reduction or ZeRO shard makes a zero
    gradient for weight decay to act on."""
    return tuple(sorted(n.target for n in graph.nodes if n.op == "get_attr"
                        and n.target in params and n.users
                        and all(u.target is torch.ops.aten.detach.default for u in n.users)))


@dataclass(frozen=True)
class _Placing:
    place: Any  # meta example input -> the input export traces with
    original: dict  # id(fake tensor) -> the model's meta tensor it stands for

    def __call__(self, v: torch.Tensor) -> torch.Tensor:
        return self.place(v)


@contextlib.contextmanager
def _on_cpu_if_meta(model: torch.nn.Module, device: torch.device):
    """A model on the meta device is traced as on the CPU, where it runs: its parameters
    and buffers are swapped for fake CPU tensors (no storage) while export traces, so code
    that branches on its tensors' device takes the run's branch (transformers'
    load_balancing_loss_func counts top-k choices with histc in float32 on CPU, in int32
    elsewhere: the int kernel does not exist on CPU). Yields how to place an example
    input (a fake CPU tensor; a real model: zeros on its device)."""
    if device.type != "meta":
        yield _Placing(lambda v: torch.zeros(v.shape, dtype=v.dtype, device=device), {})
        return
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    convert = mode.fake_tensor_converter.from_meta_and_device
    cpu = torch.device("cpu")
    swapped, original = [], {}
    for module in model.modules():
        for slots in (module._parameters, module._buffers):
            for k, t in slots.items():
                if t is not None and t.is_meta:
                    fake = convert(mode, t.data, cpu)
                    swapped.append((slots, k, t))
                    if isinstance(t, nn.Parameter):
                        slots[k] = nn.Parameter(fake, t.requires_grad)
                    else:  # a buffer export may lift to a constant: known by the id of the
                        # fake, alive in its slot while export runs (a parameter's fake is
                        # dropped once wrapped, and its id may come back as another tensor)
                        slots[k] = fake
                        original[id(fake)] = t
    try:
        yield _Placing(lambda v: convert(mode, v, cpu), original)
    finally:
        for slots, k, t in swapped:
            slots[k] = t


def _user_input_name(ep, spec, index: int) -> str:
    """Export flattens the kwargs dict in order; its placeholders follow that order."""
    kwargs_spec = ep.call_spec.in_spec.child(1)
    return kwargs_spec.context[index]


def _defaults_not_given(model: torch.nn.Module, example: dict) -> dict:
    """forward's optional arguments the plan does not feed: traced at their defaults
    (and `use_cache` at False: a KV cache is for inference)."""
    params = inspect.signature(model.forward).parameters.values()
    fixed = {p.name: p.default for p in params
             if p.name not in example and p.default is not inspect.Parameter.empty}
    fixed.update(_training_kwargs(model, example))
    return fixed


def _training_kwargs(model: torch.nn.Module, example: dict) -> dict:
    """Keyword arguments that put a library model in training form: no KV cache."""
    params = inspect.signature(model.forward).parameters
    return {"use_cache": False} if "use_cache" in params and "use_cache" not in example else {}


# ------------------------------------------------------------------------ errors
def _where(model: torch.nn.Module, error: BaseException, tracer: fx.Tracer | None) -> str:
    """"module `layers.0.moe` (file.py:42: `if x.sum() > 0:`)" from the failure's traceback."""
    names = {id(m): n for n, m in model.named_modules()}
    module, line = None, None
    ours = (str(Path(torch.__file__).parent), str(Path(__file__).parent))
    for frame, lineno in traceback.walk_tb(error.__traceback__):
        owner = frame.f_locals.get("self")
        if isinstance(owner, torch.nn.Module) and id(owner) in names:
            module = names[id(owner)] or "<root>"
        if not frame.f_code.co_filename.startswith(ours):
            line = (frame.f_code.co_filename, lineno)
    if tracer is not None and getattr(tracer, "module_stack", None):
        module = next(reversed(tracer.module_stack.values()))[0] or module
    if line is None:  # failed before running user code: point at the forward itself
        forward = inspect.unwrap(type(model).forward)
        try:
            line = (inspect.getsourcefile(forward), inspect.getsourcelines(forward)[1])
        except (OSError, TypeError):
            pass
        module = module or "<root>"
    parts = []
    if module is not None:
        parts.append(f"module `{module}`")
    if line is not None:
        import linecache
        text = linecache.getline(line[0], line[1]).strip()
        parts.append(f"{line[0]}:{line[1]}" + (f": `{text}`" if text else ""))
    return ", ".join(parts) or "unknown location"


def _capture_error(plan: Plan, failures: list[CaptureFailed]) -> PlanError:
    lines = ["cannot capture the model: " + "; ".join(str(f) for f in failures)]
    return PlanError.at(plan, "model.capture" if "model.capture" in plan.spans else "model.source",
                        "\n".join(lines), "; or ".join(_hints(failures)))


def _hints(failures: list[CaptureFailed]) -> list[str]:
    """What to change, from what each front end ran into."""
    hints = []
    fx_failure = next((f for f in failures if f.method == "fx"), None)
    export_failure = next((f for f in failures if f.method == "export"), None)
    if fx_failure is not None and fx_failure.where.startswith("module `"):
        module = fx_failure.where.split("`")[1]
        if module != "<root>":
            hints.append(f'mark the module as a leaf (leaf_modules = ["{module}"])')
    if export_failure is None:
        hints.append('try capture = "export" (non-strict torch.export; use_cache=False models)')
        return hints
    text = f"{type(export_failure.error).__name__}: {export_failure.error}"
    if "Cache" in text:
        hints.append("build the model with use_cache=False (a KV cache is for inference)")
    if "data-dependent" in text or "DataDependent" in text:
        where = export_failure.where
        module = where.split("`")[1] if where.startswith("module `") else ""
        hints.append(f"make the data-dependent code{f' of `{module}`' if module else ''} "
                     "traceable (for experts: a dense or sorted dispatch over the same "
                     "weights, e.g. transformers' batched_mm or grouped_mm experts, instead "
                     "of a loop over nonzero()), or keep it out of the graph: list its MoE "
                     "layer in experts.modules where it offers the MoE interface, or capture "
                     'with capture = "fx" and leaf_modules = '
                     f'["{module or "<the module>"}"] where fx traces the rest')
    if not hints:
        hints.append("use torch.library.custom_op (with registered autograd) for custom "
                     "autograd Functions, and return aux losses as outputs")
    return hints


@contextlib.contextmanager
def _quiet_torch_logs():
    """torch.export logs whole graphs when a guard fails; the PlanError says what matters."""
    loggers = [logging.getLogger(n) for n in list(logging.root.manager.loggerDict)
               if n.startswith("torch")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else ""
