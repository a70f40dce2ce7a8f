"""The ASCII timeline's legend explains every character its rows use, and only those."""
from __future__ import annotations

import pytest

from pipeplan.schedules.costs import Costs
from pipeplan.schedules.generate import generate
from pipeplan.schedules.render import ascii_timeline
from pipeplan.schedules.simulate import simulate

FILLS = {"F": "-", "B": "~", "W": "+", "BW": "="}


@pytest.mark.parametrize("kind, virtual", [("zbv", 2), ("1f1b", None), ("zbh1", None),
                                           ("interleaved", 2)])
def test_every_fill_character_is_explained(kind, virtual):
    s = generate(kind, ranks=4, microbatches=8, **({"virtual": virtual} if virtual else {}))
    text = ascii_timeline(simulate(s, Costs(per_stage=tuple((1.0, 1.0, 1.0)
                                                            for _ in range(s.stages)))))
    header, legend, *rows = text.splitlines()
    drawn = {c for row in rows for c in row.split("|")[1]}
    ops = {a.op for row in s.order for a in row}
    for op in ops:  # each op's fill, shown after its name, e.g. "F--- forward"
        assert f"{op}{FILLS[op] * 3} " in legend
        assert FILLS[op] in drawn
    assert not any(f"{op}{FILLS[op] * 3}" in legend for op in set(FILLS) - ops)
    assert "'.': idle" in legend and "." in drawn
    later = max(s.stages_per_rank()) > 1
    assert ("lower case: its later stage" in legend) == later
    assert any(c.islower() for c in drawn) == later
    assert drawn <= set(FILLS.values()) | {"."} | set("0123456789") | set("FBWfbw")
