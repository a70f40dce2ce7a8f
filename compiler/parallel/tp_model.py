"""A Hugging Face model's own tensor-parallel plan, read as pipeplan's column / row / vocab.

transformers declares per model which modules split how: `model.tp_plan` (the
top model's `_tp_plan`, e.g. `lm_head`, plus its base model's
`config.base_model_tp_plan`, prefixed), module patterns -> style. The one table
`HF_STYLES` says what each style becomes here; pipeplan then places its own
collectives (Megatron's pairing), so a `colwise_gather_output` -> `rowwise_split_input`
pair runs as column -> row without the gather (the same sums: what verify checks).
A `packed_colwise` (or a plain `colwise`) Linear whose output the graph cuts into parts
is split part by part either way (tp_fused.py).
"""
from __future__ import annotations

from typing import Optional

import torch

# style -> kind ("" : kept whole, as pipeplan keeps every unnamed parameter)
HF_STYLES = {
    "colwise": "column", "colwise_gather_output": "column", "packed_colwise": "column",
    "rowwise": "row", "rowwise_split_input": "row", "packed_rowwise": "row",
    "embedding_rowwise": "vocab", "replicated_with_grad_allreduce": "",
}


def declared_plan(model: torch.nn.Module) -> Optional[dict[str, str]]:
    """Qualified module pattern -> style, from the outermost module declaring a plan (the
    model itself, or a transformers model a user module wraps); None when none does."""
    for path, module in model.named_modules():
        try:
            full = getattr(module, "tp_plan", None) if hasattr(type(module), "tp_plan") else None
        except (AttributeError, TypeError):  # a model whose plan property cannot be read
            full = None
        if not isinstance(full, dict) or not full:
            full = _base_plan(module)
        if full:
            prefix = path + "." if path else ""
            return {prefix + pattern: style for pattern, style in full.items()}
    return None


def _base_plan(module: torch.nn.Module) -> dict[str, str]:
    """`config.base_model_tp_plan`, prefixed by the base model's attribute."""
    declared = getattr(getattr(module, "config", None), "base_model_tp_plan", None) or {}
    prefix = getattr(module, "base_model_prefix", "")
    prefix = prefix + "." if prefix and isinstance(getattr(module, prefix, None),
                                                   torch.nn.Module) else ""
    return {prefix + pattern: style for pattern, style in declared.items()}
