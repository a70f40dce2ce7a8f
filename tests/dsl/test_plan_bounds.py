"""Oversized plans are refused before the parser runs (dsl/scan.py): a 400k-element list
(61 s and 800 MB before) and a plan of too many values are errors at their line in
milliseconds; what any error echoes stays bounded (lines, messages, the count of errors)."""
from __future__ import annotations

import resource
import time

import pytest

from pipeplan.dsl.errors import ECHO_DIAGNOSTICS, PlanError
from pipeplan.dsl.limits import MAX_LIST_ITEMS, MAX_PLAN_VALUES
from pipeplan.dsl.load import load_plan, parse_plan

HEAD = """model {{
  source = "gpt.py:GPT"
  args = {{ vocab = 32, dim = 16{args} }}
}}
data = synthetic(seed = 1, vocab = 32, seq_len = 8)
mesh {{ pp = 2 }}
pipeline {{ schedule = 1f1b  microbatches = 2 }}
train {{ steps = 2  global_batch = 2  optimizer = sgd(lr = 0.05){train} }}
"""


def _refused(path) -> tuple[str, float, int]:
    """(the error text, CPU seconds, growth of this process's peak RSS in KiB)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = time.process_time()
    with pytest.raises(PlanError) as e:
        load_plan(str(path))
    return (str(e.value), time.process_time() - t,
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss)


def test_a_400k_element_list_is_refused_at_its_bracket_fast(tmp_path):
    big = ", ".join("1" for _ in range(400_000))  # ~1.2 MB written, under the 4 MiB file bound
    path = tmp_path / "p.plan"
    path.write_text(HEAD.format(args=f", widths = [{big}]", train=""))
    text, cpu, rss = _refused(path)
    assert cpu < 1.0 and rss < 100 * 1024, (cpu, rss)
    assert len(text) < 800, len(text)
    first, echo, caret, hint = text.splitlines()
    assert first == f"{path}:3:{text.splitlines()[0].split(':')[2]}: error: list has more " \
        f"than {MAX_LIST_ITEMS:,} elements"
    col = int(first.split(":")[2])
    assert (HEAD.format(args=", widths = [", train="").splitlines()[2] + "1")[col - 1] == "["
    assert echo[caret.index("^")] == "[" and caret.count("^") == 1
    assert "docs/plan-language.md" in hint


def test_a_list_at_the_bound_still_parses():
    items = ", ".join(f'"f{i}"' for i in range(MAX_LIST_ITEMS))  # strings: commas inside skipped
    text = HEAD.format(args=f', files = [{items}], note = "a, b, [c"', train="")
    plan = parse_plan(text, "p.plan")
    assert len(plan.model.args["files"]) == MAX_LIST_ITEMS


def test_too_many_values_are_refused_at_the_first_over_the_bound(tmp_path):
    keys = "  ".join(f"k{i} = {i}" for i in range(MAX_PLAN_VALUES))  # many short lists' worth
    path = tmp_path / "p.plan"
    path.write_text(HEAD.format(args="", train="") + "extra {\n" + keys + "\n}\n")
    text, cpu, _ = _refused(path)
    assert cpu < 1.0, cpu
    assert f"error: plan has more than {MAX_PLAN_VALUES:,} values" in text.splitlines()[0]
    assert text.splitlines()[0].startswith(f"{path}:10:")
    assert len(text) < 800


def test_thousands_of_errors_print_the_first_fifty_and_a_count(tmp_path):
    keys = "\n".join(f"  bogus{i} = {i}" for i in range(2000))
    path = tmp_path / "p.plan"
    path.write_text(HEAD.format(args="", train="\n" + keys + "\n"))
    with pytest.raises(PlanError) as e:
        load_plan(str(path))
    assert len(e.value.diagnostics) == 2000
    text = str(e.value)
    assert text.count(": error: unknown key 'bogus") == ECHO_DIAGNOSTICS
    assert text.endswith(f"... and {2000 - ECHO_DIAGNOSTICS:,} more errors (the first "
                         f"{ECHO_DIAGNOSTICS} are shown)")
    assert len(text) < 400 * ECHO_DIAGNOSTICS
