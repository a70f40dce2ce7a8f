"""Tied parameters: one Parameter object used by several stages (embedding and LM head).

Each stage that uses it holds it; the runtime sums its gradient between the
holding ranks every step, so the copies stay one parameter.
"""
from __future__ import annotations

import torch

from ..compiled import StageSpec, TiedParam


def find_tied(model: torch.nn.Module, stages: list[StageSpec]) -> tuple[TiedParam, ...]:
    """Parameters held by more than one stage, with the name each stage holds it under."""
    names_of: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(name)
    tied = []
    for names in names_of.values():
        holders = []  # (name, stage): one entry per stage, the first name it uses
        for st in stages:
            used = [n for n in names if n in st.param_names]
            if used:
                holders.append((used[0], st.index))
        if len({s for _, s in holders}) >= 2:
            tied.append(TiedParam(tuple(n for n, _ in holders), tuple(s for _, s in holders)))
    return tuple(tied)
