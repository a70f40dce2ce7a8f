"""The dtype of parameters, gradients and optimizer states under the plan's precision.

fp32 and bf16 (autocast over fp32 weights, backends/runtime/precision.py) keep the model's own
float32; fp64 converts the model to float64 before capture, so the whole trace, and every
dtype the runtime derives from it, is float64.
"""
from __future__ import annotations

from typing import Optional

import torch

PRECISIONS = ("fp32", "bf16", "fp64")


def param_dtype(precision: str) -> torch.dtype:
    """The dtype of parameters, gradients and optimizer states under `precision`."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}")
    return torch.float64 if precision == "fp64" else torch.float32


def to_precision(model: torch.nn.Module, precision: str) -> torch.nn.Module:
    """The model (in place) with floating parameters and buffers in `param_dtype(precision)`.

    Models are built in their own dtype (float32 as a rule) under the plan's seed and then
    converted, so fp64 starts from the fp32 initial weights, identical on every process."""
    dtype = param_dtype(precision)
    if dtype != torch.float32 and any(precision_dtype(t, dtype) != t.dtype
                                      for t in (*model.parameters(), *model.buffers())):
        model._apply(lambda t: t.to(precision_dtype(t, dtype)))
    exact_experts_kernels(model, dtype)
    return model


_COMPLEX = {torch.float64: torch.complex128, torch.float32: torch.complex64}


def precision_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    """The dtype a parameter or buffer takes in a model converted to `dtype`: a floating
    one `dtype`, a complex one the complex type of `dtype` (a rotary table as torch.polar
    makes it: `Module.to(torch.float64)` would keep its real part alone), others their own."""
    if t.is_floating_point():
        return dtype
    if t.is_complex():
        return _COMPLEX.get(dtype, t.dtype)
    return t.dtype


# Experts kernels of transformers (`experts_implementation`, transformers/integrations/moe.py)
# with no float64 kernel -> the model's own implementation computing the same products:
# torch's grouped_mm takes float32/bf16/fp16 matrices only; batched_mm gathers each token's
# expert weights and multiplies them per token (bmm), in any dtype.
NO_FLOAT64 = {"grouped_mm": "batched_mm"}
_NOTE = "_pipeplan_kernel_note"


def exact_experts_kernels(model: torch.nn.Module, dtype: torch.dtype) -> Optional[str]:
    """Under float64, switch every transformers model inside `model` whose experts run a
    kernel without a float64 path (NO_FLOAT64) to its exact equivalent, with the model's
    own `set_experts_implementation`; the note said (None: nothing switched)."""
    if dtype != torch.float64:
        return None
    switched = []
    for path, mod in model.named_modules():
        get = getattr(mod, "get_experts_implementation", None)
        can = getattr(mod, "_can_set_experts_implementation", None)
        if not callable(get) or not (callable(can) and can()):
            continue
        now = get()
        if any(v in NO_FLOAT64 for v in now.values()):
            mod.set_experts_implementation({k: NO_FLOAT64.get(v, v) for k, v in now.items()})
            switched.append(path or type(mod).__name__)
    if not switched:
        return None
    note = (f"experts of {', '.join(switched)} run transformers' batched_mm "
            "(experts_implementation), not grouped_mm: torch's grouped_mm has no float64 "
            "kernel; batched_mm computes the same per-token products (run and reference alike)")
    setattr(model, _NOTE, note)
    return note


def kernel_notes(model: torch.nn.Module) -> list[str]:
    """What `to_precision` switched in `model`, for the report."""
    note = getattr(model, _NOTE, None)
    return [note] if note else []


# ------------------------------------------------------- the model's own lower precision
LOWER = (torch.float32, torch.bfloat16, torch.float16)


def narrowing_casts(graph, run) -> list[tuple[str, str, torch.dtype]]:
    """(node, module, dtype) of every op of a float64 graph that turns a float64 tensor into a
    lower-precision float one: the model computing part of itself in float32 (or bf16) on
    purpose (a router's `.float()`, an RMSNorm's upcast of a bf16 model, here a downcast).
    What flows from them carries that precision's rounding (verify's judge, compare.py)."""
    from ..capture.blocks import module_path

    out = []
    for node in graph.nodes:
        value = run.values.get(node)
        if not isinstance(value, torch.Tensor) or value.dtype not in LOWER:
            continue
        inputs = [run.values.get(a) for a in node.all_input_nodes]
        if any(isinstance(v, torch.Tensor) and v.dtype == torch.float64 for v in inputs):
            out.append((node.name, module_path(node), value.dtype))
    return out
