"""One compiled plan for every rank: rank 0 decides, every rank proves it runs the same.

`compile_shared` compiles on rank 0 of the world and broadcasts its decisions:
the split points (the stage boundaries) and the verified schedule (which also
places stages on ranks). Every other rank compiles the same plan on the meta
device with those given (`compile_plan(..., schedule=)`), so no search runs
there (`split = auto`, `schedule = auto`): searches are deterministic anyway
(bounded by counts, never by the clock), and this keeps a loaded machine from
paying for them per rank.

What each rank still recomputes, and why: the stage GraphModules (captured
from the model on meta; a GraphModule holds the model's own module objects and
user classes, which do not travel safely between processes, and capture on
meta costs no weights), the expert placement and the TP kinds (deterministic
functions of the plan and the model, no search) and the estimates. The shape and
cost propagation is not recomputed: rank 0 sends its table with the decisions
(compiler/capture/analysis.py's `Propagation`) and the others replay it, so only rank 0
runs the graph on meta tensors (and imports torch._dynamo, ~2 s).
`check_agreement` then hashes, on every rank, what it is about to run (the
plan, the schedule, each stage's boundaries, parameters, buffers and graph
code, the tied parameters, the expert placement and the TP rewrites), gathers
the hashes and stops every rank before step 1 when they differ, naming the
part that differs and which ranks hold which version (a rank started with
another plan file, another model file or another pipeplan, or a capture that
is not deterministic).
"""
from __future__ import annotations

import dataclasses
import hashlib

import torch.distributed as dist

from ...compiler.compiled import CompiledPlan
from ...dsl.ast import Plan, SplitSpec
from ...errors import PipeplanError


def compile_shared(plan: Plan, compile_fn) -> CompiledPlan:
    """`compile_fn(plan, None)` on rank 0; the others compile with rank 0's split points and
    schedule given, so no search (split or schedule) runs on them: see the module docstring
    for what each rank still recomputes and why."""
    from ...schedules import schedule_from_json, schedule_to_json

    from ...compiler.capture.analysis import Propagation

    rank = dist.get_rank()
    decided = [None]
    if rank == 0:
        with Propagation.record() as propagation:
            compiled = compile_fn(plan, None)
        decided = [(tuple(compiled.split_points), schedule_to_json(compiled.schedule),
                    propagation.table)]
    dist.broadcast_object_list(decided, src=0)
    if rank == 0:
        return compiled
    points, schedule_json, table = decided[0]
    pinned = plan
    if points:
        pinned = dataclasses.replace(plan, pipeline=dataclasses.replace(
            plan.pipeline, split=SplitSpec(kind="points", points=points)))
    with Propagation.replay(table):  # rank 0's meta run: no second one (nor torch._dynamo)
        return compile_fn(pinned, None, schedule=schedule_from_json(schedule_json))


def fingerprint(plan: Plan, compiled: CompiledPlan) -> dict[str, str]:
    """Part name -> short hash of what this rank runs."""
    from ...schedules import schedule_to_json

    parts = {
        "plan": repr(plan),
        "schedule": schedule_to_json(compiled.schedule),
        "stages": repr([(s.index, s.rank, s.inputs, s.outputs, s.param_names, s.buffer_names,
                         s.code) for s in compiled.stages]),
        "tied parameters": repr(compiled.tied),
        "expert placement": repr(compiled.experts),
        "tensor-parallel rewrites": repr(sorted(compiled.tp_rewrites.items())),
    }
    return {k: hashlib.sha256(v.encode()).hexdigest()[:12] for k, v in parts.items()}


def plan_hash(plan: Plan, compiled: CompiledPlan) -> str:
    """One hash of everything `fingerprint` covers (a checkpoint records it)."""
    parts = fingerprint(plan, compiled)
    return hashlib.sha256(repr(sorted(parts.items())).encode()).hexdigest()[:16]


def check_agreement(plan: Plan, compiled: CompiledPlan) -> None:
    """Collective over the world: raise on every rank unless all fingerprints are equal.
    When the stages differ, the first differing node of their graph code is named."""
    mine = fingerprint(plan, compiled)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    differ = [k for k in mine if len({fp[k] for fp in every}) > 1]
    if not differ:
        return
    lines = []
    for k in differ:
        versions: dict[str, list[int]] = {}
        for r, fp in enumerate(every):
            versions.setdefault(fp[k], []).append(r)
        lines.append(f"the {k} differ: " + "; ".join(
            f"{_ranks(rs)} {h}" for h, rs in versions.items()))
    if "stages" in differ:
        codes = [None] * dist.get_world_size()
        dist.all_gather_object(codes, [s.code for s in compiled.stages])
        lines.append(first_difference(codes))
    raise PipeplanError(
        "the ranks would not run one compiled plan (stopped before step 1): "
        + ", and ".join(lines)
        + "; start every rank with the same plan, model file and pipeplan version, and the "
        "same PYTHONHASHSEED (pipeplan's launcher sets it from train.seed; set it yourself "
        "under torchrun): a capture whose node order follows Python's hash seed (a loop over "
        "a set) differs between ranks otherwise")


def first_difference(codes: list) -> str:
    """Where the stage graph code of some rank first departs from rank 0's: the stage and
    the first differing line of each side (the node it defines)."""
    for r, theirs in enumerate(codes[1:], start=1):
        for i, (a, b) in enumerate(zip(codes[0], theirs)):
            if a == b:
                continue
            for x, y in zip(a.splitlines(), b.splitlines()):
                if x != y:
                    return (f"stage {i}'s graph first differs at rank 0's `{x.strip()}` "
                            f"where rank {r} has `{y.strip()}`")
            return f"stage {i}'s graph has {len(a.splitlines())} lines on rank 0, " \
                   f"{len(b.splitlines())} on rank {r}"
        if len(theirs) != len(codes[0]):
            return f"rank 0 has {len(codes[0])} stages, rank {r} {len(theirs)}"
    return "the stages' graph code is the same: they differ in parameters, buffers or boundaries"


def _ranks(rs: list[int]) -> str:
    return ("rank " if len(rs) == 1 else "ranks ") + ",".join(map(str, rs))
