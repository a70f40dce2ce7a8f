"""Compiled stages (`compile { mode = graphs | inductor }`): each stage's joint forward +
backward graph (joint.py), partitioned into F, B, W and BW (split.py); `check_joint_graphs`
is the compile phase that traces them, refusing at the `compile.mode` line what cannot be."""
from __future__ import annotations

import contextlib
from typing import Callable, Optional, Sequence

import torch.fx as fx

from ...dsl.ast import Plan
from ...dsl.errors import PlanError
from ..compiled import BATCH, StageSpec
from .joint import TRACE_DEVICE, JointTraceError, trace_joint, traced_collectives
from .split import saved_bytes, split_joint


def check_joint_graphs(plan: Plan, stages: Sequence[StageSpec], graph: fx.Graph,
                       values: dict, experts: tuple = (), tp_kinds: Optional[dict] = None,
                       rewrite: Optional[Callable] = None) -> None:
    """compile.mode = graphs | inductor: every stage traced jointly (forward + backward) on
    fake CPU tensors of its parameters and per-microbatch inputs (`values`: the capture's
    meta value of each node of `graph`); one that cannot be is refused at the
    `compile.mode` line with the op named. The traced graphs are kept on the stage
    (`StageSpec.joint`), so a CPU runtime on these stage objects need not trace again
    (another device traces its own: kernels differ), and the stage's activation bytes
    per microbatch are the bytes F saves for B and W (split.py: saved_bytes; under the
    plan's recompute rules, what their regions leave unsaved is not counted). Call
    after the per-node costs are attached (this replaces their saved-bytes sum).
    Under cp, tp or ep the runtime rewrites the stages (ring / Ulysses attention, DTensor
    nodes, the static expert dispatch) and traces the rewritten stage itself, with its
    process groups: the trace here checks the model's code, and `rewrite`
    (backends/parallel/pretrace.py, handed in by the commands that compile before a
    launch: the compiler does not import the runtime) rewrites each stage as a rank's
    runtime will, in a world of fake process groups, so the activation bytes are those of
    the rewritten stage's own joint graph (the most any cp rank keeps). Without `rewrite`
    the activation estimate stays the eager one. The rewritten stage's collectives per
    microbatch, DTensor's own (joint.traced_collectives), are kept on the stage
    (`StageSpec.traced_collectives`, cp rank 0's) beside the estimate's."""
    if not plan.compile.graphs:
        return
    rewritten = plan.mesh.tp > 1 or plan.mesh.ep > 1 or plan.mesh.cp > 1
    rules = tuple(r for r in plan.recompute if r.mode != "none")
    by_name = {n.target if n.op == "placeholder" else n.name: values.get(n)
               for n in graph.nodes}
    for st in stages:
        inputs = [by_name[r.name] for r in st.inputs]
        needs = [r.source != BATCH and r.requires_grad for r in st.inputs]  # as the runtime's
        try:
            joint = trace_joint(st.module, inputs, needs, on=TRACE_DEVICE, recompute=rules)
        except JointTraceError as e:
            raise PlanError.at(plan, "compile.mode", f"stage {st.index} cannot run as compiled "
                               f"graphs: {e}", "use compile { mode = eager }") from None
        if not rewritten:
            st.joint = joint
            # exact by construction: what F hands to B and W is what the runtime keeps
            st.activation_bytes = saved_bytes(split_joint(joint))
    if rewritten and rewrite is not None:
        kept, traced = _rewritten(plan, stages, by_name, rules, experts, tp_kinds or {},
                                  rewrite)
        for st in stages:  # none inside a running world: its ranks trace their own
            st.activation_bytes = kept.get(st.index, st.activation_bytes)
            st.traced_collectives = traced.get(st.index)


def _rewritten(plan: Plan, stages: Sequence[StageSpec], by_name: dict, rules: tuple,
               experts: tuple, tp_kinds: dict, rewrite: Callable) -> tuple[dict, dict]:
    """Stage index -> the most bytes F of its rewritten copy hands to B and W, over the
    ranks `rewrite` stands up one after another (each yields every stage's rewritten copy,
    valid until the next is asked for); stage index -> the first rank's collectives."""
    kept: dict[int, int] = {}
    traced: dict[int, dict] = {}
    with contextlib.closing(rewrite(plan, experts, tp_kinds, stages)) as worlds:
        for modules in worlds:
            for st in stages:
                try:
                    joint = trace_joint(modules[st.index],
                                        [by_name[r.name] for r in st.inputs],
                                        [r.source != BATCH and r.requires_grad
                                         for r in st.inputs], on=TRACE_DEVICE, recompute=rules)
                except JointTraceError as e:
                    raise PlanError.at(plan, "compile.mode", f"stage {st.index} cannot run as "
                                       "compiled graphs as its ranks rewrite it (cp, tp or "
                                       f"ep): {e}", "use compile { mode = eager }") from None
                kept[st.index] = max(kept.get(st.index, 0), saved_bytes(split_joint(joint)))
                traced.setdefault(st.index, traced_collectives(joint))
    return kept, traced
