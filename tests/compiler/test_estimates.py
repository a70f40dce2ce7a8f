"""Estimates equal the same quantities computed by hand for a small configuration."""
from __future__ import annotations

import pytest

from pipeplan.compiler import compile_plan
from pipeplan.dsl.ast import InputSpec, MeshSpec, OptimizerSpec, TrainSpec

# Regressor(layers=4, dim=8) cut in two: each stage holds two Linear(8, 8) = 2 * (64 + 8) params
PARAMS_PER_STAGE = 2 * (8 * 8 + 8)
B, D, M = 2, 8, 4  # microbatch size (16 sequences / dp 2 / 4 microbatches), width, microbatches
ACT = 4 * B * D  # one [2, 8] fp32 activation


def _compile(make_plan, *, zero=0, precision="fp32", schedule="1f1b", optimizer="adamw"):
    plan = make_plan("tests/compiler/models.py:Regressor", {"layers": 4}, pp=2, loss="mse",
                     inputs=(InputSpec("x", "float32", ("batch", D)),), schedule=schedule,
                     microbatches=M, mesh=MeshSpec(pp=2, dp=2), zero=zero,
                     train=TrainSpec(global_batch=16, precision=precision,
                                     optimizer=OptimizerSpec(name=optimizer)))
    return compile_plan(plan)


@pytest.mark.parametrize("zero,precision,params,grads,optim", [
    (0, "fp32", 4 * PARAMS_PER_STAGE, 4 * PARAMS_PER_STAGE, 8 * PARAMS_PER_STAGE),
    (1, "fp32", 4 * PARAMS_PER_STAGE, 4 * PARAMS_PER_STAGE, 8 * PARAMS_PER_STAGE // 2),
    (2, "fp32", 4 * PARAMS_PER_STAGE, 4 * PARAMS_PER_STAGE // 2, 8 * PARAMS_PER_STAGE // 2),
    (3, "fp32", 4 * PARAMS_PER_STAGE // 2, 4 * PARAMS_PER_STAGE // 2, 8 * PARAMS_PER_STAGE // 2),
    (1, "bf16", 2 * PARAMS_PER_STAGE, 2 * PARAMS_PER_STAGE, 12 * PARAMS_PER_STAGE // 2),
])
def test_memory_by_zero_stage(make_plan, zero, precision, params, grads, optim):
    est = _compile(make_plan, zero=zero, precision=precision).estimates
    assert len(est.ranks) == 4  # pp 2 x dp 2
    for r in est.ranks:
        assert (r.param_bytes, r.grad_bytes, r.optimizer_bytes) == (params, grads, optim)


def test_sgd_without_momentum_keeps_no_state(make_plan):
    est = _compile(make_plan, optimizer="sgd").estimates
    assert all(r.optimizer_bytes == 0 for r in est.ranks)


def test_activations_by_schedule(make_plan):
    # stage 0 saves both Linear inputs (2 ACT); stage 1 its two Linear inputs and mse's
    # prediction and target (4 ACT)
    one_f_one_b = _compile(make_plan, schedule="1f1b")
    assert [s.activation_bytes for s in one_f_one_b.stages] == [2 * ACT, 4 * ACT]
    # 1F1B holds min(m, p - r) microbatches on rank r: 2 on rank 0, 1 on rank 1
    by_pp = [one_f_one_b.estimates.ranks[2 * r].activation_bytes for r in range(2)]
    assert by_pp == [2 * 2 * ACT, 1 * 4 * ACT]
    # GPipe holds all m microbatches
    gpipe = _compile(make_plan, schedule="gpipe")
    assert [gpipe.estimates.ranks[2 * r].activation_bytes for r in range(2)] == \
        [M * 2 * ACT, M * 4 * ACT]


def test_traffic_and_flops(make_plan):
    est = _compile(make_plan).estimates
    r0, r1 = est.ranks[0], est.ranks[2]
    assert r0.comm_bytes["p2p"] == M * ACT  # activations forward
    assert r1.comm_bytes["p2p"] == M * ACT  # their grads back
    assert r0.comm_bytes["dp"] == 2 * (2 - 1) / 2 * 4 * PARAMS_PER_STAGE  # ring all-reduce
    assert r0.comm_bytes["tp"] == r0.comm_bytes["ep"] == 0
    fwd = 2 * (2 * B * D * D)  # two Linear layers, 2 FLOPs per multiply-add
    assert r0.flops == 3 * fwd * M  # forward + backward (2x) for every microbatch
    assert 0 < est.bubble < 1 and est.step_time_s > 0
