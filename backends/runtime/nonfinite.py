"""A step whose loss or gradient norm is not finite stops before the optimizer, named.

The hot path checks once per step: the trainer reads the all-reduced loss (a
rank whose weight gradients are non-finite contributes NaN to it; each stage's
are checked once, after its last W/BW of the step -- a non-finite gradient stays
so as more are added) and, when the plan clips, the global gradient norm, and
only when one of them is NaN or infinite comes here. Every rank arrives
together (both values are the same on every rank) and reruns the step checked
(trainer._rerun_checked: same weights, batches and random state, so the same
values), its executor leaving device-side flags per action (executor.Flag: NaN
in a value sent on, a non-finite input gradient, a non-finite loss, non-finite
weight gradients); the ranks agree on the earliest flagged action in time:
where the first non-finite value appeared, naming every rank that flagged that
same action (a stage's tp, cp or dp replicas). Every rank raises the same
message, so the launcher prints it once.
"""
from __future__ import annotations

import math

import torch.distributed as dist

from ...errors import PipeplanError
from .executor import Flag, StepResult


class NonFiniteError(PipeplanError):
    """A non-finite loss or gradient; the optimizer step was not applied."""


def locate_non_finite(t: int, result: StepResult, loss: float, norm: float) -> str:
    """The message naming the step, stage, microbatch and value (collective over the world)."""
    flag = result.first_non_finite()
    mine = None if flag is None else (flag.end, dist.get_rank(), _describe(flag))
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    found = sorted(x for x in every if x is not None)
    head = (f"step {t + 1}: non-finite values (loss {_fmt(loss)}, grad_norm {_fmt(norm)}); "
            "the optimizer step was not applied")
    if not found:
        return head + ("; no action produced one, so it arose in the gradient reduction or "
                       "the norm")
    where = found[0][2]  # the replicas of a stage (tp, cp, dp) may flag the same action:
    ranks = sorted(r for _, r, w in found if w == where)  # all named, whichever ended first
    return f"{head}; the first: {where} (rank{'s' if len(ranks) > 1 else ''} " \
           f"{', '.join(map(str, ranks))})"


def _describe(flag: Flag) -> str:
    at = f"stage {flag.stage} microbatch {flag.microbatch} ({flag.label})"
    if flag.what == "the loss":
        return f"the loss of {at}"
    bad = [n for n, b in zip(flag.names, flag.bad.tolist()) if b]  # by name (checked rerun)
    if flag.what == "weight gradients":
        return f"the gradient of parameter `{bad[0]}` in {at}"
    kind = "NaN in activation" if flag.what == "activation" else "non-finite input gradient"
    name, _, origin = bad[0].partition(" ")  # executor.value_origin: "add_2 (in module `x`)"
    return f"{kind} `{name}`{' ' + origin if origin else ''} produced by {at}"


def _fmt(x: float) -> str:
    return f"{x:.6g}" if math.isfinite(x) else str(x)
