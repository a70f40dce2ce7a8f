"""The model both sides start from, and the loss the reference computes on its output.

Initial weights are a function of (plan seed, module path), drawn by the model's
own per-module init (backends/materialize.py), or read from the plan's
`model.weights` file (backends/weights.py: each name from the file, lazily). `build_model` materialises the
whole model that way (the single-process reference); `own_stages` gives a
rank's compiled stages (compiled on the meta device) real tensors for exactly
the parameters and buffers they hold, drawn the same way, so a rank never
holds, or initialises, another rank's part and still starts from the
reference's weights.

The loss is the compiler's own `reference_loss`: the same function that
appended the loss to the captured graph, so both sides compute the same ops.
"""
from __future__ import annotations

import torch

from ..compiler.compiled import CompiledPlan
from ..dsl.ast import Plan
from .weights import weights_source


def build_model(plan: Plan) -> torch.nn.Module:
    """The unmodified model with the plan's initial weights, on CPU."""
    from ..compiler.loading import load_skeleton
    from .materialize import materialize

    model = load_skeleton(plan)
    materialize(model, plan.train.seed, source=weights_source(plan, model))
    return model


def own_stages(plan: Plan, compiled: CompiledPlan, pp_rank: int,
               device: torch.device = torch.device("cpu")) -> int:
    """Materialise the stages of pipeline rank `pp_rank` in place (their tensors were meta),
    on `device`; the other stages stay on meta. Returns the parameter bytes materialised."""
    from ..compiler.loading import load_skeleton
    from ..compiler.precision import to_precision
    from ..compiler.stages import move_stage
    from .materialize import install, materialize

    stages = compiled.stages_of_rank(pp_rank)
    skeleton = load_skeleton(plan)
    params = {n for s in stages for n in s.param_names}
    nbytes = materialize(skeleton, plan.train.seed,
                         params | {n for s in stages for n in s.buffer_names}, device,
                         source=weights_source(plan, skeleton))
    to_precision(skeleton, plan.train.precision)  # as compile_plan and the reference do
    if plan.train.precision == "fp64":  # the bytes after conversion
        owned = {id(p): p for n, p in skeleton.named_parameters(remove_duplicate=False)
                 if n in params}
        nbytes = sum(p.numel() * p.element_size() for p in owned.values())
    for s in stages:
        install(s.module, skeleton, s.param_names + s.buffer_names, params.__contains__)
        move_stage(s.module, device)  # graph constants captured on meta name the device
    return nbytes


def model_loss(plan: Plan, output, targets: torch.Tensor) -> torch.Tensor:
    """One microbatch's unscaled loss (main loss + the model's scalar aux losses)."""
    from ..compiler.loss import reference_loss

    return reference_loss(plan.model.loss, output, targets)
