"""The experts section: every value changes what runs or is refused at its plan line.

Refusals are found by `compile_plan` on the meta device (what `pipeplan check`
runs), before any process starts, and point at the line that asks for them.
`capacity_factor` (with dropless = false) changes the run: tests/backends/
test_equivalence_moe.py, and against its masked reference in
tests/parallel/test_expert_parallel.py.
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
  capture = fx
}
data = synthetic(seed = 0, vocab = 64, seq_len = 16)
mesh { dp = 2  ep = 2 }
pipeline { microbatches = 1 }
experts {
  modules = [layers.*.moe]
  num_experts = 4
}
train { global_batch = 4 }
"""
LOOP = PLAN.replace('"pipeplan.examples.models.moe_gpt:MoEGPT"',
                    '"tests/compiler/models.py:LoopMoENet"') \
    .replace("vocab = 64, dim = 32, layers = 2, heads = 4, seq_len = 16, num_experts = 4",
             "vocab = 16, dim = 8, layers = 2").replace("vocab = 64, seq_len", "vocab = 16, seq_len") \
    .replace("[layers.*.moe]", "[layers.*]").replace("capture = fx", 'leaf_modules = ["layers.*"]')

# transformers' Mixtral returning its unscaled load-balancing loss before the logits
ROUTER = PLAN.replace('"pipeplan.examples.models.moe_gpt:MoEGPT"',
                      '"pipeplan.tests.parallel.moe_models:mixtral_router_logits"') \
    .replace("  args = { vocab = 64, dim = 32, layers = 2, heads = 4, seq_len = 16, num_experts = 4 }\n",
             "").replace("capture = fx", "capture = export\n  loss = cross_entropy") \
    .replace("[layers.*.moe]", "[model.layers.*.mlp]").replace("seq_len = 16", "seq_len = 8")


def _extra(line: str, ep: int = 2) -> str:
    return PLAN.replace("  num_experts = 4\n}", f"  num_experts = 4\n  {line}\n}}") \
        .replace("ep = 2", f"ep = {ep}")


def _position(text: str, needle: str) -> tuple[int, int]:
    """1-based (line, col) of `needle`; a `|` inside it marks the column."""
    at = text.index(needle.replace("|", "")) + max(needle.find("|"), 0)
    return text.count("\n", 0, at) + 1, at - (text.rfind("\n", 0, at) + 1) + 1


CASES = [  # (id, plan text, where the error points ("|": the column), message)
    ("loop-moe", LOOP, "modules = [|layers.*]", "offers no experts module to distribute"),
    ("aux_loss", _extra("aux_loss = 0.01"), "aux_loss = |0.01", "computes none of its own"),
    ("z_loss", _extra("z_loss = 0.001"), "z_loss = |0.001", "computes none of its own"),
    ("allgather-ep1", _extra("dispatcher = allgather", ep=1), "dispatcher = |allgather",
     "dispatcher = allgather is not implemented"),
    ("shared_experts-ep1", _extra("shared_experts = 1", ep=1), "shared_experts = |1",
     "shared_experts is not implemented"),
    ("top_k", _extra("top_k = 1"), "top_k = |1", "router of layers.0.moe picks 2 experts"),
    ("ep-across-tp", PLAN.replace("dp = 2  ep = 2", "dp = 2  tp = 2  ep = 8")
     .replace("num_experts = 4", "num_experts = 8"), "ep = |8",
     "ep = 8 divides neither dp = 2 nor dp x tp = 4"),
    ("hf-router-aux-loss", ROUTER, "loss = |cross_entropy",
     "the model returns a scalar before its predictions"),
    ("moe-as-leaf", PLAN.replace("capture = fx", 'capture = fx\n  leaf_modules = ["layers.*.moe"]'),
     "modules = |[layers.*.moe]\n  num", "inside the leaf module layers.0.moe"),
    ("sequence-parallel", PLAN.replace("dp = 2  ep = 2", "dp = 2  tp = 2  ep = 2")
     .replace("train {", "tensor { sequence_parallel = true }\ntrain {"),
     "sequence_parallel = |true", "each experts call would see one sequence shard"),
]


@pytest.mark.parametrize("text,needle,message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_refused_at_the_plan_line(text, needle, message):
    with pytest.raises(PlanError) as info:
        compile_plan(parse_plan(text, "t.plan"))
    assert not dist.is_initialized()
    hits = [d for d in info.value.diagnostics if message in d.message]
    assert hits, [d.message for d in info.value.diagnostics]
    assert (hits[0].span.line, hits[0].span.col) == _position(text, needle)


@pytest.mark.parametrize("modules", ["layers.*.moe", "layers.*.moe.experts"])
def test_the_plan_compiles_without_the_refused_values(modules):
    """The MoE layers, or their experts modules named directly: one opaque call each."""
    text = _extra("top_k = 2").replace("[layers.*.moe]", f"[{modules}]")
    compiled = compile_plan(parse_plan(text, "t.plan"))
    calls = [n.target for st in compiled.stages for n in st.module.graph.nodes
             if n.op == "call_module"]
    assert calls.count("layers.0.moe.experts") == 1 and calls.count("layers.1.moe.experts") == 1
