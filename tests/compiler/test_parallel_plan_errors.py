"""Per-stage parallelism the model or the runtime cannot honour: a plan error at the plan line.

Each case is caught while checking or compiling the plan (the model built on
the meta device), before any process group exists, and points at the exact
line and column of the plan text that asks for it.
"""
from __future__ import annotations

import pytest
import torch.distributed as dist

from pipeplan.compiler import compile_plan
from pipeplan.dsl import PlanError, parse_plan

PLAN = """\
model {
  source = "pipeplan.examples.models.moe_gpt:MoEGPT"
  args = { vocab = 64, dim = 32, layers = 2, heads = 4, seq_len = 16, num_experts = 4 }
}
data = synthetic(seed = 0, vocab = 64, seq_len = 16)
mesh { dp = 4  tp = 2  ep = 2 }
pipeline { microbatches = 1 }
experts {
  modules = [layers.*.moe]
  num_experts = 4
}
tensor {
  column = [layers.*.attn.q, layers.*.attn.k, layers.*.attn.v]
  row = [layers.*.attn.proj]
}
train { global_batch = 4 }
"""
DENSE = PLAN.replace("moe_gpt:MoEGPT", "gpt:GPT").replace(", num_experts = 4", "") \
    .replace("experts {\n  modules = [layers.*.moe]\n  num_experts = 4\n}\n", "") \
    .replace("  ep = 2", "")


def _position(text: str, needle: str) -> tuple[int, int]:
    """1-based (line, col) of `needle`; a `|` inside it marks the column."""
    at = text.index(needle.replace("|", "")) + max(needle.find("|"), 0)
    return text.count("\n", 0, at) + 1, at - (text.rfind("\n", 0, at) + 1) + 1


def _diagnostics(text: str) -> list[tuple[int, int, str]]:
    with pytest.raises(PlanError) as info:
        compile_plan(parse_plan(text, "t.plan"))
    assert not dist.is_initialized()  # nothing distributed was started to find this out
    return [(d.span.line, d.span.col, d.message) for d in info.value.diagnostics]


FFN = DENSE.replace("args = { vocab = 64", "args = { hidden = 50, vocab = 64") \
    .replace("tp = 2", "tp = 4") \
    .replace("[layers.*.attn.q, layers.*.attn.k, layers.*.attn.v]", "[layers.*.mlp.up]") \
    .replace("[layers.*.attn.proj]", "[layers.*.mlp.down]")
SP = DENSE.replace("tp = 2", "tp = 1").replace(
    "  column = [layers.*.attn.q, layers.*.attn.k, layers.*.attn.v]\n"
    "  row = [layers.*.attn.proj]\n", "  sequence_parallel = true\n")

# (id, plan text, needle: where the error points ("|" marks the column), message)
CASES = [
    ("tp-not-dividing-heads", PLAN.replace("dp = 4  tp = 2", "dp = 2  tp = 8"),
     "layers.*.attn.q", "tp = 8 does not divide the 4 heads of layers.0.attn.q"),
    ("tp-not-dividing-ffn", FFN, "layers.*.mlp.up",
     "tp = 4 does not divide the 50 output features of layers.0.mlp.up"),
    ("ep-not-dividing-experts", PLAN.replace("num_experts = 4", "num_experts = 6")
     .replace("ep = 2", "ep = 4"), "num_experts = |6\n}", "ep = 4 does not divide num_experts = 6"),
    ("sequence-parallel-without-tp", SP, "sequence_parallel = |true",
     "sequence_parallel does nothing with mesh.tp = 1"),
    ("ep-not-dividing-dp-or-dp-tp", PLAN.replace("dp = 4  tp = 2  ep = 2", "dp = 3  tp = 2  ep = 4"),
     "ep = |4", "ep = 4 divides neither dp = 3 nor dp x tp = 6"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_parallel_plan_error_points_at_the_line(case):
    _, text, needle, message = case
    found = _diagnostics(text)
    line, col = _position(text, needle)
    assert (line, col, message) in [(ln, c, m[:len(message)]) for ln, c, m in found], found


def test_ep_across_tensor_parallel_ranks_is_accepted_where_ep_divides_dp_tp():
    text = CASES[-1][1]
    with pytest.raises(PlanError) as info:
        parse_plan(text, "t.plan")
    (d,) = [d for d in info.value.diagnostics if d.message.startswith("ep = 4")]
    assert "or of dp x tp for expert parallel across tensor-parallel ranks" in d.hint
    parse_plan(PLAN.replace("dp = 4  tp = 2  ep = 2", "dp = 2  tp = 2  ep = 4"), "t.plan")


def test_the_valid_plans_compile():
    """The edits above are what breaks each case: the plans themselves compile."""
    assert compile_plan(parse_plan(PLAN, "t.plan")).experts
    assert compile_plan(parse_plan(DENSE, "t.plan")).tp_rewrites
