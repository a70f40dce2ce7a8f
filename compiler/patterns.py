"""Module-path patterns as the plan language defines them: `*` matches within one segment.

`layers.*.mlp` matches `layers.3.mlp`, not `layers.3.block.mlp`.
"""
from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Iterable, Optional


def matches(name: str, pattern: str) -> bool:
    parts, pats = name.split("."), pattern.split(".")
    return len(parts) == len(pats) and all(fnmatchcase(a, p) for a, p in zip(parts, pats))


def matches_any(name: str, patterns: Iterable[str]) -> bool:
    return any(matches(name, p) for p in patterns)


def outermost_match(path: Optional[str], pattern: str) -> Optional[str]:
    """The outermost module on `path` (itself or an ancestor) matching `pattern`."""
    if not path:
        return None
    parts = path.split(".")
    for i in range(1, len(parts) + 1):
        prefix = ".".join(parts[:i])
        if matches(prefix, pattern):
            return prefix
    return None
