"""Context parallel (Ulysses) equals single-process float64 training, and what it cannot
split is refused at the plan line.

Equivalence: `RopeLM` (tests/parallel/cp_models.py: RoPE from position_ids, GQA with 4
heads / 2 KV heads, causal SDPA) with pp2 x cp2 under 1f1b and zbv (split B/W backward
through the all-to-alls) and pp1 x dp2 x cp2, 3 AdamW steps with clipping, against tp_reference.reference_run
(the unmodified model on whole sequences, torch's AdamW; shares no code with the path).
"""
from __future__ import annotations

import pytest
import torch

from pipeplan.dsl.ast import (ContextSpec, DataSpec, InputSpec, MeshSpec, ModelSpec, OptimizerSpec, PipelineSpec, Plan, TrainSpec)

from .pipelined_vs_reference import assert_trains_like_reference

STEPS = 3
INPUTS = (InputSpec("input_ids", "int64", ("batch", "seq")),
          InputSpec("position_ids", "int64", ("batch", "seq")))


def make_plan(name: str) -> Plan:
    """name: a schedule (pp2 x cp2), "dp2" / "zero2" (pp1 x dp2 x cp2, 1f1b, ZeRO-0 / 2), or
    "pp2-dp2-zero2" (pp2 x dp2 x cp2, 1f1b, ZeRO-2: 8 ranks); "llama-<schedule>": transformers'
    Llama (cp_models.causal_llama, exported) with pp2 x cp2; a "ring-" prefix: ring attention
    instead of Ulysses."""
    ring = name.startswith("ring-")
    name = name.removeprefix("ring-")
    llama = name.startswith("llama-")
    name = name.removeprefix("llama-")
    schedule, dp, pp = {"dp2": ("1f1b", 2, 1), "zero2": ("1f1b", 2, 1),
                        "pp2-dp2-zero2": ("1f1b", 2, 2)}.get(name, (name, 1, 2))
    model = ModelSpec("pipeplan.tests.parallel.cp_models:causal_llama", capture="export",
                      inputs=INPUTS) if llama else \
        ModelSpec("pipeplan.tests.parallel.cp_models:RopeLM", capture="fx", inputs=INPUTS)
    return Plan(model=model,
                data=DataSpec(seq_len=16, vocab=64, seed=7,
                              inputs=(("position_ids", "positions"),)),
                mesh=MeshSpec(pp=pp, dp=dp, cp=2),
                context=ContextSpec("ring" if ring else "ulysses"),
                pipeline=PipelineSpec(schedule=schedule, microbatches=2,
                                      virtual=2 if schedule == "zbv" else 1),
                zero=2 if name.endswith("zero2") else 0,
                train=TrainSpec(steps=STEPS, global_batch=4 * dp, grad_clip=0.5, seed=11,
                                optimizer=OptimizerSpec(name="adamw", lr=3e-3,
                                                        weight_decay=0.1)))


def _attention_wrapped(trainer) -> None:
    kind = "RingAttention" if trainer.plan.context.method == "ring" else "UlyssesAttention"
    n = sum(isinstance(m, torch.nn.Module) and type(m).__name__ == kind
            for r in trainer.runners.values() for m in r.module.modules())
    assert n == 4 // trainer.plan.mesh.pp, n  # every layer's attention on this rank, wrapped


def _worker(rank, world, names):
    for schedule in names:
        assert_trains_like_reference(make_plan(schedule), schedule, STEPS, _attention_wrapped)


def test_ulysses_pp2_cp2_and_dp2_cp2_equal_reference(run_workers):
    """dp2: gradients summed over the flattened dp x cp group, 8 rows of 2 DP ranks; zero2:
    the same with ZeRO-2 sharding over dp x cp."""
    run_workers(_worker, 4, ["1f1b", "zbv", "dp2", "zero2"], timeout=500)


# ------------------------------------------------------- layout and estimates
def test_cp_sits_between_dp_and_tp_in_the_rank_layout():
    from pipeplan.dsl.layout import global_rank, groups, mesh_layout

    mesh = MeshSpec(pp=2, dp=2, cp=2, tp=2)
    layout = mesh_layout(mesh)
    assert len(layout) == mesh.world_size == 16
    for c in layout:  # tp innermost, then cp, then dp, pp outermost
        assert c.rank == ((c.pp * 2 + c.dp) * 2 + c.cp) * 2 + c.tp
        assert global_rank(mesh, c.pp, c.dp, c.tp, c.cp) == c.rank
    assert groups(layout, "cp")[0] == (0, 2)
    assert groups(layout, "dpcp")[0] == (0, 2, 4, 6)  # gradients: reduced over dp x cp


PLAN = """\
model {
  source = "pipeplan.tests.parallel.cp_models:RopeLM"
  args = { vocab = 64, dim = 32, heads = 4, kv_heads = 2, layers = 4 }
  inputs { input_ids = int64[batch, seq], position_ids = int64[batch, seq] }
}
data = synthetic(seed = 0, vocab = 64, seq_len = 16, inputs = { position_ids = positions })
mesh { pp = 2, cp = 2 }
context { method = ulysses }
pipeline { schedule = 1f1b, microbatches = 2 }
train { global_batch = 4 }
"""


def test_estimates_divide_activations_along_the_sequence_and_count_all_to_alls():
    from pipeplan.compiler import compile_plan
    from pipeplan.dsl import parse_plan

    cp2 = compile_plan(parse_plan(PLAN, "cp.plan")).estimates.ranks
    whole = compile_plan(parse_plan(PLAN.replace("pp = 2, cp = 2", "pp = 2").replace(
        "context { method = ulysses }", ""), "whole.plan")).estimates.ranks
    for r in (0, 1):  # ranks 0 (pp 0) and 2 (pp 1) of the cp run
        mine, ref = cp2[2 * r], whole[r]
        # everything saved per position halves; a saved scalar (4 bytes, the loss's) does not
        assert abs(mine.activation_bytes * 2 - ref.activation_bytes) <= 4
        assert mine.activation_bytes < 0.51 * ref.activation_bytes
        assert mine.flops * 2 == ref.flops  # attention too: S^2 * H/cp per rank
        assert "cp" not in ref.comm_bytes
    # per microbatch and attention op a rank sends (cp-1)/cp of q, k, v and the output
    # forward and their gradients backward: [2 rows, 8 positions] x (32 + 16 + 16 + 32)
    # features x 4 bytes; 2 layers per stage, 2 microbatches
    per_op = 2 * 8 * (32 + 16 + 16 + 32) * 4 * 2 // 2
    assert cp2[0].comm_bytes["cp"] == cp2[2].comm_bytes["cp"] == 2 * 2 * per_op


# ------------------------------------------------------- refused at the plan line
@pytest.mark.parametrize("edit, line, message", [
    (("seq_len = 16", "seq_len = 15"), 6, r"cp = 2 does not divide data.seq_len = 15"),
    (("context { method = ulysses }", ""), 7, r"cp = 2 but the plan has no context section"),
    (("cp = 2", "cp = 1"), 8, r"context does nothing with mesh.cp = 1"),
    (("pp = 2, cp = 2", "pp = 2, cp = 2, ep = 2"), 7, r"cp = 2 with ep = 2 is not supported"),
])
def test_plan_checks(edit, line, message):
    from pipeplan.dsl import PlanError, parse_plan

    text = PLAN.replace(*edit)
    with pytest.raises(PlanError, match=message) as err:
        parse_plan(text, "plan.plan")
    assert f"plan.plan:{line}:" in str(err.value), str(err.value)


@pytest.mark.parametrize("edit, line, message", [
    # 2 KV heads over cp = 4 (read from the SDPA call's k, not from attribute names)
    (("cp = 2", "cp = 4"), 7, r"cp = 4 does not divide the 2 KV heads of attention"),
    (("dim = 32, heads = 4, kv_heads = 2", "dim = 24, heads = 3, kv_heads = 3"), 7,
     r"cp = 2 does not divide the 3 heads of attention"),
    # (the model numbering positions itself with export's literal length is tied by a
    # second capture at the whole length: tests/parallel/test_cp_masks.py)
    # WindowLM: its first block's attention is eager; Ulysses would run it whole on its
    # heads (compiler/parallel/cp_regions.py), but its window mask numbers positions by an
    # activation's length (x.shape[1]), which is one rank's slice
    (('"pipeplan.tests.parallel.cp_models:RopeLM"', '"pipeplan.tests.parallel.tp_models:WindowLM"'),
     8, r"Ulysses cannot run the attention around `softmax` on whole sequences: it reads "
        r"`getitem_1`, the sequence's length on one rank's slice"),
])
def test_graph_checks(edit, line, message):
    from pipeplan.compiler import compile_plan
    from pipeplan.dsl import PlanError, parse_plan

    text = PLAN.replace(*edit)
    if "WindowLM" in text:
        text = text.replace("heads = 4, kv_heads = 2, layers = 4", "heads = 4, layers = 2") \
            .replace("inputs { input_ids = int64[batch, seq], position_ids = int64[batch, seq] }",
                     "")
    if "position_ids = int64" not in text:  # the model takes input_ids only
        text = text.replace(", inputs = { position_ids = positions }", "")
    with pytest.raises(PlanError, match=message) as err:
        compile_plan(parse_plan(text, "plan.plan"))
    assert f"plan.plan:{line}:" in str(err.value), str(err.value)


@pytest.mark.heavy
@pytest.mark.timeout(900)
def test_ulysses_pp2_dp2_cp2_zero2_equals_reference(run_workers):
    """8 processes: pp2 x dp2 x cp2 with ZeRO-2 (minutes on 2 shared cores)."""
    run_workers(_worker, 8, ["pp2-dp2-zero2"], timeout=880)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_ulysses_transformers_llama_pp2_cp2_equals_reference(run_workers):
    """transformers' LlamaForCausalLM (RoPE from position_ids, GQA 4/2, SDPA with is_causal:
    cp_models.causal_llama), exported, pp2 x cp2 under 1f1b and zbv."""
    run_workers(_worker, 4, ["llama-1f1b", "llama-zbv"], timeout=880)


def test_transformers_default_sdpa_mask_is_rebuilt_on_the_whole_sequence():
    """attn_implementation="sdpa" materialises a [B, 1, S/cp, S/cp] mask when exported: it is
    replaced by the model's own mask code on the whole sequence ([B, 1, S, S])."""
    from pipeplan.compiler import compile_plan
    from pipeplan.compiler.parallel.cp import attention_nodes, attn_mask
    from pipeplan.dsl import parse_plan

    text = PLAN.replace('"pipeplan.tests.parallel.cp_models:RopeLM"',
                        '"pipeplan.tests.compiler.models:tiny_llama"\n  capture = export')
    compiled = compile_plan(parse_plan(text, "plan.plan"))
    first, second = compiled.stages  # pp2: the mask is made in stage 0 and sent whole
    for node in attention_nodes(first.module.graph):
        mask = attn_mask(node)
        assert mask.op == "call_module" and mask.target.startswith("cp_mask_"), mask
    sent = {spec.name: spec.shape for spec in first.outputs}
    for node in attention_nodes(second.module.graph):
        assert sent[attn_mask(node).name][-2:] == (16, 16), sent
