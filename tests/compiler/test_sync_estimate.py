"""The DiLoCo estimate: cross-island bytes and step time against every-step DP, by hand."""
from __future__ import annotations

import pytest

from pipeplan.compiler import compile_plan
from pipeplan.compiler.estimate.report import render_summary
from pipeplan.dsl.ast import DeviceSpec, InputSpec, MeshSpec, SyncSpec, TrainSpec

# Regressor(layers=4, dim=8) in two stages of two Linear(8, 8): 2 * (64 + 8) fp32 params each
PARAMS_PER_STAGE = 2 * (8 * 8 + 8)


def _compile(make_plan, sync: SyncSpec, virtual: int = 1):
    plan = make_plan("tests/compiler/models.py:Regressor", {"layers": 4}, pp=2, loss="mse",
                     inputs=(InputSpec("x", "float32", ("batch", 8)),), microbatches=4,
                     schedule="interleaved" if virtual > 1 else "1f1b", virtual=virtual,
                     mesh=MeshSpec(pp=2, dp=2), sync=sync,
                     train=TrainSpec(steps=20, global_batch=16),
                     device=DeviceSpec("h100", ranks_per_node=1))  # one rank a node: the step by
    # the timeline (the measured CPU's shared cores add a floor: test_estimates.py)
    return compile_plan(plan)


def test_diloco_sends_h_times_fewer_bytes_and_saves_the_dp_time(make_plan):
    every = _compile(make_plan, SyncSpec()).estimates
    compiled = _compile(make_plan, SyncSpec("diloco", inner_steps=4))
    diloco = compiled.estimates
    ring = 2 * (2 - 1) / 2 * 4 * PARAMS_PER_STAGE  # fp32 grads, dp = 2
    assert [r.comm_bytes["dp"] for r in every.ranks] == [ring] * 4
    assert [r.comm_bytes["dp"] for r in diloco.ranks] == [ring / 4] * 4
    s = diloco.sync
    assert (s.every_step_dp_bytes, s.dp_bytes_per_step, s.peak_sync_bytes) == \
        (ring, ring / 4, ring)
    link = every.device_model["link_bytes_per_s"]  # dp groups across nodes by default
    makespan = every.simulation.makespan
    assert s.every_step_time_s == pytest.approx(every.step_time_s)
    # the loss all-reduce over the island (its 2 pipeline ranks: 2 ring steps of a float64),
    # then the optimizer (the same pass on every rank: equal stages) and the outer sync
    # after the step, H times fewer bytes, nothing hidden
    opt = {r.optimizer for r in diloco.prediction.ranks}
    assert len(opt) == 1
    loss = 2 * diloco.device_model["latency_s"] + 8 / link
    assert s.step_time_s == pytest.approx(makespan + loss + ring / 4 / link + opt.pop())
    assert diloco.step_time_s == pytest.approx(s.step_time_s)
    assert "sync: diloco(H=4, K=1)" in render_summary(compiled)


def test_streaming_halves_a_rank_peak_when_it_holds_both_fragments(make_plan):
    # interleaved, 4 stages on 2 ranks: rank 0 holds stages 0 and 2 (fragments 0 and 1)
    e = _compile(make_plan, SyncSpec("diloco", inner_steps=4, fragments=2), virtual=2).estimates
    assert e.sync.peak_sync_bytes == e.sync.every_step_dp_bytes // 2


@pytest.mark.parametrize("tp", [2, 4])
def test_diloco_with_ep_inside_islands_counts_each_rank_expert_shard(make_plan, tp):
    """pp1 x dp2 x tp x ep2 islands: a rank's pseudo-gradient is its own share, attention
    q/k/v/proj TP slices and half of every layer's experts, averaged over the other island
    (dp = 2), per sync; with tp = 4 the island holds each expert twice and sums those
    gradients every step, inside the island ("edp"). By hand for MoEGPT(vocab 64, dim 32,
    2 layers, 4 experts)."""
    from pipeplan.dsl.ast import ExpertsSpec, TensorSpec

    args = {"vocab": 64, "dim": 32, "layers": 2, "heads": 4, "seq_len": 8, "num_experts": 4,
            "top_k": 2}
    plan = make_plan("pipeplan.examples.models.moe_gpt:MoEGPT", args, pp=1, seq_len=8,
                     microbatches=2, mesh=MeshSpec(dp=2, tp=tp, ep=2),
                     experts=ExpertsSpec(modules=("layers.*.moe",), num_experts=4, top_k=2),
                     tensor=TensorSpec(column=("layers.*.attn.q", "layers.*.attn.k",
                                               "layers.*.attn.v"),
                                       row=("layers.*.attn.proj",)),
                     sync=SyncSpec("diloco", inner_steps=5), train=TrainSpec(steps=20))
    assert plan.mesh.islands
    experts = 2 * 4 * 32 * 64 // 2  # w_up, w_down: 2 of the 4 experts
    layer = (2 * 32  # ln1
             + 3 * (32 * 32 + 32) // tp  # q, k, v: column slices, biases with them
             + 32 * 32 // tp + 32  # proj: row slice, its bias whole
             + 2 * 32 + 4 * 32 + experts)  # ln2, router
    local = 64 * 32 + 8 * 32 + 2 * layer + 2 * 32  # embeddings (the head tied), ln_f
    ring = 2 * (2 - 1) / 2 * 4 * local
    e = compile_plan(plan).estimates
    assert [r.comm_bytes["dp"] for r in e.ranks] == [int(ring / 5)] * (2 * tp)
    assert e.sync.every_step_dp_bytes == ring
    inside = [r.comm_bytes.get("edp", 0) for r in e.ranks]  # ring over tp / ep = 2 replicas
    assert inside == [0 if tp == 2 else 2 * (2 - 1) / 2 * 4 * 2 * experts] * (2 * tp)
