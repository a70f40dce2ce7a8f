"""The collectives tensor and expert parallelism imply, from the graph's traffic.

A pure function of the traffic roles `compiler/estimate/traffic.py` reads off the
captured graph: each role becomes the calls `backends/parallel/tp/rewrite.py` (and
backends/parallel/ep/experts.py) issue, one entry per call, forward and backward:

* tp: a row output or vocab embedding (all-reduce; sequence parallel:
  reduce-scatter forward, all-gather backward), a column entry (all-reduce of
  the input gradient; SP: all-gather forward, reduce-scatter backward), a value
  received whose gradient is partial (all-reduce), loss_parallel (3
  all-reduces), gathered logits, and under SP the stage edges' all-gathers and
  the once-per-step sum of partial gradients;
* ep: per experts call and microbatch, the per-expert counts (int64) and 4
  all-to-alls of top_k copies of each token (dispatch, combine, their
  backwards; exact for the EP group's mean when dropless), 2 of the top-k
  weights; under EP across TP (dsl/layout.py) each TP rank dispatches 1/tp of
  the rows and tp all-gathers the output rows and the gradients of the rows and
  weights; under `experts.balance = step` the routing pre-pass's forward ones
  once more (counts, rows out and back, weights out). Compiled stages
  (`compile.mode = graphs | inductor`) dispatch statically: every slot to every EP
  rank, no counts; 4 all-to-alls of ep x top_k copies of each token, 2 of ep
  copies of the top-k weights, 1 of ep copies of the top-k indices (int64).

`implied_collectives` gives {(group, op): (calls, bytes handed in)} per step;
estimates.py sums it per rank and per stage, and `tp_bytes` / `ep_bytes` are
the bytes sent per microbatch for the time model.
"""
from __future__ import annotations

from ...dsl.ast import Plan
from ...dsl.layout import ep_across_tp
from ..compiled import StageSpec
from ..parallel.ep import experts_dispatched
from .traffic import Traffic


def ring_bytes(op: str, nbytes: float, n: int) -> float:
    """Bytes one rank sends through a ring for a collective it hands `nbytes`."""
    if n <= 1:
        return 0.0
    return {"allreduce": 2 * (n - 1) / n, "reduce_scatter": (n - 1) / n,
            "allgather": n - 1, "alltoall": (n - 1) / n}[op] * nbytes


def ring_steps(op: str, n: int) -> int:
    """Messages one rank waits for in a ring collective over n ranks (a latency each):
    all-reduce 2(n - 1) (reduce-scatter, then all-gather), the others n - 1."""
    if n <= 1:
        return 0
    return 2 * (n - 1) if op == "allreduce" else n - 1


def implied_collectives(plan: Plan, tp_traffic: list[Traffic], moe_traffic: list[Traffic],
                        idx: set[int], partial_grads: tuple[int, int] = (0, 0)
                        ) -> dict[tuple[str, str], tuple[int, int]]:
    """The TP and EP collectives of stages `idx` on one of their ranks per step:
    {(group, op): (calls, bytes handed in)}. `partial_grads`: (how many, bytes) of the
    replicated gradients summed over tp once per step under sequence parallel."""
    m, tp, ep = plan.microbatches, plan.mesh.tp, plan.mesh.ep
    sp = plan.tensor.sequence_parallel and tp > 1
    float_scale = 0.5 if plan.train.precision == "bf16" else 1.0
    out: dict[tuple[str, str], tuple[int, int]] = {}

    def add(key, calls, nbytes):
        c, b = out.get(key, (0, 0))
        out[key] = (c + int(calls), b + int(nbytes))

    if tp > 1:
        per_mb = _tp_microbatch(plan, tp_traffic, idx, float_scale)
        if sp:
            for op, nbytes in _sequence_boundaries(plan, tp_traffic, idx, float_scale):
                per_mb.append((op, nbytes, ""))
            # Replicated parameters (and experts) saw only this rank's positions: their
            # gradients are summed over tp once per step, one all-reduce each.
            add(("tp", "allreduce"), *partial_grads)
        for op, nbytes, _ in per_mb:
            add(("tp", op), m, m * nbytes)
    ex = plan.experts
    if ex is None or not experts_dispatched(plan):
        return out
    # EP across TP: each TP rank dispatches its 1/tp share of the rows, then the tp group
    # all-gathers the output rows (forward) and the rows' and weights' gradients (backward)
    share = tp if ep_across_tp(plan.mesh) else 1
    prepass = ex.balance == "step"  # the routing pre-pass's forwards (balance.py) once more
    for t in (t for t in moe_traffic if t.stage in idx and ep > 1):
        nbytes = t.nbytes * float_scale / share
        calls = ep_calls(plan, t.role)
        if plan.compile.graphs:  # the static dispatch (backends/parallel/ep/experts.py)
            if t.role == "tokens":
                add(("ep", "alltoall"), calls * m, m * 4 * ep * ex.top_k * nbytes)
            else:  # weights out and back; the indices, int64 (traffic counts 4-byte floats)
                add(("ep", "alltoall"), calls * m, m * ep * (2 * nbytes + 2 * t.nbytes))
            continue
        if t.role == "tokens":  # counts, then rows out and back, forward and backward
            add(("ep", "alltoall"), calls * m,
                m * (8 * ex.num_experts + 4 * ex.top_k * nbytes))
            if prepass:  # counts, rows out and back
                add(("ep", "alltoall"), 0, m * (8 * ex.num_experts + 2 * ex.top_k * nbytes))
        else:  # the top-k weights out, and their gradient back
            add(("ep", "alltoall"), calls * m, m * 2 * nbytes)
            if prepass:
                add(("ep", "alltoall"), 0, m * nbytes)
        if share > 1:
            calls = 2 if t.role == "tokens" else 1
            add(("tp", "allgather"), calls * m, m * calls * nbytes)
    return out


def ep_calls(plan: Plan, role: str, prepass: bool = True) -> int:
    """All-to-alls one rank makes per microbatch for one experts call's traffic item
    (traffic.py role "tokens": the rows; "weights": the top-k weights), forward and
    backward, as backends/parallel/ep/experts.py runs them; the routing pre-pass's
    (`experts.balance = step`, balance.py) included. Static dispatch (compiled stages):
    rows, weights, indices and the combine forward, their gradients' three back; eager:
    the counts, rows out and back (and the rows' gradients both ways and the combine's),
    the weights out and their gradient back. `prepass`: count the pre-pass's."""
    if plan.compile.graphs:
        return 4 if role == "tokens" else 3
    prepass = prepass and plan.experts.balance == "step"
    return (5 + 3 * prepass) if role == "tokens" else (2 + prepass)


def _role_collectives(role: str, nbytes: int, tp: int, sp: bool) -> list[tuple[str, int, str]]:
    """(collective, bytes each rank hands in, "F" or "B": the pass it runs in) for one traffic
    role (traffic.py), as backends/parallel/tp/rewrite.py places them, forward and
    backward."""
    if role == "output":  # row-parallel / vocab embedding: the partial sum made whole
        return [("reduce_scatter", nbytes, "F"), ("allgather", nbytes // tp, "B")] if sp \
            else [("allreduce", nbytes, "F")]
    if role in ("whole_input", "partial_input"):  # grads all-reduced (see traffic.py)
        return [("allreduce", nbytes, "B")]
    if role == "input":  # column-parallel entry: its input's gradient summed
        return [("allgather", nbytes // tp, "F"), ("reduce_scatter", nbytes, "B")] if sp \
            else [("allreduce", nbytes, "B")]
    if role == "partial_param":  # a replicated weight on split heads: its grad summed
        return [] if sp else [("allreduce", nbytes, "B")]  # (sp: once per step, as others)
    if role == "counted_loss":  # the summed loss of sequence shards, leaving its stage
        return [("allreduce", nbytes, "F")] if sp else []
    if role == "loss":  # loss_parallel: the max, the sum of exponentials, the target logit
        return [("allreduce", nbytes // 3, "F")] * 3
    if role == "logits":
        return [("allgather", nbytes // tp, "F")]
    return []


def _tp_microbatch(plan: Plan, traffic: list[Traffic], idx: set[int],
                   float_scale: float) -> list[tuple[str, int, str]]:
    """TP collectives of the layers of stages `idx`, per microbatch: one (op, bytes handed
    in, pass) per call."""
    tp, sp = plan.mesh.tp, plan.tensor.sequence_parallel
    return [c for t in traffic if t.stage in idx
            for c in _role_collectives(t.role, int(t.nbytes * float_scale), tp, sp)]


def _sequence_boundaries(plan: Plan, traffic: list[Traffic], idx: set[int],
                         float_scale: float) -> list[tuple[str, int]]:
    """Sequence parallel at the edges of stages `idx`, per microbatch, one (op, bytes) per
    call: received values meeting sequence shards are split on entry (their grads
    all-gathered in backward), sent sequence shards are all-gathered on exit, so stages
    exchange full tensors (traffic.py's "seq_input" / "seq_output")."""
    tp = plan.mesh.tp
    return [("allgather", int(t.nbytes * float_scale) // tp) for t in traffic
            if t.stage in idx and t.role in ("seq_input", "seq_output")]


def tp_bytes(plan: Plan, traffic: list[Traffic], stages: list[StageSpec],
              float_scale: float) -> float:
    """Bytes a rank sends through the TP collectives of `stages`' layers, per microbatch."""
    per_mb = _tp_microbatch(plan, traffic, {st.index for st in stages}, float_scale)
    return sum(ring_bytes(op, nbytes, plan.mesh.tp) for op, nbytes, _ in per_mb)


def ep_bytes(plan: Plan, traffic: list[Traffic], stages: list[StageSpec],
              float_scale: float) -> float:
    """Dispatch + combine of top_k copies of each token (and its weights), forward and
    backward."""
    ex, ep = plan.experts, plan.mesh.ep
    if ex is None or ep <= 1:
        return 0.0
    idx = {st.index for st in stages}
    tokens = sum(t.nbytes for t in traffic if t.stage in idx and t.role == "tokens")
    weights = sum(t.nbytes for t in traffic if t.stage in idx and t.role == "weights")
    share = plan.mesh.tp if ep_across_tp(plan.mesh) else 1  # EP across TP: 1/tp of the rows
    if plan.compile.graphs:  # the static dispatch: ep copies, and the int64 indices
        return ((4 * ex.top_k * tokens + 2 * weights) * float_scale + 2 * weights) * (ep - 1)
    return (4 * ex.top_k * tokens + 2 * weights) * float_scale * (ep - 1) / ep / share
