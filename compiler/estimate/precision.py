"""The dtype of parameters, gradients and optimizer states under the plan's precision.

fp32 and bf16 (autocast over fp32 weights, backends/runtime/precision.py) keep the model's own
float32; fp64 converts the model to float64 before capture, so the whole trace, and every
dtype the runtime derives from it, is float64.
"""
from __future__ import annotations

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
    if dtype != torch.float32 and any(t.is_floating_point() and t.dtype != dtype
                                      for t in (*model.parameters(), *model.buffers())):
        model.to(dtype)
    return model
