"""The pipeline schedule for a compiled plan, from the schedule engine, costed by stage.

Stage op times come from the time model on the device (estimate/predict.action_costs:
each stage's ops on the device, B with its recompute, plus exposed collectives; p2p
latency), so cost-aware kinds (`auto`, the zero-bubble
family) order ops for this model and these links, not for equal stages. A plan's
`pipeline { costs = [[F, B, W], ...] }` replaces the estimated ratios between stages
and ops (stage_costs), for the schedule and the time estimate alike.
"""
from __future__ import annotations

from typing import Optional

from ..dsl.ast import Plan
from ..dsl.errors import PlanError
from ..errors import PipeplanError
from .compiled import StageSpec


def make_schedule(plan: Plan, stages: list[StageSpec], costs):
    """The verified schedule of the plan's kind for this model's stage costs (a Costs)."""
    from ..schedules import generate
    try:
        return generate(plan.pipeline.schedule, ranks=plan.mesh.pp, microbatches=plan.microbatches,
                        virtual=plan.pipeline.virtual, costs=costs,
                        memory_limit=_memory_limit(plan, stages))
    except PlanError:
        raise
    except PipeplanError as e:  # the engine rejected the combination: point at the plan
        raise PlanError.at(plan, "pipeline.schedule", str(e)) from e


def stage_costs(plan: Plan, estimated):
    """The costs the schedule and the estimates use: the estimated ones (a Costs, seconds), or
    the plan's relative [F, B, W] per stage scaled to the same total work, with the estimated
    p2p latency."""
    given = plan.pipeline.costs
    if given is None:
        return estimated
    from ..schedules.costs import Costs
    total = sum(map(sum, estimated.per_stage))
    scale = total / sum(map(sum, given)) if total > 0 else 1.0
    return Costs(per_stage=tuple(tuple(x * scale for x in t) for t in given), latency=estimated.latency)


class ScheduleMismatch(PipeplanError):
    """A decided schedule does not describe the plan's ranks, stages and microbatches."""


def decided_schedule(plan: Plan, stages: list[StageSpec], schedule):
    """`schedule` (decided elsewhere and verified there) when it describes this plan's pipeline
    ranks, stages and microbatches; else ScheduleMismatch naming both."""
    want = (plan.mesh.pp, len(stages), plan.microbatches)
    got = (schedule.ranks, schedule.stages, schedule.microbatches)
    if got != want:
        raise ScheduleMismatch(
            f"the decided schedule describes {got[0]} ranks, {got[1]} stages, {got[2]} "
            f"microbatches, but the plan compiles to {want[0]}, {want[1]}, {want[2]}")
    return schedule


def _memory_limit(plan: Plan, stages: list[StageSpec]) -> Optional[float]:
    """The plan's activation limit in the engine's unit (microbatches of a rank's layers)."""
    lim = plan.pipeline.memory_limit
    if lim is None:
        return None
    if not lim.in_bytes:
        return lim.amount
    per_rank: dict[int, int] = {}
    for st in stages:  # before placement: assume the loop placement for the conversion
        r = st.index % plan.mesh.pp
        per_rank[r] = per_rank.get(r, 0) + st.activation_bytes
    largest = max(per_rank.values(), default=0) or 1
    return lim.amount / largest
