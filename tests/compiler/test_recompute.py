"""Recompute rules change what a stage saves and what its backward reruns."""
from __future__ import annotations

import pytest

from pipeplan.compiler import compile_plan
from pipeplan.dsl import PlanError
from pipeplan.dsl.ast import RecomputeRule

B, T, D, V = 2, 16, 32, 64  # microbatch, seq, width, vocab
BLOCK_INPUT = B * T * D * 4  # one fp32 [B, T, D] tensor


def _stage(make_plan, *rules, layers=2):
    plan = make_plan("examples/models/gpt.py:GPT",
                     {"vocab": V, "dim": D, "layers": layers, "heads": 4, "seq_len": T}, pp=1,
                     microbatches=2, global_batch=4, recompute=tuple(rules))
    return compile_plan(plan).stages[0]


def test_full_recompute_keeps_only_block_inputs_and_reruns_their_forward(make_plan):
    full = RecomputeRule("layers.*", "full")
    none2, none3 = _stage(make_plan), _stage(make_plan, layers=3)
    full2, full3 = _stage(make_plan, full), _stage(make_plan, full, layers=3)
    # one more block adds its whole saved set without recompute, only its input with it
    assert full3.activation_bytes - full2.activation_bytes == BLOCK_INPUT
    assert none3.activation_bytes - none2.activation_bytes > 4 * BLOCK_INPUT
    head = 2 * B * T * D * V  # the only FLOPs outside the blocks (embeddings, norms: none)
    assert none2.recompute_flops == 0 and full2.flops == none2.flops
    assert full2.recompute_flops == none2.flops - head


def test_selective_recompute_reruns_only_cheap_ops(make_plan):
    none = _stage(make_plan)
    sel = _stage(make_plan, RecomputeRule("layers.*", "selective"))
    full = _stage(make_plan, RecomputeRule("layers.*", "full"))
    attention = 2 * 4 * B * T * T * D  # q·kᵀ and p·v in each of the 2 layers
    assert sel.recompute_flops == attention
    assert full.activation_bytes < sel.activation_bytes < none.activation_bytes


def test_pattern_star_matches_one_segment(make_plan):
    # `*.mlp` names no module (the MLPs sit at layers.N.mlp): refused, not silently ignored
    with pytest.raises(PlanError, match=r"recompute pattern '\*\.mlp' matches no module"):
        _stage(make_plan, RecomputeRule("*.mlp", "full"))
    assert _stage(make_plan, RecomputeRule("layers.*.mlp", "full")).recompute_flops > 0
