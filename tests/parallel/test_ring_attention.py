"""Ring attention (backends/parallel/cp/ring.py) on real gloo rings equals torch's
F.scaled_dot_product_attention on the whole sequence, in float64: outputs and dq, dk, dv
of every rank's positions, causal (load-balanced layout) or not, grouped-query K/V and a
custom scale, over rings of 4, 3 and 2 ranks; and the bytes each rank sends and its calls,
Ulysses' all-to-alls' too (the time model's message count).

Then, compile only: the plan-line refusals and the estimates against hand arithmetic; and
through the runtime: transformers' Llama pp2 x cp2 with ring attention under 1f1b and zbv
equal to single-process float64 training (dp and ZeRO compositions under -m heavy)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from .comm_meter import CommMeter

TOL = dict(rtol=1e-9, atol=1e-12)
SEQ = 16


def test_ring_columns_load_balance():
    from pipeplan.backends.parallel.cp.ring import ring_columns

    # 8 chunks of 2 positions; rank r holds chunks r and 7 - r
    assert ring_columns(SEQ, 4, 0).tolist() == [0, 1, 14, 15]
    assert ring_columns(SEQ, 4, 2).tolist() == [4, 5, 10, 11]
    every = torch.cat([ring_columns(SEQ, 4, r) for r in range(4)])
    assert sorted(every.tolist()) == list(range(SEQ))


def _case(group, causal: bool, heads: int, kv_heads: int, scale, seed: int,
          seq: int = SEQ) -> None:
    from pipeplan.backends.parallel.cp.ring import ring_attention, ring_columns

    g = torch.Generator().manual_seed(seed)  # the same whole tensors on every rank
    q = torch.randn(2, heads, seq, 8, dtype=torch.float64, generator=g)
    k = torch.randn(2, kv_heads, seq, 8, dtype=torch.float64, generator=g)
    v = torch.randn(2, kv_heads, seq, 8, dtype=torch.float64, generator=g)
    dout = torch.randn(2, heads, seq, 8, dtype=torch.float64, generator=g)
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*whole, is_causal=causal, scale=scale,
                                         enable_gqa=kv_heads != heads)
    ref.backward(dout)

    cp = dist.get_world_size(group)
    cols = ring_columns(seq, cp, dist.get_rank(group))
    mine = [t[:, :, cols].clone().requires_grad_() for t in (q, k, v)]
    with CommMeter({"cp": group}) as meter:
        out = ring_attention(*mine, group, is_causal=causal, scale=scale)
        out.backward(dout[:, :, cols])
    label = f"cp={cp} causal={causal} heads={heads}/{kv_heads}"
    # K and V (KV heads only) hop cp-1 times forward and again backward, dK/dV cp-1 times
    kv = 2 * mine[1].numel() * 8
    assert meter.bytes == {("cp", "send"): 3 * (cp - 1) * kv}, (label, meter.bytes)
    assert meter.calls == {("cp", "send"): 3 * (cp - 1)}, (label, meter.calls)
    assert meter.calls[("cp", "send")] == _exchanges(cp, "ring")[0]  # the estimate's count
    torch.testing.assert_close(out, ref[:, :, cols], **TOL, msg=lambda m: f"{label}: out {m}")
    for name, got, want in zip("qkv", mine, whole):
        torch.testing.assert_close(got.grad, want.grad[:, :, cols], **TOL,
                                   msg=lambda m, name=name: f"{label}: d{name} {m}")


def _exchanges(cp: int, method: str) -> tuple[int, int, int]:
    """compiler/parallel/cp.py's count for one attention op: (calls, latencies F, B)."""
    from types import SimpleNamespace

    from pipeplan.compiler.parallel.cp import exchanges
    return exchanges(SimpleNamespace(mesh=SimpleNamespace(cp=cp),
                                     context=SimpleNamespace(method=method)))


def _ulysses_case(group, seed: int) -> None:
    """Ulysses' all-to-alls for one attention op, forward and backward: as many calls as
    the estimate counts (compiler/parallel/cp.py: exchanges), handed q, k, v and the
    output and their gradients whole (ulysses_traffic charges the (cp-1)/cp of each that
    leaves the rank), and the output equal to attention over the whole sequence."""
    from pipeplan.backends.parallel.cp.ulysses import UlyssesAttention

    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(2, 4, SEQ, 8, dtype=torch.float64, generator=g)
                     for _ in range(4))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    part = slice(rank * SEQ // cp, (rank + 1) * SEQ // cp)  # contiguous sequence slices
    mine = [t[:, :, part].clone().requires_grad_() for t in (q, k, v)]
    attention = UlyssesAttention(F.scaled_dot_product_attention, group)
    with CommMeter({"cp": group}) as meter:
        out = attention.local(*mine, is_causal=True)
        out.backward(dout[:, :, part])
    moved = 4 * mine[0].numel() * 8
    assert meter.calls == {("cp", "alltoall"): _exchanges(cp, "ulysses")[0]}, meter.calls
    assert meter.bytes == {("cp", "alltoall"): 2 * moved}, meter.bytes
    torch.testing.assert_close(out, ref[:, :, part], **TOL)


def _worker(rank, world):
    ring4 = dist.group.WORLD
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    ring2 = pairs[rank // 2]
    ring3 = dist.new_group([0, 1, 2])  # an odd ring (SEQ = 18: 6 chunks of 3)
    _case(ring4, causal=True, heads=4, kv_heads=2, scale=0.3, seed=1)
    _case(ring4, causal=False, heads=2, kv_heads=2, scale=None, seed=2)
    _case(ring2, causal=True, heads=4, kv_heads=1, scale=None, seed=3 + rank // 2)
    if rank < 3:
        _case(ring3, causal=True, heads=2, kv_heads=2, scale=None, seed=5, seq=18)
    _ulysses_case(ring4, seed=6)
    _ulysses_case(ring2, seed=7)


def test_ring_attention_equals_sdpa_on_the_whole_sequence(run_workers):
    run_workers(_worker, 4, timeout=120)


def test_ring_attention_refuses_other_devices():
    from pipeplan.backends.parallel.cp.ring import ring_attention
    from pipeplan.errors import PipeplanError

    q = torch.zeros(1, 1, 4, 2, device="meta")
    with pytest.raises(PipeplanError, match="use context { method = ulysses } there"):
        ring_attention(q, q, q, None, True)


# ------------------------------------------------- plan line and estimates (compile only)
def _ring_plan(*edits) -> str:
    from .test_context_parallel import PLAN

    text = PLAN.replace("method = ulysses", "method = ring")
    for edit in edits:
        assert edit[0] in text, edit
        text = text.replace(*edit)
    return text


def test_ring_estimates_count_the_hops_and_heads_do_not_limit_cp():
    from pipeplan.compiler import compile_plan
    from pipeplan.compiler.estimate.report import render_report, render_summary
    from pipeplan.dsl import parse_plan

    ring = compile_plan(parse_plan(_ring_plan(), "ring.plan"))
    ulysses = compile_plan(parse_plan(_ring_plan(("ring", "ulysses")), "u.plan"))
    # per attention op and microbatch a rank's K and V ([2 rows, 2 KV heads, 8 positions,
    # 8] float32 each) go cp-1 hops forward and backward, their gradients cp-1 hops:
    # 2 layers per stage, 2 microbatches
    kv = 2 * (2 * 2 * 8 * 8 * 4)
    per_op = (2 - 1) * (2 * kv + kv)
    for r in (0, 2):  # pp ranks 0 and 1
        est = ring.estimates.ranks[r]
        assert est.comm_bytes["cp"] == 2 * 2 * per_op
        assert est.collectives[("cp", "ring p2p")] == 2 * 2 * per_op
        # causal and load-balanced: its own block and cp-1 half blocks of the local
        # attention (4 * B * H * L * L * D FLOPs, forward + 2x backward), against Ulysses' cp
        sdpa = 4 * 2 * 4 * 8 * 8 * 8
        assert ulysses.estimates.ranks[r].flops - est.flops == 3 * 2 * 2 * 0.5 * sdpa
    assert "ring K/V and dK/dV hops per step per rank: pp rank 0 24.00 KiB" \
        in render_summary(ring), render_summary(ring)
    assert "| cp (context parallel (Ulysses all-to-all, ring K/V hops)) | ring p2p |" \
        in render_report(ring)
    # cp = 4 exceeds the 2 KV heads (Ulysses refuses it); the ring only needs 2*cp | seq_len
    four = compile_plan(parse_plan(_ring_plan(("cp = 2", "cp = 4")), "four.plan"))
    assert four.estimates.ranks[0].comm_bytes["cp"] == 2 * 2 * (4 - 1) * 3 * (kv // 2)


@pytest.mark.parametrize("edits, line, message", [
    ([("seq_len = 16", "seq_len = 14")], 6,
     r"ring attention with cp = 2 cuts each sequence into 2\*cp = 4 chunks, which do not "
     r"divide data.seq_len = 14"),
    ([("layers = 4 }", "layers = 4, dropout = 0.1 }")], 8,
     r"attention `.*` has dropout_p = 0.1; ring attention's blocks run without dropout"),
    # (a mask tensor the model computes from positions is rebuilt on the whole sequence:
    # tests/parallel/test_cp_masks.py)
    # attention to a learned memory: keys are not the sequence's positions
    ([('"pipeplan.tests.parallel.cp_models:RopeLM"', '"pipeplan.tests.parallel.cp_models:MemoryLM"'),
      ("dim = 32, heads = 4, kv_heads = 2, layers = 4", "dim = 32, heads = 4"),
      ("inputs { input_ids = int64[batch, seq], position_ids = int64[batch, seq] }", ""),
      (", inputs = { position_ids = positions }", "")], 8,
     r"attends from 8 to 4 positions per rank, not over its own sequence"),
])
def test_ring_plan_checks(edits, line, message):
    from pipeplan.compiler import compile_plan
    from pipeplan.dsl import PlanError, parse_plan

    with pytest.raises(PlanError, match=message) as err:
        compile_plan(parse_plan(_ring_plan(*edits), "plan.plan"))
    assert f"plan.plan:{line}:" in str(err.value), str(err.value)


# ------------------------------------------- pipelined training equals the reference
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_ring_transformers_llama_pp2_cp2_equals_reference(run_workers):
    """transformers' LlamaForCausalLM (RoPE from position_ids, GQA 4/2, SDPA with is_causal:
    cp_models.causal_llama), exported, pp2 x cp2 ring attention under 1f1b and zbv (split
    B/W backward: the ring's backward runs in B), 3 AdamW steps against the unmodified
    model on whole sequences (test_context_parallel.make_plan)."""
    run_workers(_metered_worker, 4, ["ring-llama-1f1b", "ring-llama-zbv"], timeout=880)


def _metered_worker(rank, world, names):
    """Equivalence, and the bytes each rank's ring sent over the 3 steps: per attention op
    and microbatch 3 (cp-1) times its K and V slices ([2 rows, 2 KV heads, 8 positions, 8]
    float64 each), 2 layers per stage and rank (1f1b) or per pair of stages (zbv), 2
    microbatches. Under zbv's split backward the ring's backward runs in B only: a W that
    reran it would send more."""
    from .pipelined_vs_reference import assert_trains_like_reference
    from .test_context_parallel import STEPS, _attention_wrapped, make_plan

    for name in names:
        meters = []

        def inspect(trainer):
            _attention_wrapped(trainer)
            meters.append(CommMeter({"cp": trainer.topo.cp_group}).__enter__())
        try:
            assert_trains_like_reference(make_plan(name), name, STEPS, inspect)
        finally:
            for meter in meters:
                meter.__exit__(None, None, None)
        kv = 2 * (2 * 2 * 8 * 8 * 8)
        on_cp = {key: n for key, n in meters[0].bytes.items() if key[0] == "cp"}
        assert on_cp == {("cp", "send"): STEPS * 2 * 2 * 3 * (2 - 1) * kv}, (name, on_cp)


@pytest.mark.heavy
@pytest.mark.timeout(1200)
def test_ring_with_dp_and_zero_equals_reference(run_workers):
    """RopeLM: pp2 x cp2 ring (1f1b, zbv), pp1 x dp2 x cp2 ZeRO-2, then pp2 x dp2 x cp2
    ZeRO-2 on 8 processes."""
    from .test_context_parallel import _worker

    run_workers(_worker, 4, ["ring-1f1b", "ring-zbv", "ring-zero2"], timeout=580)
    run_workers(_worker, 8, ["ring-pp2-dp2-zero2"], timeout=580)
