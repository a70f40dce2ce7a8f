"""The registry of semantic checks: `@check(keys...)` registers a pure function
`Plan -> problems` with the dotted keys it reads (checks.py runs them)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Optional

from .ast import Plan


@dataclass(frozen=True)
class Problem:
    key: str  # the dotted key the error points at
    message: str
    hint: Optional[str] = None


@dataclass(frozen=True)
class Check:
    reads: tuple[str, ...]  # dotted keys (or key prefixes) the check depends on
    run: Callable[[Plan], Iterable[Problem]]


CHECKS: list[Check] = []


def check(*reads: str):
    """Register a check that reads the given dotted keys."""
    def register(fn: Callable[[Plan], Iterable[Problem]]):
        CHECKS.append(Check(reads, fn))
        return fn
    return register


def where(plan: Plan, *keys: str) -> str:
    """The first of `keys` written in the plan (errors point at what the user wrote)."""
    return next((k for k in keys if k in plan.spans), keys[-1])


