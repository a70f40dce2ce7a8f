"""`pipeline { costs = [[F, B, W], ...] }`: relative op costs per stage, read and checked.

One [F, B, W] triple per pipeline stage (pp x virtual of them, in model order), in any
unit: only their ratios matter. They replace the compiler's estimated ratios for the
schedule (auto orders ops and picks the placement for them) and for the time estimate
(scaled to the estimated total work, see compiler/schedule.py). E.g. an embedding-heavy
first stage and an LM-head-heavy last stage on pp = 4:
    costs = [[2, 2, 2], [1, 1, 1], [1, 1, 1], [2, 2, 2]]
"""
from __future__ import annotations

import math
from typing import Iterator

from .ast import Plan
from .checks import Problem, check
from .syntax import Float, Int, Items, Node
from .values import Invalid, shown, write_float

HINT = "one [F, B, W] per stage, non-negative numbers, e.g. costs = [[2, 2, 1], [1, 1, 1]]"


def read_costs(node: Node, key: str) -> tuple[tuple[float, float, float], ...]:
    if not isinstance(node, Items) or not node.items:
        raise Invalid(f"{key} must be a list of [F, B, W] per stage, {shown(node)}", HINT)
    out = []
    for s, item in enumerate(node.items):
        if not isinstance(item, Items) or len(item.items) != 3:
            raise Invalid(f"{key}: stage {s} must be [F, B, W] (three numbers), {shown(item)}",
                          HINT, item.span)
        triple = []
        for x in item.items:
            if not isinstance(x, (Int, Float)) or not math.isfinite(float(x.value)):
                raise Invalid(f"{key}: stage {s}'s costs must be numbers, {shown(x)}", HINT, x.span)
            if x.value < 0:
                raise Invalid(f"{key}: stage {s} has a negative cost {x.value!r}", HINT, x.span)
            triple.append(float(x.value))
        if sum(triple) == 0:
            raise Invalid(f"{key}: stage {s} costs nothing ([0, 0, 0])",
                          "every stage runs some work; give its relative F, B, W", item.span)
        out.append(tuple(triple))
    return tuple(out)


def write_costs(costs: tuple[tuple[float, float, float], ...]) -> str:
    return "[" + ", ".join("[" + ", ".join(_num(x) for x in t) + "]" for t in costs) + "]"


def _num(x: float) -> str:
    return str(int(x)) if x.is_integer() else write_float(x)


@check("pipeline.costs", "pipeline.profile")
def _not_with_a_profile(plan: Plan) -> Iterator[Problem]:
    if plan.pipeline.costs is not None and plan.pipeline.profile is not None:
        yield Problem("pipeline.costs", "set pipeline.costs or pipeline.profile, not both",
                      "a profile's measured costs already give each stage's F, B, W")


@check("mesh.pp", "pipeline.virtual", "pipeline.costs")
def _one_triple_per_stage(plan: Plan) -> Iterator[Problem]:
    p = plan.pipeline
    if p.costs is not None and len(p.costs) != plan.mesh.pp * p.virtual:
        yield Problem("pipeline.costs",
                      f"pipeline.costs lists {len(p.costs)} stages but the pipeline has "
                      f"{plan.mesh.pp * p.virtual} (pp = {plan.mesh.pp} x virtual = {p.virtual})",
                      "give one [F, B, W] per stage, in model order")
