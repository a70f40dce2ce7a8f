"""The model both sides start from, and the loss the reference computes on its output.

Initial weights are a function of (plan seed, module path), drawn by the model's
own per-module init (backends/state/materialize.py), or read from the plan's
`model.weights` file (backends/state/weights.py, lazily: only the names asked for).
`build_model` materialises the whole model that way (the single-process reference); `fill_stages` gives a
rank's compiled stages (compiled on the meta device, then rewritten for TP / EP
so that they hold only their shards) real tensors for exactly the parameters
and buffers they hold, drawn the same way and sliced, so a rank never holds, or
keeps, another rank's part and still starts from the reference's weights.

The loss is the compiler's own `reference_loss`: the same function that
appended the loss to the captured graph, so both sides compute the same ops.
"""
from __future__ import annotations

import torch

from ...compiler.compiled import CompiledPlan
from ...dsl.ast import Plan
from .weights import weights_source


def build_model(plan: Plan) -> torch.nn.Module:
    """The unmodified model with the plan's initial weights, on CPU."""
    from ...compiler.capture.loading import load_skeleton
    from .materialize import materialize

    model = load_skeleton(plan)
    materialize(model, plan.train.seed, source=weights_source(plan, model))
    return model


def own_stages(plan: Plan, compiled: CompiledPlan, pp_rank: int,
               device: torch.device = torch.device("cpu")) -> int:
    """Materialise the stages of pipeline rank `pp_rank` whole, in place (their tensors were
    meta), on `device`; the other stages stay on meta. Returns the parameter bytes held.
    (The runtime rewrites the stages for TP/EP first and calls `fill_stages` itself.)"""
    from .materialize import fresh_meta

    modules = [s.module for s in compiled.stages_of_rank(pp_rank)]
    fresh_meta(modules)
    return fill_stages(plan, modules, device)


def fill_stages(plan: Plan, modules, device: torch.device = torch.device("cpu"),
                flat=None) -> int:
    """Give every meta parameter and buffer of `modules` (one rank's stage modules, possibly
    rewritten for TP / EP so that they hold only their shards, see materialize.Slice) its
    initial value on `device`: each owning module's init runs once on CPU, the rank keeps
    its slice, and the module's storage is released before the next one (the peak is one
    module, not the stage); with the plan's weights each tensor is read from the file
    instead, only the rank's slice of it. `flat` (name -> materialize.FlatTarget, ZeRO's
    flat buffers: `StageZero.fill_targets()`) receives the parts of parameters that live in
    flat buffers this rank holds (ZeRO-3: its own shard only). Graph constants are moved to
    `device`. Returns the bytes of the distinct parameters the modules hold (outside flat
    buffers that are released: ZeRO-3's full parameters)."""
    from ...compiler.capture.loading import load_skeleton
    from ...compiler.stages import move_stage
    from .materialize import buffer_value, fill, initial_values, param_bytes

    modules = list(modules)
    targets: dict[str, list] = {}
    for m in modules:
        for name, p in m.named_parameters(remove_duplicate=False):
            if p.device.type == "meta" and all(p is not q for q in targets.get(name, ())):
                targets.setdefault(name, []).append(p)
    buffers = [(m, n, b) for m in modules for n, b in m.named_buffers(remove_duplicate=False)
               if b.device.type == "meta"]
    flat = flat or {}
    if not (targets or buffers or flat):
        return param_bytes(modules)  # stages compiled with their weights (tests)
    skeleton = load_skeleton(plan)
    source = weights_source(plan, skeleton)  # its names are read by `fill`, slices only
    drawn = [n for n in {**targets, **flat} if source is None or n not in source]
    fill(targets, initial_values(skeleton, plan.train.seed, drawn), device, source=source,
         flat=flat)
    for m, name, b in buffers:
        owner, _, leaf = name.rpartition(".")
        m.get_submodule(owner)._buffers[leaf] = buffer_value(skeleton, name, device, b.dtype)
    for m in modules:
        move_stage(m, device)  # graph constants captured on meta name the device
    return param_bytes(modules)


def model_loss(plan: Plan, output, targets: torch.Tensor) -> torch.Tensor:
    """One microbatch's unscaled loss (main loss + the model's scalar aux losses)."""
    from ...compiler.capture.loss import reference_loss

    return reference_loss(plan.model.loss, output, targets)
