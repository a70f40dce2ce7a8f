"""Context parallelism's compile-time passes, in their one order: `context_checks`.

The driver (compiler/driver.py) and the planner (planner/units.py, for each cp value it
searches) both run them on a capture at one cp rank's sequence length, so the planner
considers exactly the cp values `pipeplan check` accepts, for the same reasons:

1. `mark_positions` (cp_masks.py): what numbers the local slice from 0 with a literal
   length (export) -- an `arange(S/cp)`, a constant's first S/cp rows -- marked, by the
   whole-length twin, to be taken at the rank's positions at run time;
2. `ulysses_regions` (cp_regions.py): attention the model writes out, run whole on each
   rank's heads under Ulysses;
3. `check_locality` (cp_locality.py): every op outside attention proven per position (the
   model's own `arange(x.shape)` positions marked for renumbering);
4. `whole_sequence_masks` (cp_masks.py): the model's masks rebuilt on the whole sequence;
5. `check_context` (cp.py): what ring or Ulysses attention cannot honour.
"""
from __future__ import annotations

import torch

from ...dsl.ast import Plan
from .cp import check_context
from .cp_locality import check_locality, sequence_inputs
from .cp_masks import Whole, mark_positions, whole_sequence_masks
from .cp_regions import ulysses_regions


def context_checks(plan: Plan, model: torch.nn.Module, traced, per_token: frozenset,
                   tp_heads: dict) -> None:
    """Run the five passes on `traced` (capture/traced.TracedWithLoss at `plan`'s cp);
    a refusal is a PlanError at `context.method` (or `mesh.cp`). No-op at cp = 1."""
    end = traced.prediction if traced.prediction is not None else traced.loss
    whole = Whole(plan, model)  # the model captured at the whole length, when cp needs it
    mark_positions(plan, traced.module, traced.run, whole, sequence_inputs(plan))
    ulysses_regions(plan, traced.module, traced.run, whole, sequence_inputs(plan), end,
                    per_token)
    check_locality(plan, traced.module, traced.run, end, per_token)
    whole_sequence_masks(plan, traced.module, traced.run, whole, sequence_inputs(plan))
    check_context(plan, traced.module.graph, traced.run, tp_heads)
