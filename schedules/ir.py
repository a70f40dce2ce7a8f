"""The schedule IR: one ordered list of actions per rank, exactly what the runtime executes.

Stages are numbered in model order (stage s+1 consumes stage s's output).
Communication is implied: an action whose input is produced on another rank
receives it (blocking) right before it runs; an action whose output is needed on
another rank sends it (non-blocking) right after.
"""
from __future__ import annotations

import gc
from contextlib import contextmanager
from dataclasses import dataclass
from typing import NamedTuple

F, B, W, BW = "F", "B", "W", "BW"
OPS = (F, B, W, BW)
CACHE_ATTR = "_execution"  # where execution.analyze keeps its proof on a Schedule (not a field)


class Action(NamedTuple):
    """One op of one stage on one microbatch.

    F: forward. B: backward for the stage's inputs only. W: backward for its
    weights (needs B). BW: full backward (B and W at once).

    A named tuple (immutable, hashable, compared by value like the frozen dataclass it
    replaced): built in C, half the cost, and its fields read as columns (`zip(*row)`),
    which the verifier's fast structure pass uses. A schedule at p=64, m=1024 has ~4e5.
    """

    op: str
    stage: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.op}{self.stage}.{self.microbatch}"

    def describe(self) -> str:
        return f"{self.op}(stage {self.stage}, mb {self.microbatch})"


@dataclass(frozen=True)
class Schedule:
    """A stage→rank placement plus one ordered action list per rank."""

    name: str
    ranks: int
    stages: int
    microbatches: int
    stage_to_rank: tuple[int, ...]
    order: tuple[tuple[Action, ...], ...]

    def __getstate__(self):
        """Pickle only the fields (the cached analysis is rebuilt on demand)."""
        return {k: v for k, v in self.__dict__.items() if not k.startswith(CACHE_ATTR)}

    def __setstate__(self, state):
        self.__dict__.update(state)

    @property
    def num_actions(self) -> int:
        return sum(len(o) for o in self.order)

    def stages_of_rank(self, rank: int) -> tuple[int, ...]:
        return tuple(s for s, r in enumerate(self.stage_to_rank) if r == rank)

    def stages_per_rank(self) -> tuple[int, ...]:
        """How many stages each rank holds (the v in 'a stage's op costs T/v')."""
        counts = [0] * self.ranks
        for r in self.stage_to_rank:
            if 0 <= r < self.ranks:
                counts[r] += 1
        return tuple(counts)

    def splits_backward(self) -> bool:
        """True when any backward is split into B and W."""
        return any(a.op == W for o in self.order for a in o)


def loop_placement(ranks: int, virtual: int) -> tuple[int, ...]:
    """Stage s on rank s % ranks (GPipe, 1F1B, interleaved: v laps around the ranks)."""
    return tuple(s % ranks for s in range(ranks * virtual))


def v_placement(ranks: int) -> tuple[int, ...]:
    """Two stages per rank in a V: rank r holds stages r and 2p-1-r (ZB-V, V-Half, DualPipeV).

    The last rank holds the two middle stages, so the turn of the V is a hand-over in memory.
    """
    return tuple(range(ranks)) + tuple(reversed(range(ranks)))


@contextmanager
def bulk():
    """Pause the cyclic garbage collector while a schedule's actions are built, verified or
    timed. They are hundreds of thousands of small acyclic objects; with the collector on,
    each older-generation pass rescans every object the process holds (all of torch's once it
    is imported), which cost more than the generation itself at p=64, m=1024. Reference
    counting still frees everything; the collector is restored as it was."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
