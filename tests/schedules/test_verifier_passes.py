"""The verifier's bulk pass against the per-action passes it shortcuts (execution.py).

The bulk pass must accept exactly the schedules the structure, resolve and channel passes
accept, with the same producers; where it declines, those passes name the fault (the
messages are pinned by test_verifier.py). Checked on valid schedules and on random
mutations that break them in each pass's way (malformed, missing, repeated, misplaced,
reordered on a rank: local order, channel order)."""
import random

import pytest

from pipeplan.schedules import Action, Schedule, ScheduleError, generate
from pipeplan.schedules.execution import _bulk, _check_channels, _check_structure, _resolve

BASES = [generate(k, p, m) for k, p, m in (("1f1b", 3, 4), ("zbh1", 3, 5), ("zbv", 3, 6),
                                            ("interleaved", 2, 4), ("gpipe", 1, 3))]


def _replacements(a: Action, base: Schedule, rng: random.Random) -> list:
    """What an action may be replaced by: another op or microbatch, a stage off its rank or
    out of range, or something malformed (a plain tuple, wrong field types, a string)."""
    return [Action(rng.choice(["F", "B", "W", "BW", "X"]), a.stage, rng.randrange(-1, base.microbatches + 1)),
            Action(a.op, rng.randrange(-1, base.stages + 1), a.microbatch),
            tuple(a), Action(a.op, float(a.stage), a.microbatch), Action(a.op, a.stage, True),
            Action(a.op, a.stage, str(a.microbatch)), Action(None, a.stage, a.microbatch),
            Action(a.op, a.stage, 2 ** 70), "F0.0"]


def _mutate(base: Schedule, rng: random.Random) -> Schedule:
    """Up to two random edits: reorder within a rank, move to another rank's front, drop,
    repeat, add an op of a stage the rank holds (BW beside B and W, ...), or replace."""
    order = [list(row) for row in base.order]
    for _ in range(rng.choice((0, 1, 1, 2))):
        row = order[rng.randrange(len(order))]
        if not row:
            continue
        i, j = rng.randrange(len(row)), rng.randrange(len(row) + 1)
        a = row[i]
        if type(a) is not Action or type(a.stage) is not int or type(a.microbatch) is not int:
            continue  # a malformed entry from an earlier edit stays as it is
        edit = rng.randrange(6)
        if edit == 0:
            row.insert(j, row.pop(i))
        elif edit == 1:
            order[rng.randrange(len(order))].insert(0, row.pop(i))
        elif edit == 2:
            del row[i]
        elif edit == 3:
            row.insert(j, a if rng.random() < 0.5 else
                       Action(rng.choice(["F", "B", "W", "BW"]), a.stage, rng.randrange(base.microbatches)))
        else:
            row[i] = rng.choice(_replacements(a, base, rng))
    return Schedule("mutant", base.ranks, base.stages, base.microbatches, base.stage_to_rank,
                    tuple(tuple(row) for row in order))


def _per_action(s: Schedule, stride: int, in_order: bool):
    """The per-action passes' producers, or the first line of the fault they name."""
    try:
        producer = _resolve(s, _check_structure(s, stride), stride)
        if in_order:
            _check_channels(s, producer, stride)
        return producer
    except ScheduleError as e:
        return str(e).split(":")[0]


@pytest.mark.parametrize("seed", range(6))
def test_bulk_pass_agrees_with_per_action_passes(seed):
    rng = random.Random(seed)
    faults = set()
    for _ in range(300):
        s = _mutate(rng.choice(BASES), rng)
        stride = max(len(o) for o in s.order) + 1
        for in_order in (True, False):
            each = _per_action(s, stride, in_order)
            bulk = _bulk(s, stride, in_order)
            if isinstance(each, str):
                assert bulk is None, each
                faults.add(each.split()[0])
            else:
                assert bulk == each
                faults.add("valid")
    assert {"valid", "rank", "channel"} <= faults  # valid, local and channel faults were compared
