"""Semantic checks of what each step feeds the model, and of the plan's sizes together.

Registered into dsl/checks.py's table like every other check: each model input
reads one data field of the right shape and dtype (the fields are made in
backends/runtime/data.py), and the products of bounded sizes stay bounded (dsl/limits.py).
"""
from __future__ import annotations

from typing import Iterator

from .ast import Plan
from .rules import Problem, check, where
from .limits import MAX_RANKS, MAX_SCHEDULE_SLOTS, MAX_STEP_TOKENS

INTEGER_DTYPES = ("int64", "int32")  # wide enough for a token id or a position
_FIELD_DTYPES = {"tokens": INTEGER_DTYPES, "positions": INTEGER_DTYPES,
                 "document_positions": INTEGER_DTYPES, "targets": INTEGER_DTYPES}


@check("data.inputs", "model.inputs", "model.loss")
def _data_inputs(plan: Plan) -> Iterator[Problem]:
    """Each model input reads one data field: [batch, seq], except `mask` (ones of the
    input's declared shape and dtype); see backends/runtime/data.py."""
    names = [i.name for i in plan.model.inputs]
    for name, _ in plan.data.inputs:
        if name not in names:
            yield Problem(f"data.inputs.{name}", f"data feeds '{name}', which is not among "
                          f"model.inputs ({', '.join(names)})",
                          "name a model input, or add it to model.inputs")
    feeds = dict(plan.data.feeds(names))
    for spec in plan.model.inputs:
        key = where(plan, f"model.inputs.{spec.name}", "model.inputs")
        source = feeds[spec.name]
        if source is None:
            yield Problem(key, f"model input '{spec.name}' has no data field to read",
                          f"only the first input reads the token stream by default; add "
                          f"inputs = {{ {spec.name} = positions }} (or tokens, mask, targets) "
                          "to data")
            continue
        if source != "mask" and tuple(spec.shape) != ("batch", "seq"):
            yield Problem(key, f"model input '{spec.name}' reads the data field '{source}', "
                          f"which is [batch, seq], but is declared {spec.dtype}"
                          f"[{', '.join(map(str, spec.shape))}]",
                          f"declare it {spec.dtype}[batch, seq]")
        allowed = _FIELD_DTYPES.get(source)
        if allowed and spec.dtype not in allowed:
            yield Problem(key, f"model input '{spec.name}' reads {source} (integers) but is "
                          f"declared {spec.dtype}", f"declare it {allowed[0]}[batch, seq]")
        if source == "document_positions":
            yield from _document_positions(plan, spec.name)
        if spec.name == "targets" and plan.model.loss != "model":
            yield Problem(key, "a model input may not be named 'targets' with a "
                          f"{plan.model.loss} loss: the loss reads the batch field 'targets'",
                          "rename the input, or use loss = model")


def _document_positions(plan: Plan, name: str) -> Iterator[Problem]:
    """Positions that restart after each end-of-document token need to know that token (text
    data) and whole rows (no context-parallel column slices)."""
    key = where(plan, f"data.inputs.{name}", "data")
    if plan.data.kind != "text":
        yield Problem(key, f"'{name}' reads document_positions, which restart after each "
                      "end-of-document token: only data = text(...) knows where documents end",
                      "use positions, or data = text(...)")
    if plan.mesh.cp > 1:
        yield Problem(where(plan, "mesh.cp", "mesh"), f"'{name}' reads document_positions, "
                      "which a context-parallel rank's slice of a row cannot compute (a "
                      "document may start in another rank's columns)",
                      "use positions with context parallel, or mesh.cp = 1")


# -- sizes (each value is bounded by the schema; these bound the products)
@check("mesh", "pipeline", "train.global_batch", "data.seq_len")
def _sizes(plan: Plan) -> Iterator[Problem]:
    m, p = plan.mesh, plan.pipeline
    if m.world_size > MAX_RANKS:
        yield Problem("mesh", f"pp * dp * cp * tp = {m.world_size:,} ranks is above {MAX_RANKS:,}",
                      _BOUNDED)
    slots = m.pp * p.virtual * plan.microbatches
    if slots > MAX_SCHEDULE_SLOTS:
        yield Problem(where(plan, "pipeline.microbatches", "pipeline.microbatch_size",
                            "pipeline"),
                      f"a step's schedule would hold pp * virtual * microbatches = "
                      f"{m.pp} * {p.virtual} * {plan.microbatches} = {slots:,} forwards, above "
                      f"{MAX_SCHEDULE_SLOTS:,}", _BOUNDED)
    tokens = plan.train.global_batch * (plan.data.seq_len + 1)
    if tokens > MAX_STEP_TOKENS:
        yield Problem(where(plan, "train.global_batch", "data.seq_len"),
                      f"a step reads global_batch * (seq_len + 1) = {tokens:,} tokens, above "
                      f"{MAX_STEP_TOKENS:,}", _BOUNDED)


_BOUNDED = "pipeplan bounds every size in a plan before it allocates anything"
