"""Why a layer offers no experts module (compiler/parallel/ep.py `why_not`), read off its
structure: Llama 4's experts stack their weights by expert but take no routing (a dense
call), DBRX's take the routing but hold [num_experts * F, H] weights in a submodule; each
refusal says what to do. The same reasons reach `pipeplan check` at `experts.modules`."""
from __future__ import annotations

import pytest

from pipeplan.compiler import compile_plan
from pipeplan.compiler.parallel.ep import why_not
from pipeplan.dsl import PlanError, parse_plan
from pipeplan.tests.parallel import families


def test_llama4_experts_are_dense_stacked_without_routing():
    layer = families.llama4_text(1).model.layers[0].feed_forward
    why, hint = why_not(layer, 4)
    assert "its `experts` (Llama4TextExperts) stacks the experts by expert but its forward " \
        "takes 1 input(s), not the routing" in why, why
    assert hint.startswith("train this layer with ep = 1 and no capacity"), hint


def test_dbrx_experts_take_the_routing_but_hold_flat_weights_in_a_submodule():
    layer = families.dbrx(1).transformer.blocks[0].ffn
    why, hint = why_not(layer, 4)
    assert "its `experts` (DbrxExperts) takes (hidden, top_k_index, top_k_weights) but its " \
        "weights (`mlp.w1` [256, 32]" in why, why
    assert "[num_experts * F, H] matrix viewed as [num_experts, F, H]" in hint, hint


PLAN = """\
model {
  source = "pipeplan.tests.parallel.families:llama4_text"
  args = { layers = 1 }
  inputs = { input_ids = int64[batch, seq] }
  capture = export
}
data = synthetic(seed = 7, vocab = 64, seq_len = 16)
mesh { dp = 2, ep = 2 }
pipeline { schedule = 1f1b, microbatches = 1 }
experts { modules = ["model.layers.*.feed_forward"], num_experts = 4, top_k = 1 }
train { steps = 1, global_batch = 4, optimizer = adamw(lr = 0.003), seed = 11 }
"""


def test_the_reason_reaches_the_experts_modules_line():
    with pytest.raises(PlanError) as err:
        compile_plan(parse_plan(PLAN, "l4.plan"))
    message = str(err.value)
    assert "l4.plan:10:" in message and "a dense call with nothing to route" in message, message
