"""What `pipeplan check` prints: the resolved plan and what is known before tracing.

`check_report(plan)` is the one place to extend: the compiler adds its
estimates (parameters, memory, bubble) here once the model is known.
"""
from __future__ import annotations

from .ast import Plan
from .checks import SCHEDULE_RULES
from .format import format_plan
from .layout import format_layout


def pipeline_summary(plan: Plan) -> str:
    p, m = plan.pipeline, plan.mesh
    stages = m.pp * p.virtual
    rule = SCHEDULE_RULES[p.schedule]
    need = f"; {p.schedule} needs >= {rule.min_microbatches(m.pp) if m.pp > 1 else 1}"
    return (f"pipeline: {p.schedule}, {stages} stages ({m.pp} ranks x {p.virtual} virtual), "
            f"{plan.microbatches} microbatches of {plan.microbatch_size} sequences per dp rank"
            f"{need}; global batch {plan.train.global_batch} = dp {m.dp} x "
            f"{plan.microbatches} x {plan.microbatch_size}")


def check_report(plan: Plan) -> str:
    """The resolved plan (every key, defaults included), the mesh layout and the pipeline shape."""
    return "\n".join([
        f"# {plan.path}: ok (resolved, defaults shown)",
        format_plan(plan, full=True).rstrip("\n"),
        "",
        "# before tracing",
        format_layout(plan.mesh),
        pipeline_summary(plan),
        "(per-stage parameters, memory and bubble need the model: pipeplan compile)",
    ]) + "\n"
