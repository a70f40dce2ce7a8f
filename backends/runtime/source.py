"""What `pipeplan run` was pointed at: a plan file, or a build directory from `pipeplan compile`.

Both give the checked Plan and a `compile(plan, model, schedule=None)` function. A build
directory runs exactly what it recorded: its resolved plan is recompiled
(stage graphs need the real weights) and its `schedule.json` is pinned in
place of the generated schedule after checking that both describe the same
ranks, stages and microbatches.
"""
from __future__ import annotations

import dataclasses
import glob
import os
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from ...dsl.ast import Plan
from ...errors import PipeplanError


@dataclass(frozen=True)
class RunSource:
    plan: Plan
    compile: Callable  # (plan, model, schedule=None) -> CompiledPlan
    schedule_file: Optional[str] = None  # a build directory's pinned schedule


def compile_checked(plan: Plan, model=None, schedule=None, device=None):
    """The plan compiled as `pipeplan check` compiles it before a launch: compiled stages
    under tp or ep estimated from their rewritten joint graphs (parallel/pretrace.py)."""
    from ...compiler.driver import compile_plan
    from ..parallel.pretrace import rewrite_in_fake_world

    return compile_plan(plan, model, schedule=schedule, device=device,
                        rewrite=rewrite_in_fake_world)



def _build_plan_file(folder: str) -> str:
    for name in ("plan.plan", "resolved.plan"):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            return path
    found = sorted(glob.glob(os.path.join(folder, "*.plan")))
    if not found:
        raise PipeplanError(f"{folder}: not a build directory (no .plan file in it); "
                            "create one with `pipeplan compile PLAN -o DIR`")
    return found[0]


def read_pinned_schedule(schedule_file: str):
    """A build directory's schedule, verified (what runs is what the verifier proved)."""
    from ...schedules import schedule_from_json, verify

    try:
        with open(schedule_file, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise PipeplanError(f"cannot read {schedule_file}: {e.strerror or e}") from None
    schedule = schedule_from_json(text)
    verify(schedule)
    return schedule


def _pinned(pinned):
    def compile_pinned(plan: Plan, model, schedule=None):
        from ...compiler.schedule import ScheduleMismatch

        want = schedule or pinned  # rank 0 broadcasts the build's schedule (agreement.py)
        try:
            compiled = compile_checked(plan, model, want)
        except ScheduleMismatch as e:
            raise PipeplanError(f"the build's schedule.json does not fit the plan: {e}; "
                                "recompile the build directory") from None
        return compiled  # its stages placed as the build's schedule places them

    return compile_pinned


def load_source(path: str, overrides: Sequence[str], world_size: Optional[int]) -> RunSource:
    """What `run`/`verify` runs; the plan's checkpoint.dir and log_dir come back absolute
    (relative to the plan file, as model and data paths are)."""
    source = _load_source(path, overrides, world_size)
    return dataclasses.replace(source, plan=source.plan.with_resolved_paths())


def _load_source(path: str, overrides: Sequence[str], world_size: Optional[int]) -> RunSource:
    from ...dsl.load import load_plan

    if os.path.isdir(path):
        plan = load_plan(_build_plan_file(path), overrides, world_size)
        schedule_file = os.path.join(path, "schedule.json")
        if os.path.isfile(schedule_file):  # checked here, before any process starts
            return RunSource(plan, _pinned(read_pinned_schedule(schedule_file)), schedule_file)
        return RunSource(plan, compile_checked)
    return RunSource(load_plan(path, overrides, world_size), compile_checked)
