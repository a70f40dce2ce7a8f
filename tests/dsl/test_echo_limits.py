"""Plan errors echo a bounded amount: a 4000-element list on the erroneous line is cut
around the caret (129 KB of output for 20k elements before, a few hundred bytes now)."""
from __future__ import annotations

import pytest

from pipeplan.dsl.errors import ECHO_COLUMNS, PlanError, clip_line
from pipeplan.dsl.load import load_plan

PLAN = """model {{
  source = "gpt.py:GPT"
  args = {{ vocab = 32, dim = 16 }}
}}
data = synthetic(seed = 1, vocab = 32, seq_len = 8)
mesh {{ pp = 2 }}
pipeline {{ schedule = 1f1b  microbatches = 2 }}
train {{ steps = 2  global_batch = 2  optimizer = sgd(lr = 0.05)  bogus = [{big}] }}
"""


def test_a_huge_line_is_cut_around_the_caret(tmp_path):
    big = ", ".join(str(i) for i in range(4000))  # under the list bound, 20 KB on one line
    path = tmp_path / "p.plan"
    path.write_text(PLAN.format(big=big))
    with pytest.raises(PlanError) as e:
        load_plan(str(path))
    text = str(e.value)
    assert len(text) < 1000, len(text)
    lines = text.splitlines()
    assert lines[0].endswith("error: unknown key 'bogus' in train")
    echo, caret = lines[1], lines[2]
    assert echo.startswith("    ...") and echo.endswith("...")
    at = caret.index("^")
    assert echo[at:at + 5] == "bogus" and caret.count("^") == 5


def test_clip_line_keeps_short_lines_and_the_span():
    assert clip_line("x = 1", 5, 1) == ("x = 1", 5, 1)
    line = "a" * 500 + "BAD" + "b" * 500
    part, col, width = clip_line(line, 501, 3)
    assert part[col - 1:col - 1 + width] == "BAD" and len(part) <= ECHO_COLUMNS + 6
    part, col, width = clip_line("c" * 300, 1, 300)  # a span longer than the window
    assert col == 1 and width == ECHO_COLUMNS and part.endswith("...")
