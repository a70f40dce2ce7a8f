"""Context parallel (Ulysses and ring attention) inside tensor-parallel stages equals
single-process float64 training, and heads that tp * cp (ring: tp) cannot split are refused
at the plan line.

transformers' LlamaForCausalLM (cp_models.causal_llama: 2 layers per pipeline rank, RoPE
from position_ids, GQA with 8 heads / 4 KV heads, causal SDPA; exported) with its
q/k/v/gate/up projections column-parallel and o/down row-parallel: tp splits the heads in
two, then each tp rank's all-to-all over its cp group splits its 4 local heads (2 KV
heads) in two again; ring attention instead runs its ring over the cp group on each tp
rank's 4 local heads. 3 AdamW steps with clipping against tp_reference.reference_run (the
unmodified model on whole sequences, torch's AdamW; no pipeplan code).
"""
from __future__ import annotations

import dataclasses

import pytest

from pipeplan.dsl.ast import (ContextSpec, DataSpec, MeshSpec, ModelSpec, OptimizerSpec, PipelineSpec, Plan, TensorSpec, TrainSpec)

from .pipelined_vs_reference import assert_trains_like_reference
from .test_context_parallel import INPUTS, STEPS
from .test_context_parallel import PLAN as CP_PLAN
from .test_tensor_parallel import LLAMA


def make_plan(name: str) -> Plan:
    """name: "pp<P>[-dp2]-cp2-tp2[-sp][-zero2][-ring][-<schedule>]" (Llama, attention split by tp;
    ring: ring attention instead of Ulysses;
    dp2: 2 data-parallel replicas, ZeRO-2 over dp x cp with zero2) or "mlp-only[-ring]"
    (cp_models.RopeLM with 4 heads / 2 KV heads, pp1 x cp2 x tp2 splitting only the MLPs:
    attention whole on every tp rank)."""
    if name.startswith("mlp-only"):
        return dataclasses.replace(
            make_plan("pp1-cp2-tp2" + name.removeprefix("mlp-only")), model=ModelSpec("pipeplan.tests.parallel.cp_models:RopeLM",
                                                      capture="fx", inputs=INPUTS),
            tensor=TensorSpec(column=("layers.*.mlp.gate", "layers.*.mlp.up"),
                              row=("layers.*.mlp.down",)))
    parts = name.split("-")
    pp, dp = int(parts[0][2:]), 2 if "dp2" in parts else 1
    schedule = parts[-1] if parts[-1] in ("1f1b", "zbv", "gpipe") else "1f1b"
    return Plan(model=ModelSpec("pipeplan.tests.parallel.cp_models:causal_llama",
                                args={"heads": 8, "kv_heads": 4, "layers": 2 * pp}, capture="export",
                                inputs=INPUTS),
                data=DataSpec(seq_len=16, vocab=64, seed=7,
                              inputs=(("position_ids", "positions"),)),
                mesh=MeshSpec(pp=pp, dp=dp, cp=2, tp=2),
                context=ContextSpec("ring" if "ring" in parts else "ulysses"),
                zero=2 if "zero2" in parts else 0,
                tensor=TensorSpec(LLAMA.column, LLAMA.row, LLAMA.vocab,
                                  sequence_parallel="sp" in parts),
                pipeline=PipelineSpec(schedule=schedule, microbatches=2,
                                      virtual=2 if schedule == "zbv" else 1),
                train=TrainSpec(steps=STEPS, global_batch=4 * dp, grad_clip=0.5, seed=11,
                                optimizer=OptimizerSpec(name="adamw", lr=3e-3,
                                                        weight_decay=0.1)))


def _heads_sharded_twice(trainer) -> None:
    """Every attention op on this rank is wrapped, and sees tp-local head shards."""
    kind = "RingAttention" if trainer.plan.context.method == "ring" else "UlyssesAttention"
    wrapped = [m for r in trainer.runners.values() for m in r.module.modules()
               if type(m).__name__ == kind]
    assert len(wrapped) == trainer.plan.model.args.get("layers", 4) // trainer.plan.mesh.pp, \
        wrapped
    seen = []
    for m in wrapped:
        m.register_forward_pre_hook(lambda mod, args: seen.append(
            (type(args[0]).__name__, tuple(args[0].to_local().shape), str(args[0].placements))))
    trainer._seen_heads = seen


def _worker(rank, world, names):
    for name in names:
        seen = []

        def inspect(trainer):
            _heads_sharded_twice(trainer)
            seen.append(trainer)

        assert_trains_like_reference(make_plan(name), name, STEPS, inspect)
        # [batch 2, 8 heads / tp 2, 16 positions / cp 2, head_dim 4], split on heads; or
        # [2, all 4 heads, 8, 8] replicated over tp
        want = ("DTensor", (2, 4, 8, 8), "(Replicate(),)") if name.startswith("mlp-only") else \
            ("DTensor", (2, 4, 8, 4), "(Shard(dim=1),)")
        heads = seen[0]._seen_heads
        assert heads and all(h == want for h in heads), heads[:2]


def test_ulysses_cp2_tp2_llama_equals_reference(run_workers):
    """pp1 x cp2 x tp2 (4 ranks) with sequence parallel; attention whole under tp."""
    run_workers(_worker, 4, ["pp1-cp2-tp2-sp", "mlp-only"], timeout=500)


def test_ring_cp2_tp2_llama_equals_reference(run_workers):
    """pp1 x cp2 x tp2 (4 ranks) ring attention with sequence parallel: each tp rank's ring
    carries its 2 local KV heads (the Ulysses test's harness and reference)."""
    run_workers(_worker, 4, ["pp1-cp2-tp2-sp-ring"], timeout=300)


@pytest.mark.heavy
@pytest.mark.timeout(900)
def test_ring_pp2_cp2_tp2_llama_zbv_equals_reference(run_workers):
    """8 processes: pp2 x cp2 x tp2 ring under zbv (the ring's backward in B, on tp-local
    heads); and pp1 x cp2 x tp2 with attention whole under tp (a Replicate ring)."""
    run_workers(_worker, 8, ["pp2-cp2-tp2-ring-zbv"], timeout=880)
    run_workers(_worker, 4, ["mlp-only-ring"], timeout=300)


@pytest.mark.heavy
@pytest.mark.timeout(900)
def test_ulysses_pp2_cp2_tp2_llama_zbv_equals_reference(run_workers):
    """8 processes: pp2 x cp2 x tp2 under zbv (split B/W backward through the all-to-alls
    on tp-local heads); minutes on 2 shared cores."""
    run_workers(_worker, 8, ["pp2-cp2-tp2-zbv", "pp2-cp2-tp2"], timeout=880)


@pytest.mark.heavy
@pytest.mark.timeout(1800)
def test_ulysses_pp1_cp2_tp2_llama_without_sequence_parallel_and_with_dp2_zero2(run_workers):
    run_workers(_worker, 4, ["pp1-cp2-tp2"], timeout=880)
    run_workers(_worker, 8, ["pp1-dp2-cp2-tp2-zero2"], timeout=880)


# ------------------------------------------------------- plan line and estimates
# test_context_parallel's plan with 8 heads / 4 KV heads, 2 layers, pp1 x cp2 x tp2 and a
# Megatron split of attention and MLP (the mesh still on line 7)
PLAN = CP_PLAN.replace("heads = 4, kv_heads = 2, layers = 4", "heads = 8, kv_heads = 4, layers = 2") \
    .replace("mesh { pp = 2, cp = 2 }", "mesh { cp = 2, tp = 2 }").replace(
    "pipeline {", "tensor {\n  column = [layers.*.attn.q, layers.*.attn.k, layers.*.attn.v, "
    "layers.*.mlp.gate, layers.*.mlp.up]\n  row = [layers.*.attn.o, layers.*.mlp.down]\n}\n"
    "pipeline {")


def mlp_only(text: str) -> str:
    """tp splits only the MLPs: attention keeps all its heads on every tp rank."""
    return text.replace("column = [layers.*.attn.q, layers.*.attn.k, layers.*.attn.v, ",
                        "column = [").replace("row = [layers.*.attn.o, ", "row = [")


def _compile(text: str):
    from pipeplan.compiler import compile_plan
    from pipeplan.dsl import parse_plan

    return compile_plan(parse_plan(text, "plan.plan"))


@pytest.mark.parametrize("edit, message", [
    # tp splits the 4 KV heads in two, cp would split each rank's 2 in four
    (("mesh { cp = 2, tp = 2 }", "mesh { cp = 4, tp = 2 }"),
     r"tp \* cp = 2 \* 4 does not divide the 4 KV heads of attention"),
    (("heads = 8, kv_heads = 4", "heads = 8, kv_heads = 2"),
     r"tp \* cp = 2 \* 2 does not divide the 2 KV heads of attention"),
    (("heads = 8, kv_heads = 4", "heads = 2, kv_heads = 2"),
     r"tp \* cp = 2 \* 2 does not divide the 2 heads of attention"),
])
def test_heads_must_divide_by_tp_times_cp(edit, message):
    from pipeplan.dsl import PlanError

    with pytest.raises(PlanError, match=message) as err:
        _compile(PLAN.replace(*edit))
    assert "plan.plan:7:" in str(err.value), str(err.value)  # the mesh line


def test_ring_attention_with_tp_needs_tp_to_divide_the_kv_heads():
    # ring splits no heads, so cp = 4 with 4 KV heads / tp 2 is fine (Ulysses refuses it,
    # above); tp = 4 over 2 KV heads is tensor parallelism's own refusal at the column line
    from pipeplan.dsl import PlanError

    ring = PLAN.replace("method = ulysses", "method = ring").replace("seq_len = 16", "seq_len = 32")
    compiled = _compile(ring.replace("mesh { cp = 2, tp = 2 }", "mesh { cp = 4, tp = 2 }"))
    assert len(compiled.estimates.ranks) == 8
    with pytest.raises(PlanError, match=r"tp = 4 does not divide the 2 heads of layers.0.attn.k") \
            as err:
        _compile(ring.replace("kv_heads = 4", "kv_heads = 2").replace("tp = 2", "tp = 4"))
    assert "plan.plan:10:" in str(err.value), str(err.value)  # the column list


def test_sequence_parallel_splits_the_cp_slice():
    # 12 positions: divisible by cp = 2 and by tp = 4, but a cp rank's 6 are not by tp
    from pipeplan.dsl import PlanError

    text = PLAN.replace("seq_len = 16", "seq_len = 12").replace(
        "kv_heads = 4", "kv_heads = 8").replace("tp = 2", "tp = 4").replace(
        "row = [layers.*.attn.o, layers.*.mlp.down]",
        "row = [layers.*.attn.o, layers.*.mlp.down]\n  sequence_parallel = true")
    with pytest.raises(PlanError, match=r"tp = 4 does not divide 6 positions each of the "
                       r"cp = 2 ranks holds \(sequence parallel splits it\)") as err:
        _compile(text)
    assert "plan.plan:12:" in str(err.value), str(err.value)


def test_attention_left_whole_by_tp_needs_heads_divisible_by_cp_only():
    # 2 KV heads with cp = 2 are fine when tp does not split attention
    compiled = _compile(mlp_only(PLAN).replace("kv_heads = 4", "kv_heads = 2"))
    assert compiled.estimates.ranks[0].comm_bytes["cp"] > 0


def test_estimates_count_the_all_to_alls_on_tp_local_heads():
    split = _compile(PLAN).estimates.ranks
    whole_heads = _compile(mlp_only(PLAN)).estimates.ranks
    cp_only = _compile(PLAN.replace("mesh { cp = 2, tp = 2 }", "mesh { cp = 2 }").replace(
        PLAN[PLAN.index("tensor {"):PLAN.index("pipeline")], "")).estimates.ranks
    assert len(split) == 4 and len(cp_only) == 2
    # per microbatch and attention op: (cp-1)/cp of q, k, v and the output forward and
    # their gradients backward, [2 rows, 8 positions] x (32 + 16 + 16 + 32) features x 4
    # bytes; 2 layers, 2 microbatches; a tp rank holds half of the heads
    per_op = 2 * 8 * (32 + 16 + 16 + 32) * 4 * 2 // 2
    assert cp_only[0].comm_bytes["cp"] == 2 * 2 * per_op
    assert whole_heads[0].comm_bytes["cp"] == 2 * 2 * per_op
    assert all(r.comm_bytes["cp"] == 2 * per_op for r in split)


def test_ring_estimates_count_the_hops_on_tp_local_kv_heads():
    ring = PLAN.replace("method = ulysses", "method = ring")
    split = _compile(ring).estimates.ranks
    whole_heads = _compile(mlp_only(ring)).estimates.ranks
    # per microbatch and attention op, cp - 1 = 1 hop each of K and V forward, K and V
    # backward and the float32 dK/dV: 3 x 2 x [2 rows, 8 positions, 16 KV features] x 4
    # bytes; 2 layers, 2 microbatches; a tp rank sends its half of the KV heads
    per_op = 3 * 2 * 2 * 8 * 16 * 4
    assert whole_heads[0].comm_bytes["cp"] == 2 * 2 * per_op
    assert all(r.comm_bytes["cp"] == 2 * 2 * per_op // 2 for r in split)
    assert all(r.collectives[("cp", "ring p2p")] == 2 * 2 * per_op // 2 for r in split)
