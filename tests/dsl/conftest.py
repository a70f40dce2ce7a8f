"""Shared helpers for the plan-language tests: a small valid plan and error probes."""
from __future__ import annotations

import pytest

from pipeplan.dsl import PlanError, parse_plan

BASE = """\
model {
  source = "models/gpt.py:GPT"
  args = { vocab = 256, dim = 64, layers = 8, heads = 4, seq_len = 64 }
}
data = synthetic(seed = 0, vocab = 256, seq_len = 64)
mesh { pp = 4 }
pipeline {
  schedule = 1f1b
  microbatches = 8
  split = [layers[0:2], layers[2:4], layers[4:6], layers[6:8]]
}
train {
  steps = 30
  global_batch = 16
  optimizer = adamw(lr = 0.003)
}
"""

MOE = """\
model {
  source = "models/moe_gpt.py:MoEGPT"
  args = { layers = 4, seq_len = 64, num_experts = 4, top_k = 2 }
}
data = synthetic(seq_len = 64)
mesh { pp = 2  dp = 2  ep = 2 }
pipeline { schedule = zbv  microbatches = 4  virtual = 2 }
experts {
  modules = [layers.*.moe]
  num_experts = 4
  top_k = 2
}
train { global_batch = 16 }
"""


def position(text: str, needle: str, nth: int = 0) -> tuple[int, int]:
    """1-based (line, col) of the nth occurrence of `needle` in `text`."""
    at = -1
    for _ in range(nth + 1):
        at = text.index(needle, at + 1)
    line = text.count("\n", 0, at) + 1
    return line, at - (text.rfind("\n", 0, at) + 1) + 1


def errors(text: str, **kw) -> list[tuple[str, int, int, str]]:
    """(file, line, col, message) of every diagnostic parse_plan raises (fails if none)."""
    with pytest.raises(PlanError) as info:
        parse_plan(text, **kw)
    return [(d.span.file, d.span.line, d.span.col, d.message) for d in info.value.diagnostics]


@pytest.fixture
def base() -> str:
    return BASE


@pytest.fixture
def moe() -> str:
    return MOE


@pytest.fixture(name="errors_of")
def _errors_of():
    return errors


@pytest.fixture(name="pos")
def _pos():
    return position
