"""Checks of the train section's evaluation and trackers (registered in dsl/rules.py's table).

`train.eval` reads held-out documents, so the data must hold some (`data =
text(..., holdout = ...)`); a tracker other than jsonl writes into
`train.log_dir` and needs its package installed (the extra named in the hint).
"""
from __future__ import annotations

import importlib.util
from typing import Iterator

from .ast import Plan
from .rules import Problem, check
from .schema_train import TRACKERS


@check("train.eval", "data", "sync")
def _eval(plan: Plan) -> Iterator[Problem]:
    spec, d = plan.train.eval, plan.data
    if spec is None:
        return
    if d.kind != "text" or d.holdout <= 0:
        yield Problem("train.eval", "eval reads held-out documents, and the data holds none",
                      "hold some out: data = text(files = [...], tokenizer = \"...\", "
                      "holdout = 0.05)")
    if plan.sync.diloco:
        yield Problem("train.eval", "eval under diloco: each island holds its own weights "
                      "between syncs, so there is no one model to evaluate",
                      "remove eval, or use sync = every_step")
    if spec.every > plan.train.steps:
        yield Problem("train.eval.every", f"eval every {spec.every} steps, but training runs "
                      f"{plan.train.steps}: none would run", f"use every <= {plan.train.steps}")


@check("train.log", "train.log_dir")
def _trackers(plan: Plan) -> Iterator[Problem]:
    for i, name in enumerate(plan.train.log):
        module, extra = TRACKERS[name]
        if module is None:
            continue
        if not plan.train.log_dir:
            yield Problem(f"train.log.{i}", f"{name} writes into train.log_dir, which is not set",
                          'set train { log_dir = "runs/NAME" }')
        elif importlib.util.find_spec(module) is None:
            yield Problem(f"train.log.{i}", f"logging to {name} needs the {module} package, "
                          "which is not installed", f"pip install 'pipeplan[{extra}]'")
