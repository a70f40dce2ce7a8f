"""`pipeplan profile`: a run's measured op times written as a cost file (compiler/estimate/profile.py).

Rank 0 gathers every rank's action timings (as for the bubble line), drops the
warm-up steps and averages, per stage, the F, B, W and BW times of the
pipeline at dp 0, tp 0 -- each action's slot (executor.ActionTiming): its compute
plus the runtime's work around it (posting sends and the next receive, checks),
a real cost per action the simulator then charges (and, per stage, the same slots'
CPU seconds on the rank's thread, `cpu`); the p2p latency is the mean measured one
(observe.measured_latency); activation bytes are what each stage sends forward
per microbatch (its outputs as the compiled plan sizes them). Each measured
step is also kept action by action (`steps`: every microbatch's slot and the
step's own p2p latency), which the compiler replays for its prediction.
"""
from __future__ import annotations

import hashlib
import os
import platform
from statistics import mean
from typing import Sequence

import torch

from ...compiler.estimate.profile import OPS, Profile, StageProfile, workload
from .timings import RankTimings, measured_latency, step_sample


def describe_device() -> str:
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    return (f"cpu: {platform.machine()} {platform.processor() or ''}".rstrip()
            + f", {torch.get_num_threads()} threads per rank, torch {torch.__version__}")


def profile_of(plan, schedule, split_points: Sequence[str], specs, ranks: Sequence[RankTimings],
               warmup: int) -> Profile:
    pipeline = sorted((r for r in ranks if r.dp == 0 and r.tp == 0), key=lambda r: r.pp)
    n = len(pipeline[0].steps)
    keep = range(min(warmup, n - 1), n)  # at least one measured step
    samples: dict[tuple[str, int], list[float]] = {}
    cpu: dict[tuple[str, int], list[float]] = {}
    for r in pipeline:
        for k in keep:
            for a in r.steps[k]:
                samples.setdefault((a.op, a.stage), []).append(a.slot)
                if a.cpu >= 0:
                    cpu.setdefault((a.op, a.stage), []).append(a.cpu)
    steady = [RankTimings(r.rank, r.pp, r.dp, r.tp, tuple(r.steps[k] for k in keep))
              for r in pipeline]
    stages = []
    for s in range(schedule.stages):
        ops = {op: mean(samples[(op, s)]) if (op, s) in samples else None for op in OPS}
        sent = _sent_bytes(specs[s]) if s + 1 < schedule.stages else 0  # the last sends none
        thread = {op: mean(cpu[(op, s)]) if (op, s) in cpu else None for op in OPS}
        stages.append(StageProfile(s, ops["F"] or 0.0, ops["B"], ops["W"], ops["BW"],
                                   len(samples.get(("F", s), ())), sent,
                                   thread if thread["F"] is not None else None))
    first = pipeline[0].first_step
    steps = tuple(step_sample(first + k + 1, schedule, pipeline, k) for k in keep)
    return Profile(hashlib.sha256(plan.source_text.encode()).hexdigest(), describe_device(),
                   schedule.name, tuple(split_points), tuple(stages),
                   measured_latency(steady, schedule), keep.start,
                   tuple(first + k + 1 for k in keep), workload(plan), steps=steps)


def _sent_bytes(spec) -> int:
    from ...compiler.estimate.estimates import _bytes  # a ValueSpec's bytes, as the estimates count them

    return sum(_bytes(v) for v in spec.outputs)


def write_profile(path: str, profile: Profile) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(profile.to_json())
    os.replace(tmp, path)
