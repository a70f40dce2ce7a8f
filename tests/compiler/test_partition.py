"""Auto balancing by cost, and the printed split re-parses as a plan."""
from __future__ import annotations

import pytest

from pipeplan.compiler import compile_plan
from pipeplan.dsl import parse_plan
from pipeplan.dsl.ast import SplitSpec


def _layers_per_stage(compiled):
    return [sum(1 for b in st.module_names if b.startswith("layers.")) for st in compiled.stages]


def test_uniform_16_layers_into_4_equal_stages(make_plan):
    plan = make_plan("tests/compiler/models.py:Uniform", {"layers": 16}, pp=4, microbatches=4,
                     global_batch=8)
    compiled = compile_plan(plan)
    assert _layers_per_stage(compiled) == [4, 4, 4, 4]
    assert compiled.split_text == 'split = ["layers.4", "layers.8", "layers.12"]'


def test_heavy_head_gets_fewer_layers_on_the_last_stage(make_plan):
    # head width 8*40 = 320 = 10 x dim: the LM head costs ten layers
    plan = make_plan("tests/compiler/models.py:Uniform", {"layers": 16, "head_scale": 40}, pp=4,
                     microbatches=4, global_batch=8)
    compiled = compile_plan(plan)
    counts = _layers_per_stage(compiled)
    assert sum(counts) == 16 and counts[-1] < min(counts[:-1])
    # the head alone outweighs a fair share: it gets a stage to itself, the rest share the layers
    assert counts == [5, 5, 6, 0] or counts == [5, 6, 5, 0] or counts == [6, 5, 5, 0]


def test_head_worth_four_layers_exact_balance(make_plan):
    # head width 8*16 = 128 = 4 x dim; 16 layers + 4 = 20 units over 4 stages: 5 each
    plan = make_plan("tests/compiler/models.py:Uniform", {"layers": 16, "head_scale": 16}, pp=4,
                     microbatches=4, global_batch=8)
    assert _layers_per_stage(compile_plan(plan)) == [5, 5, 5, 1]


def test_virtual_stages_balance_too(make_plan):
    plan = make_plan("tests/compiler/models.py:Uniform", {"layers": 16}, pp=2, virtual=2,
                     schedule="interleaved", microbatches=4, global_batch=8)
    assert _layers_per_stage(compile_plan(plan)) == [4, 4, 4, 4]


def test_params_basis(make_plan):
    plan = make_plan("tests/compiler/models.py:Uniform", {"layers": 16}, pp=4, microbatches=4,
                     global_batch=8, split=SplitSpec(kind="auto", basis="params"))
    assert _layers_per_stage(compile_plan(plan)) == [4, 4, 4, 4]


def test_printed_split_reparses_and_pins_the_same_stages(make_plan, tmp_path):
    plan = make_plan("tests/compiler/models.py:Uniform", {"layers": 16, "head_scale": 40}, pp=4,
                     microbatches=4, global_batch=8)
    auto = compile_plan(plan)
    text = f"""model {{
  source = "{plan.model.source}"
  args = {{ layers = 16, head_scale = 40 }}
}}
data = synthetic(seq_len = 16)
mesh {{ pp = 4 }}
pipeline {{
  microbatches = 4
  {auto.split_text}
}}
train {{ global_batch = 8 }}
"""
    pinned_plan = parse_plan(text, str(tmp_path.parent / "x.plan"))
    assert pinned_plan.pipeline.split.kind == "points"
    assert pinned_plan.pipeline.split.points == auto.split_points
    pinned_plan = make_plan(plan.model.source, dict(plan.model.args), pp=4, microbatches=4,
                            global_batch=8, split=pinned_plan.pipeline.split)
    pinned = compile_plan(pinned_plan)
    assert [s.module_names for s in pinned.stages] == [s.module_names for s in auto.stages]


def test_explicit_ranges(make_plan):
    from pipeplan.dsl.ast import LayerRange
    plan = make_plan("tests/compiler/models.py:Uniform", {"layers": 16}, pp=2,
                     split=SplitSpec(kind="ranges", ranges=(LayerRange("layers", 0, 10),
                                                            LayerRange("layers", 10, 16))))
    assert _layers_per_stage(compile_plan(plan)) == [10, 6]


def test_moe_layers_costed_at_top_k(make_plan):
    from pipeplan.dsl.ast import ExpertsSpec
    args = {"layers": 2, "seq_len": 16, "num_experts": 8, "top_k": 2}
    dense = compile_plan(make_plan("examples/models/moe_gpt.py:MoEGPT", args, pp=1))
    routed = compile_plan(make_plan("examples/models/moe_gpt.py:MoEGPT", args, pp=1,
                                    experts=ExpertsSpec(modules=("layers.*.moe",),
                                                        num_experts=8, top_k=2)))
    # the experts call (every expert on every token, then mixed by the top-k weights) shrinks
    # to top_k / num_experts = 1/4 of its dense cost
    mb, t, d, h, e = 2, 16, 64, 128, 8
    expert_flops = 2 * (2 * mb * t * d * h * e) + 2 * mb * t * e * d  # up, down, mix; per layer
    saved = 2 * expert_flops * (1 - 2 / 8)
    assert dense.stages[0].flops - routed.stages[0].flops == pytest.approx(saved)
