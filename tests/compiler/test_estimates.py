"""Estimates equal the same quantities computed by hand for a small configuration."""
from __future__ import annotations

import time

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


# AdamW's float32 step counter: one per tensor it steps: the 4 parameters of a stage at
# ZeRO-0 (the plain optimizer), the stage's one flat shard at ZeRO 1-3.
@pytest.mark.parametrize("zero,precision,params,grads,optim", [
    (0, "fp32", 4 * PARAMS_PER_STAGE, 4 * PARAMS_PER_STAGE, 8 * PARAMS_PER_STAGE + 4 * 4),
    (1, "fp32", 4 * PARAMS_PER_STAGE, 4 * PARAMS_PER_STAGE, 8 * PARAMS_PER_STAGE // 2 + 4),
    (2, "fp32", 4 * PARAMS_PER_STAGE, 4 * PARAMS_PER_STAGE // 2, 8 * PARAMS_PER_STAGE // 2 + 4),
    (3, "fp32", 4 * PARAMS_PER_STAGE // 2, 4 * PARAMS_PER_STAGE // 2,
     8 * PARAMS_PER_STAGE // 2 + 4),
    # bf16 is autocast over fp32 master weights: the states stay fp32
    (1, "bf16", 4 * PARAMS_PER_STAGE, 4 * PARAMS_PER_STAGE, 8 * PARAMS_PER_STAGE // 2 + 4),
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


def test_tensor_parallel_traffic_and_shards(make_plan):
    """GPT blocks with Megatron's pairing: per layer, two column groups (q/k/v read ln1's
    output, up reads ln2's) all-reduce their input grads, two row layers their outputs."""
    from pipeplan.dsl.ast import TensorSpec
    b, t, d, layers, m, tp = 2, 16, 32, 2, 2, 2
    tensor = TensorSpec(column=("layers.*.attn.q", "layers.*.attn.k", "layers.*.attn.v",
                                "layers.*.mlp.up"),
                        row=("layers.*.attn.proj", "layers.*.mlp.down"))
    args = {"vocab": 64, "dim": d, "layers": layers, "heads": 4, "seq_len": t}
    plain = compile_plan(make_plan("examples/models/gpt.py:GPT", args, pp=1, microbatches=m,
                                   global_batch=b * m))
    split = compile_plan(make_plan("examples/models/gpt.py:GPT", args, pp=1, microbatches=m,
                                   global_batch=b * m, mesh=MeshSpec(tp=tp), tensor=tensor))
    activation = b * t * d * 4
    ring = 2 * (tp - 1) / tp
    assert split.estimates.ranks[0].comm_bytes["tp"] == layers * 4 * activation * ring * m
    # the annotated weights are halved; so are the column biases (row biases are replicated)
    q_k_v, up = 3 * (d * d + d), d * 4 * d + 4 * d
    proj, down = d * d, 4 * d * d  # weights only
    sharded = layers * (q_k_v + up + proj + down)
    assert plain.estimates.ranks[0].param_bytes - split.estimates.ranks[0].param_bytes == \
        4 * sharded // 2
    assert len(split.estimates.ranks) == tp
    assert split.tp_rewrites["layers.1.mlp.down"] == "row"


def test_expert_parallel_traffic_and_shards(make_plan):
    from pipeplan.dsl.ast import ExpertsSpec
    b, t, d, layers, m, ep, k, e = 2, 16, 32, 2, 2, 2, 2, 4
    args = {"vocab": 64, "dim": d, "layers": layers, "heads": 4, "seq_len": t,
            "num_experts": e, "top_k": k}
    experts = ExpertsSpec(modules=("layers.*.moe",), num_experts=e, top_k=k)
    base = dict(pp=1, microbatches=m, global_batch=2 * b * m, experts=experts)
    one = compile_plan(make_plan("examples/models/moe_gpt.py:MoEGPT", args,
                                 mesh=MeshSpec(dp=2), **base))
    two = compile_plan(make_plan("examples/models/moe_gpt.py:MoEGPT", args,
                                 mesh=MeshSpec(dp=2, ep=ep), **base))
    tokens = b * t * d * 4  # one MoE layer's input per microbatch
    weights = b * t * k * 4  # its top-k weights, moved along (out, and the gradient back)
    assert two.estimates.ranks[0].comm_bytes["ep"] == \
        layers * (4 * k * tokens + 2 * weights) * (ep - 1) / ep * m
    assert one.estimates.ranks[0].comm_bytes["ep"] == 0
    expert_weights = layers * 2 * e * d * (2 * d) * 4  # w_up and w_down, fp32
    assert one.estimates.ranks[0].param_bytes - two.estimates.ranks[0].param_bytes == \
        expert_weights // ep


def test_zero_layout_groups_a_ranks_parameters_as_the_runtime():
    """Per stage one shard per kind; a weight two stages hold (tied, V schedule) lives in
    the first stage's shard and both stages use it."""
    from pipeplan.compiler.parallel.zero import (EXPERT, REPLICATED, TENSOR_PARALLEL, ShardGroup, group_shards)
    shards, uses = group_shards([
        (3, [("emb", TENSOR_PARALLEL), ("head_norm", REPLICATED)]),
        (0, [("emb", TENSOR_PARALLEL), ("w_up", EXPERT), ("ln", REPLICATED)]),
    ])
    assert shards == [ShardGroup(0, REPLICATED, ("ln",)), ShardGroup(0, TENSOR_PARALLEL, ("emb",)),
                      ShardGroup(0, EXPERT, ("w_up",)), ShardGroup(3, REPLICATED, ("head_norm",))]
    assert uses == {0: [1, 2, 0], 3: [1, 3]}


def test_shard_memory_pads_to_the_group_and_counts_step_counters():
    from pipeplan.compiler.parallel.zero import MemoryBytes, StateBytes, shard_memory
    # 10 elements over 4 ranks: padded to 12, 3 per rank
    assert shard_memory(10, 4, 1) == MemoryBytes(48, 48, 8 * 3 + 4)
    assert shard_memory(10, 4, 3) == MemoryBytes(12, 12, 8 * 3 + 4)
    # ZeRO-0 with a plain optimizer: no padding, a step counter per parameter tensor
    assert shard_memory(10, 4, 0, tensors=3) == MemoryBytes(40, 40, 80 + 12)
    assert shard_memory(10, 4, 2, StateBytes.of("sgd", momentum=True)) == MemoryBytes(48, 12, 12)
    assert StateBytes.of("adamw") == StateBytes(4, 4, 8, 4)


# ------------------------------------------------------------------ device model
FWD = 4 * (2 * B * D * D)  # Regressor(layers=4, dim=8): four Linear(8, 8) per microbatch


def _one_stage(make_plan, device, dp=1):
    from pipeplan.dsl.ast import MeshSpec as Mesh
    return make_plan("tests/compiler/models.py:Regressor", {"layers": 4}, pp=1, loss="mse",
                     inputs=(InputSpec("x", "float32", ("batch", D)),), microbatches=M,
                     mesh=Mesh(pp=1, dp=dp), train=TrainSpec(global_batch=dp * M * B),
                     device=device)


FREE_MEMORY = 1e30  # a device whose memory traffic costs nothing: only FLOPs take time


def _gemm_peak() -> float:
    import json

    from pipeplan.compiler.estimate.devices import calibration_path
    with open(calibration_path(), encoding="utf-8") as f:
        return json.load(f)["a100"]["gemm_peak"]


def test_step_time_follows_the_plans_device_model(make_plan):
    """One stage, one rank: the step is m microbatches of F + B + W = 3 forwards of GEMMs at
    the peak the plan writes times the fitted GEMM fraction (calibration.json); memory is
    made free and no link is used."""
    from pipeplan.dsl.ast import DeviceSpec
    for flops in (100e12, 1e12, 3e9):
        device = DeviceSpec(name="a100", flops=flops, memory_bandwidth=FREE_MEMORY)
        compiled = compile_plan(_one_stage(make_plan, device))
        assert compiled.stages[0].flops == FWD
        est = compiled.estimates
        assert est.step_time_s == pytest.approx(M * 3 * FWD / (flops * _gemm_peak()),
                                                rel=1e-9)
        assert est.device_model["flops_per_s"] == flops
        assert est.device_model["origin"].startswith("profile a100")
        assert "plan device section" in est.device_model["origin"]


def test_dp_all_reduce_uses_the_link_its_group_sits_on(make_plan):
    """dp = 2 all-reduces the 4 layers' fp32 grads: a ring sends 2(n-1)/n of them (in one
    bucket: 2(n-1) message latencies) when the
    one stage's last backward ends (nothing left to overlap: all exposed), over the network
    unless both ranks share a node (the profile's 8 per node unless the plan says), NVLink
    at the fitted fraction collectives get."""
    import json

    from pipeplan.compiler.estimate.devices import calibration_path
    from pipeplan.dsl.ast import DeviceSpec
    with open(calibration_path(), encoding="utf-8") as f:
        nvlink = 400e9 * json.load(f)["a100"]["link"]
    grads = 4 * 4 * (D * D + D)
    sent = 2 * (2 - 1) / 2 * grads
    for ranks_per_node, link in ((None, nvlink), (1, 20e9), (2, nvlink), (8, nvlink)):
        device = DeviceSpec(name="a100", intra_node=400e9, inter_node=20e9,
                            ranks_per_node=ranks_per_node, memory_bandwidth=FREE_MEMORY)
        est = compile_plan(_one_stage(make_plan, device, dp=2)).estimates
        assert est.ranks[0].comm_bytes["dp"] == sent
        # one bucket: a ring all-reduce over 2 ranks waits 2(n - 1) = 2 message latencies
        latency = est.device_model["latency_s"]
        assert latency > 0
        assert est.step_time_s - est.simulation.makespan == \
            pytest.approx(sent / link + 2 * latency, rel=1e-9)


def test_flags_override_the_plan_and_the_report_says_so(make_plan):
    from pipeplan.compiler import device_model
    from pipeplan.compiler.estimate.report import render_summary
    from pipeplan.dsl.ast import DeviceSpec
    plan = _one_stage(make_plan, DeviceSpec(name="a100", flops=100e12, inter_node=20e9,
                                            memory_bandwidth=FREE_MEMORY))
    model = device_model(plan, tflops=10)
    assert (model.flops_per_s, model.link_bytes_per_s) == (10e12, 20e9)
    assert model.origin.endswith("overridden by --tflops")
    compiled = compile_plan(plan, device=model)
    assert compiled.estimates.step_time_s == pytest.approx(M * 3 * FWD / (10e12 * _gemm_peak()),
                                                           rel=1e-9)
    assert "overridden by --tflops" in render_summary(compiled)
    # no device given: the plan's own model is used
    assert compile_plan(plan).estimates.device_model["flops_per_s"] == 100e12


def test_unknown_device_is_refused_at_its_line(make_plan):
    from pipeplan.dsl.ast import DeviceSpec
    from pipeplan.dsl.errors import PlanError
    with pytest.raises(PlanError) as info:
        compile_plan(_one_stage(make_plan, DeviceSpec(name="h101")))
    assert "unknown device 'h101'" in str(info.value) and "did you mean 'h100'" in str(info.value)

def test_ranks_on_one_machine_run_at_their_fair_share_and_resume_each_action(
        make_plan, tmp_path, monkeypatch):
    """The local launcher starts every rank on this machine: each rank runs at its speed
    alone x max(1, busy ranks / cores) (posting measured once per rank count, cached), busy
    ranks being how many compute at once on the simulated timeline while one does; where
    the ranks outnumber the cores each action pays the measured resume of its core (at the
    shared speeds); the origin says so; a device section is taken as written."""
    import importlib

    import torch

    from pipeplan.compiler.estimate import cpu_probe
    from pipeplan.dsl.ast import DeviceSpec
    dm = importlib.import_module("pipeplan.compiler.estimate.device")  # the module, not the function
    if torch.cuda.is_available():
        pytest.skip("the CPU model applies only where CUDA is not available")
    monkeypatch.setenv("PIPEPLAN_CACHE", str(tmp_path))
    monkeypatch.setattr(dm, "cores", lambda: 1)
    asked = []
    monkeypatch.setattr(cpu_probe, "measure_sharing", lambda n: asked.append(n) or 1e-4)
    own = dm.device_model(_one_stage(make_plan, DeviceSpec()))  # 1 rank: nothing shared
    assert own.sharing is None and own.shared(1.0) is own and asked == []
    alone = dm.device_model(_one_stage(make_plan, DeviceSpec(), dp=2))
    assert asked == [2] and alone.flops_per_s == own.flops_per_s  # speeds alone ...
    assert (alone.sharing.ranks, alone.sharing.cores, alone.sharing.replicas) == (2, 1, 2)
    assert alone.sharing.resume  # 2 ranks on 1 core
    assert alone.hardware.post_s == pytest.approx(1e-4)  # posting, as measured shared
    resume = alone.hardware.resume_s
    assert resume > 0  # measured (the probe pins two processes to one core)
    for busy, k in ((1.0, 2.0), (0.75, 1.5), (0.4, 1.0)):  # x 2 replicas on 1 core
        shared = alone.shared(busy)
        assert shared.flops_per_s == pytest.approx(own.flops_per_s / k)
        assert shared.hardware.memory_bandwidth == pytest.approx(
            own.hardware.memory_bandwidth / k)
        assert shared.op_s == pytest.approx(own.op_s * k)
        assert shared.link_bytes_per_s == pytest.approx(own.link_bytes_per_s / k)
        assert shared.latency_s == pytest.approx(own.latency_s * k)
        assert shared.hardware.post_s == pytest.approx(1e-4 * max(1.0, 2 * busy))  # waits
        assert shared.hardware.resume_s == pytest.approx(resume * k)
        assert "2 ranks share 1 cores" in shared.origin and f"{k:.3g}x slower" in shared.origin
        assert f"each action {resume * 1e6:.0f} us more" in shared.origin
    compiled = compile_plan(_one_stage(make_plan, DeviceSpec(), dp=2))
    busy = compiled.estimates.simulation.concurrency  # one pipeline rank: 1
    assert busy == pytest.approx(1.0)  # ... in each of 2 replicas: 2 on 1 core
    assert compiled.estimates.device_model["flops_per_s"] == pytest.approx(
        own.flops_per_s / 2)
    dm.device_model(_one_stage(make_plan, DeviceSpec(), dp=2))
    assert asked == [2]  # cached
    written = dm.device_model(_one_stage(make_plan, DeviceSpec(flops=1e12), dp=2))
    assert (written.flops_per_s, written.op_s, written.sharing) == (1e12, 0.0, None)


def test_the_sharing_probe_sees_an_oversubscribed_machine():
    """Twice as many processes as cores in the ring of handoffs: a round (every process's
    block, then the handoffs) takes clearly longer on the wall than one process's block
    alone (twice at least on a quiet machine: 2 x cores blocks on the cores; a loaded
    machine slows the one-process baseline too, so the bound is loose) while a block's CPU
    time stays near alone's (the fair share is waiting, not computing); posting a transfer
    costs host time; and a pair's small all-reduce with the others busy is measured (a
    wait of the scheduler's order). Not "longer than idle": since the idle latency is taken
    after 10 ms of idle (measure_link), it includes waking an idle vCPU, which busy
    processes spare the pair (0.27 ms loaded against 0.39 idle here); the model charges
    the larger of the two (Sharing.message_latency)."""
    from pipeplan.compiler.estimate.cpu_probe import (measure_link, measure_loaded_latency,
                                                      measure_sharing, ring_slowdown)
    from pipeplan.compiler.estimate.device import cores
    assert measure_sharing(1) == 0.0
    cpu, wall, post = ring_slowdown(2 * cores())
    assert wall >= 1.4 and 0.8 < cpu < wall and 1e-6 < post < 1e-2, (cpu, wall, post)
    idle, _, behind, sent = measure_link()
    assert 1e-6 < idle < 0.05 and 1e-6 < measure_loaded_latency(2 * cores() + 2) < 0.05
    assert 1e-6 < behind < 1e-2 and 0 <= sent < 1e-2, (behind, sent)  # gloo's threads' CPU


def test_ranks_sharing_the_cores_take_no_less_than_their_cpu_seconds_over_the_cores():
    """predict.shared_floor on a hand-built step: 2 pipeline ranks in 2 replicas on 1 core,
    the timeline saying 0.5 of each replica's ranks busy at once (fair share 1: the speeds
    as alone; the serial timeline, 6 s, never has both replicas' ranks on the core at
    once in its own account). CPU seconds at the shared
    speeds: rank 0 F 1 - 0.5 waiting + BW 2 - 0.5, rank 1 1 + 2; 4 posted transfers x 0.1;
    the stages' once-a-step collectives 2 + 3 ring steps x 0.01; optimizers 0.2 + 0.3:
    5.95, x 2 replicas / (1 x 1 core). The step is the floor where the timeline is
    shorter (the rest counted as bubble), and the timeline where it is longer; a device
    not shared has no floor."""
    import dataclasses

    from pipeplan.compiler.estimate.device import DeviceModel, Sharing
    from pipeplan.compiler.estimate.devices import cpu_profile
    from pipeplan.compiler.estimate.optime import OpTimes
    from pipeplan.compiler.estimate.predict import breakdown, shared_floor, waiting_of
    from pipeplan.schedules import Action, Costs, Schedule, simulate
    order = ((Action("F", 0, 0), Action("BW", 0, 0)), (Action("F", 1, 0), Action("BW", 1, 0)))
    sched = Schedule("custom", 2, 2, 1, (0, 1), order)
    costs = Costs(per_stage=((1.0, 2.0, 0.0), (1.0, 2.0, 0.0)),
                  waiting=((0.5, 0.5, 0.0), (0.0, 0.0, 0.0)))
    hw = cpu_profile(1e9, 0.0, 0.0, behind=(0.01, 0.1))
    shared = DeviceModel(hardware=hw, shared_at=(Sharing(4, 1, replicas=2), 0.5))
    floor = shared_floor(sched, costs, shared, [2, 3], [0, 0], [0.2, 0.3])
    assert floor == pytest.approx(5.95 * 2 / (1 * 1))
    assert shared_floor(sched, costs, dataclasses.replace(shared, shared_at=None), [2, 3],
                        [0, 0], [0.2, 0.3]) == 0.0
    sim = simulate(sched, costs)
    ops = [OpTimes(1.0, 1.0, 1.0)] * 2
    step, ranks = breakdown(sched, sim, ops, costs, [0.0, 0.0], [0.2, 0.3], floor=floor)
    assert sim.makespan + 0.3 < floor and step == pytest.approx(floor)
    assert all(r.compute + r.comm + r.bubble + r.optimizer == pytest.approx(step) for r in ranks)
    step, _ = breakdown(sched, sim, ops, costs, [0.0, 0.0], [0.2, 0.3], floor=1.0)
    # the timeline's: rank 0 ends last; every rank waits for it (the loss all-reduce), then
    # its optimizer: rank 1's 0.3
    assert step == pytest.approx(6.0 + 0.3)
    # waiting: a collective's seconds less gloo's own threads' CPU per ring step, >= 0:
    # an F all-reduce of 2 ranks (2 steps) and 2 exchange messages (0.5 s each); B one
    # all-reduce and the forward's again (4 steps of 0.2 s of CPU: more than its seconds)
    device = dataclasses.replace(shared, latency_s=0.5, hardware=dataclasses.replace(
        hw, collective_cpu_s=0.2))
    calls = [("allreduce", 8, "F"), ("allreduce", 8, "B")]
    assert waiting_of(calls, 2, (1.5, 0.3), (1.0, 0.0), 0.2, device, calls[:1]) == \
        pytest.approx((2.5 - 4 * 0.2, 0.0, 0.0))
    # B of 0.6 s: its own all-reduce's 2 steps off; a full recompute's rerun of the F
    # all-reduce (0.3 s, `again_calls`) adds its seconds and its 2 steps
    assert waiting_of(calls, 2, (1.5, 0.6), (1.0, 0.0), 0.0, device) == pytest.approx(
        (1.7, 0.6 - 2 * 0.2, 0.0))
    assert waiting_of(calls, 2, (1.5, 0.6), (1.0, 0.0), 0.3, device, calls[:1]) == \
        pytest.approx((1.7, 0.9 - 4 * 0.2, 0.0))


def test_shared_speeds_settle_to_the_busy_count_of_their_own_timeline(monkeypatch):
    """Busy ranks and shared speeds depend on each other where collectives wait inside
    actions (the hybrid example: tp = 2 on this CPU's measured model): the compiled plan's
    speeds are those of the busy count its own final timeline gives (device.SHARING_ROUNDS;
    one round was 34% off on the example, three 2.5%), and that count leaves out the collectives'
    waits (less than if every action computed all along)."""
    import dataclasses

    import torch

    from pipeplan.compiler.estimate.device import device_model
    from pipeplan.dsl import load_plan
    from pipeplan.schedules import Costs
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the measured CPU's model
    compiled = compile_plan(load_plan("examples/hybrid_pp2_dp2_tp2.plan"))
    sim = compiled.estimates.simulation
    alone = device_model(compiled.plan)
    assert alone.sharing is not None
    again = alone.shared(sim.concurrency)
    assert compiled.estimates.device_model["flops_per_s"] == pytest.approx(
        again.flops_per_s, rel=0.01)
    assert any(w > 0 for ws in sim.costs.waiting for w in ws)
    computing = dataclasses.replace(sim, costs=Costs(per_stage=sim.costs.per_stage))
    assert sim.concurrency < computing.concurrency


def test_no_device_section_on_cpu_uses_a_measured_cached_cpu_model(make_plan, tmp_path,
                                                                   monkeypatch):
    """Without a device section (and no CUDA) the estimate assumes this CPU's measured matmul
    FLOP/s and host time per op, not a 400 TFLOP/s accelerator; the probe runs once and is
    cached. The op count is the one torch dispatches running the model on CPU (counted here
    by a dispatch mode of the test's own), the loss included."""
    import json

    import torch
    import torch.nn.functional as F
    from torch.utils._python_dispatch import TorchDispatchMode

    from pipeplan.tests.compiler.models import Regressor

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))

    from pipeplan.compiler.estimate import cpu_probe
    from pipeplan.dsl.ast import DeviceSpec
    if torch.cuda.is_available():
        pytest.skip("the CPU model applies only where CUDA is not available")
    monkeypatch.setenv("PIPEPLAN_CACHE", str(tmp_path))
    compiled = compile_plan(_one_stage(make_plan, DeviceSpec()))
    bare = compiled.estimates
    cached = json.loads((tmp_path / "cpu_flops.json").read_text())
    assert bare.device_model["flops_per_s"] == cached["flops_per_s"]
    assert 1e8 < cached["flops_per_s"] < 1e13  # a CPU, not the 400e12 default
    assert 1e-8 < cached["op_s"] < 1e-3 and 1e-8 < cached["op_backward_s"] < 1e-3
    # DTensor's dispatch per op (eager tp), forward and backward: measured, a host cost
    assert 1e-8 < cached["dtensor_op_s"] < 1e-2 and 1e-8 < cached["dtensor_op_backward_s"] < 1e-2
    assert 1e8 < cached["bytes_per_s"] < 1e13
    assert 0 < cached["link_latency_s"] < 1e-2 and 1e6 < cached["link_bytes_per_s"] < 1e13
    assert bare.device_model["link_bytes_per_s"] == cached["link_bytes_per_s"]  # gloo, measured
    assert bare.device_model["origin"].startswith("measured CPU model")
    model, x, y = Regressor(D, 4), torch.randn(B, D), torch.randn(B, D)
    with Count() as count:  # 4 x (t, addmm) + mse_loss
        F.mse_loss(model(x), y)
    assert compiled.stages[0].ops == count.n
    host = count.n * (cached["op_s"] + cached["op_backward_s"])  # forward + backward
    bw = cached["bytes_per_s"]
    linear = max(2 * B * D * D / cached["flops_per_s"], 4 * (2 * B * D + D * D) / bw)  # roofline
    # forward: mse reads two [B, D] inputs and writes a scalar; backward twice that
    memory = 4 * (2 * B * D + 1) / bw
    # AdamW's step once per step: fp32 weights read and written, gradients read, both
    # moments read and written
    optimizer = 4 * (D * D + D) * 4 * (2 + 1 + 2 * 2) / bw
    # ... and on the host its ops, a step's and each of the 8 parameters' (counted here on
    # the runtime's own optimizer)
    from pipeplan.backends.runtime.optim import build_optimizer
    opt = build_optimizer(list(model.parameters()), compiled.plan.train)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    with Count() as stepped:
        opt.step()
    optimizer += stepped.n * cached["op_s"]
    assert bare.step_time_s == pytest.approx(M * (3 * 4 * linear + 3 * memory + host)
                                             + optimizer, rel=1e-9)

    def no_probe():
        raise AssertionError("probed again despite the cache")
    monkeypatch.setattr(cpu_probe, "measure_flops", no_probe)
    threads = torch.get_num_threads()  # a rank's thread setting does not change the model
    torch.set_num_threads(1 if threads > 1 else 2)
    try:
        again = compile_plan(_one_stage(make_plan, DeviceSpec())).estimates
    finally:
        torch.set_num_threads(threads)
    assert again.device_model["flops_per_s"] == cached["flops_per_s"]
    assert "cached in" in again.device_model["origin"]


def test_a_message_waits_for_the_scheduler_as_busy_ranks_outnumber_the_cores():
    """8 ranks on 2 cores, an idle pair's message 0.1 ms, 4 ms measured with all 8 busy: with
    2 busy the idle latency, with all 8 the loaded one, half-way at 5 busy; never less than
    the idle latency slowed like the compute."""
    from pipeplan.compiler.estimate.device import Sharing
    s = Sharing(ranks=8, cores=2, replicas=4, latency=1e-4, loaded_latency=4e-3)
    assert s.message_latency(2 / 4) == pytest.approx(1e-4)
    assert s.message_latency(8 / 4) == pytest.approx(4e-3)
    assert s.message_latency(5 / 4) == pytest.approx(1e-4 + 0.5 * (4e-3 - 1e-4))
    quiet = Sharing(ranks=8, cores=2, replicas=4, latency=1e-4, loaded_latency=1e-4)
    assert quiet.message_latency(2.0) == pytest.approx(4e-4)  # x the compute's factor 4


def test_a_rank_in_a_process_group_can_probe_the_cpu():
    """The first compile on a machine may run in a rank that already joined its default
    process group (a worker, a torchrun rank): the probe's gloo pairs then start in fresh
    interpreters (a forked child would inherit the group and fail to start its own), and
    the measurement completes."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    rank = ctx.Process(target=_probe_in_a_group, args=(results,))
    rank.start()
    try:
        got = results.get(timeout=240)
    finally:
        rank.join(timeout=60)
        if rank.is_alive():
            rank.kill()
    assert isinstance(got, tuple), got  # not an error's text
    latency, bandwidth, behind, sent = got
    assert 0 < latency < 1e-2 and bandwidth > 1e6 and behind > 0 and sent >= 0


def _probe_in_a_group(results) -> None:
    import socket

    import torch.distributed as dist

    from pipeplan.compiler.estimate.cpu_probe import measure_link
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, 1, True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        results.put(measure_link())
    except Exception as e:  # noqa: BLE001 -- the test reports it
        results.put(f"{type(e).__name__}: {e}")
    finally:
        dist.destroy_process_group()


def test_one_slow_run_moves_no_probe_that_repeats(monkeypatch):
    """The probes a busy moment moved most are repeated and their median kept: the op-time
    blocks (cpu_probe.probe_blocks: each block the median of PROBE_RUNS runs taken in
    turn; fit_host solves two unknowns from the two exactly) and DTensor's pairs of
    processes (measure_dtensor: per number, the median over DTENSOR_PAIRS pairs of the
    slower process's). One run three times slower changes neither."""
    from pipeplan.compiler.estimate import cpu_probe
    calls = iter(range(100))

    def run_block(width, tokens, blocks):
        k = next(calls)
        slow = 3.0 if k == 2 else 1.0  # the second run of the first block
        return cpu_probe.BlockRun(width, (), float(tokens), width * 1e-3 * slow,
                                  width * 2e-3 * slow)
    monkeypatch.setattr(cpu_probe, "run_block", run_block)
    monkeypatch.setattr(cpu_probe, "PROBE_RUNS", 3)
    small, large = cpu_probe.probe_blocks()
    assert (small.forward_s, small.backward_s) == pytest.approx((8e-3, 16e-3))
    assert (large.forward_s, large.backward_s) == pytest.approx((32e-3, 64e-3))
    pairs = iter([[(1e-5, 2e-5, 3e-5, 4e-5, 5e-4), (2e-5, 1e-5, 3e-5, 4e-5, 5e-4)],
                  [(9e-5, 9e-5, 9e-5, 9e-5, 9e-4), (1e-5, 1e-5, 1e-5, 1e-5, 1e-4)],
                  [(2e-5, 2e-5, 3e-5, 4e-5, 5e-4), (1e-5, 1e-5, 1e-5, 1e-5, 1e-4)]])
    monkeypatch.setattr(cpu_probe, "_pair", lambda worker: next(pairs))
    monkeypatch.setattr(cpu_probe, "DTENSOR_PAIRS", 3)
    assert cpu_probe.measure_dtensor() == pytest.approx((2e-5, 2e-5, 3e-5, 4e-5, 5e-4))


def test_the_dispatcher_probe_times_the_runtimes_call_less_the_experts_own(monkeypatch):
    """cpu_probe.measure_dispatch: per case (expert parallel dropless, with a capacity, a
    capacity on one rank) the slower process's seconds, the median over DISPATCH_PAIRS
    pairs; `_dispatch_cost` runs compiler/parallel/ep_dispatch.routed_call (what the
    runtime's ExpertParallelExperts calls) and leaves out its experts' own time: an experts
    module far costlier (a busy loop of 0.2 s a call, in place) moves the measured dispatch
    by far less than its own cost (margins wide enough for a loaded machine)."""
    from pipeplan.compiler.estimate import cpu_probe
    from pipeplan.compiler.parallel.ep import ExpertShard
    pairs = iter([[(1e-4, 2e-4, 3e-4, 4e-4, 5e-4, 6e-4), (2e-4, 1e-4, 3e-4, 4e-4, 5e-4, 6e-4)],
                  [(9e-4,) * 6, (1e-4,) * 6],
                  [(1e-4, 1e-4, 3e-4, 4e-4, 5e-4, 6e-4), (1e-4,) * 6]])
    monkeypatch.setattr(cpu_probe, "_pair", lambda worker: next(pairs))
    monkeypatch.setattr(cpu_probe, "DISPATCH_PAIRS", 3)
    assert cpu_probe.measure_dispatch() == [["ep", 2e-4, 2e-4], ["ep_capacity", 3e-4, 4e-4],
                                            ["capacity", 5e-4, 6e-4]]
    one = ExpertShard(cpu_probe.DISPATCH_EXPERTS, 1, 0)
    monkeypatch.setattr(cpu_probe, "ROUNDS", 2)
    plain = cpu_probe._ProbeExperts()

    def costly(rows, index, weights):
        t = time.thread_time()
        while time.thread_time() - t < 0.2:
            pass
        return plain(rows, index, weights)
    cheap = cpu_probe._dispatch_cost(plain, one, None, cpu_probe.DISPATCH_CAPACITY)
    slow = cpu_probe._dispatch_cost(costly, one, None, cpu_probe.DISPATCH_CAPACITY)
    assert 0 < cheap[0] < 0.1 and 0 < cheap[1] < 0.1, cheap
    assert slow[0] < cheap[0] + 0.1, (slow, cheap)


def test_check_says_whether_each_rank_fits_the_named_devices_memory():
    """On a named accelerator `pipeplan check` (render_summary) and report.md say whether the
    largest pipeline rank's estimate fits the profile's capacity: Llama 3 405B's published
    layout on H100s (calibration/llama3.py) does not without recompute in pipeplan's runtime
    (363 GiB a rank) and does with full recompute (38 GiB); the measured CPU has no line."""
    from pathlib import Path

    from pipeplan.compiler import render_summary
    from pipeplan.compiler.estimate.report import render_report
    from pipeplan.dsl.load import load_plan
    from pipeplan.tests.benchmarks.calibration.llama3 import ROWS, plan_of
    lines = {}
    for rc in ("none", "full"):
        c = compile_plan(plan_of(ROWS[0], 1, rc))
        need = c.estimates.peak_bytes
        lines[rc] = [x for x in render_summary(c).splitlines() if x.startswith("memory:")]
        assert len(lines[rc]) == 1 and f"{need / 2**30:.2f} GiB" in lines[rc][0]
        assert f"- {lines[rc][0]}" in render_report(c)
    assert "DOES NOT FIT the h100's 80 GB" in lines["none"][0]
    assert lines["full"][0].startswith("memory: fits the h100's 80 GB")
    examples = Path(__file__).resolve().parents[2] / "examples"
    cpu = compile_plan(load_plan(str(examples / "gpt_pp4_1f1b.plan")))
    assert "memory:" not in render_summary(cpu)
