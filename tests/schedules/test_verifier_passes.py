"""The verifier's fast passes against the per-action passes they shortcut (execution.py).

A bulk pass must accept exactly the schedules its per-action pass accepts, with the same
result; where it declines, the per-action pass names the fault (the messages are pinned by
test_verifier.py). Checked on valid schedules and on random mutations that break them."""
import random

import pytest

from pipeplan.schedules import Action, Schedule, ScheduleError, generate
from pipeplan.schedules.execution import _structure_bulk, _structure_each

BASES = [generate(k, p, m) for k, p, m in (("1f1b", 3, 4), ("zbh1", 3, 5), ("zbv", 3, 6),
                                            ("interleaved", 2, 4), ("gpipe", 1, 3))]


def _mutate(base: Schedule, rng: random.Random) -> Schedule:
    order = [list(row) for row in base.order]
    for _ in range(rng.choice((0, 1, 1, 2))):
        r = rng.randrange(len(order))
        if not order[r]:
            continue
        i = rng.randrange(len(order[r]))
        a = order[r][i]
        kind = rng.choice(["swap", "move", "drop", "dup", "retag", "restage", "odd"])
        if kind == "swap":
            j = rng.randrange(len(order[r]))
            order[r][i], order[r][j] = order[r][j], order[r][i]
        elif kind == "move":
            order[rng.randrange(len(order))].insert(0, order[r].pop(i))
        elif kind == "drop":
            order[r].pop(i)
        elif kind == "dup":
            order[r].insert(rng.randrange(len(order[r]) + 1), a)
        elif kind == "retag":
            order[r][i] = Action(rng.choice(["F", "B", "W", "BW", "X"]), a.stage,
                                 rng.randrange(-1, base.microbatches + 1))
        elif kind == "restage":
            order[r][i] = Action(a.op, rng.randrange(-1, base.stages + 1), a.microbatch)
        else:
            order[r][i] = rng.choice([tuple(a), Action(a.op, float(a.stage), a.microbatch),
                                      Action(a.op, a.stage, True), Action(a.op, a.stage, str(a.microbatch)),
                                      Action(None, a.stage, a.microbatch), "F0.0"])
    return Schedule("mutant", base.ranks, base.stages, base.microbatches, base.stage_to_rank,
                    tuple(tuple(row) for row in order))


@pytest.mark.parametrize("seed", range(6))
def test_structure_bulk_pass_agrees_with_per_action_pass(seed):
    rng = random.Random(seed)
    verdicts = set()
    for _ in range(300):
        s = _mutate(rng.choice(BASES), rng)
        stride = max(len(o) for o in s.order) + 1
        try:
            each = _structure_each(s, stride)
        except ScheduleError:
            each = None
        assert _structure_bulk(s, stride) == each
        verdicts.add(each is None)
    assert verdicts == {True, False}  # both valid and invalid schedules were compared
