"""What `pipeplan check` prints: the resolved plan and what is known before tracing.

`check_report(plan)` covers what the plan alone tells; `pipeplan check` then
appends the compiler's estimates (parameters, memory, bubble) once the model
is traced, unless --no-model is given.
"""
from __future__ import annotations

from .ast import Plan
from ..schedules.kinds import min_microbatches
from .format import format_plan
from .layout import format_layout


def pipeline_summary(plan: Plan) -> str:
    p, m = plan.pipeline, plan.mesh
    stages = m.pp * p.virtual
    lines = [f"pipeline: {p.schedule}, {stages} stages ({m.pp} ranks x {p.virtual} virtual), "
             f"{plan.microbatches} microbatches of {plan.microbatch_size} sequences per dp rank "
             f"(>= {min_microbatches(p.schedule, m.pp)} needed); global batch "
             f"{plan.train.global_batch} = dp {m.dp} x {plan.microbatches} x {plan.microbatch_size}"]
    if plan.microbatches < m.pp:
        lines.append(f"note: {plan.microbatches} microbatches for {m.pp} pipeline ranks: no rank "
                     "waits forever (warm-ups are clamped), but most ranks idle; use >= "
                     f"{m.pp} microbatches to fill the pipeline")
    return "\n".join(lines)


def check_report(plan: Plan) -> str:
    """The resolved plan (every key, defaults included), the mesh layout and the pipeline shape."""
    return "\n".join([
        f"# {plan.path}: ok (resolved, defaults shown)",
        format_plan(plan, full=True).rstrip("\n"),
        "",
        "# before tracing",
        format_layout(plan.mesh),
        pipeline_summary(plan),
    ]) + "\n"
