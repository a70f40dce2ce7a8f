"""The model both sides start from, and the loss the reference computes on its output.

Initial weights: every process (each pipeline rank and the reference) builds
the whole unmodified model on CPU under `plan.train.seed` (the compiler's
`load_model`), so all start from identical tensors; a rank then keeps only
its own stages' parameters. This needs each host to hold the whole model
once at start-up: it does not scale past one host's memory (the scalable
path, building on the meta device and initialising each owned parameter
deterministically from its name, is future work).

The loss is the compiler's own `reference_loss`: the same function that
appended the loss to the captured graph, so both sides compute the same ops.
"""
from __future__ import annotations

import torch

from ..dsl.ast import Plan


def build_model(plan: Plan) -> torch.nn.Module:
    """The unmodified model with the plan's initial weights, on CPU."""
    from ..compiler.loading import load_model

    return load_model(plan, device="cpu")


def model_loss(plan: Plan, output, targets: torch.Tensor) -> torch.Tensor:
    """One microbatch's unscaled loss (main loss + the model's scalar aux losses)."""
    from ..compiler.loss import reference_loss

    return reference_loss(plan.model.loss, output, targets)
