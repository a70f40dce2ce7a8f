"""The time model's parts against hand arithmetic: the work the meta run records per op, the
roofline, the TP split read off the graph, the overlap rule on a hand-built timeline, and
re-timing a compiled plan on another device (estimate/optime.py, estimate/predict.py)."""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from pipeplan.compiler import compile_plan
from pipeplan.compiler.capture.work import Gemm, WorkLog
from pipeplan.compiler.estimate.device import device_model, mesh_links, model_of
from pipeplan.compiler.estimate.devices import Efficiency, profile
from pipeplan.compiler.estimate.optime import OpTimes, gemm_time, memory_time, shard
from pipeplan.compiler.estimate.predict import breakdown, exposed_gathers, exposed_reduction
from pipeplan.dsl.ast import DeviceSpec, InputSpec, MeshSpec, TensorSpec, TrainSpec
from pipeplan.schedules import generate
from pipeplan.schedules.costs import Costs
from pipeplan.schedules.simulate import simulate
from torch.utils._python_dispatch import TorchDispatchMode


class _Log(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.log = WorkLog()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.log.record(func, args, kwargs, out, lambda t: False)
        return out


def test_work_of_a_linear_a_view_and_a_layer_norm():
    """A [4, 6] x [6, 5] Linear is one GEMM of that shape; a view moves nothing; a layer norm
    reads its input and writes its output (and two statistics per row)."""
    x = torch.randn(4, 6, device="meta")
    w, b = torch.randn(5, 6, device="meta"), torch.randn(5, device="meta")
    with _Log() as m:
        torch.nn.functional.linear(x, w, b)
    work = m.log.take()
    assert work.gemms == (Gemm(1, 4, 5, 6),) and work.float_elements == 0
    with _Log() as m:
        x.view(2, 12).transpose(0, 1)
    assert m.log.take().float_elements == 0
    with _Log() as m:
        torch.nn.functional.layer_norm(x, (6,))
    work = m.log.take()
    assert work.kernels == 1 and work.float_elements == 4 * 6 * 2 + 2 * 4


def test_roofline_by_hand():
    a100 = profile("a100")
    e = a100.efficiency
    peak, bw = 312e12, 2039e9 * e.memory
    big = Gemm(1, 8192, 8192, 8192)  # compute-bound: FLOPs at the sustained GEMM rate
    assert gemm_time(big, a100, peak, 2) == pytest.approx(2 * 8192 ** 3 / (peak * e.gemm_peak))
    thin = Gemm(64, 2048, 2048, 8)  # attention-like scores with a tiny head: memory-bound
    moved = 64 * (2048 * 8 * 2 + 2048 * 2048) * 2
    assert gemm_time(thin, a100, peak, 2) == pytest.approx(moved / bw)
    assert memory_time(1e9, 5e8, a100, 2, div=2) == pytest.approx((2e9 + 5e8) / 2 / bw)
    assert shard(Gemm(1, 8, 16, 32), "column", 4) == Gemm(1, 8, 4, 32)
    assert shard(Gemm(1, 8, 16, 32), "row", 4) == Gemm(1, 8, 16, 8)
    assert shard(Gemm(8, 8, 16, 32), "inner", 4) == Gemm(2, 8, 16, 32)


def test_overlap_rule_on_a_hand_built_timeline():
    """Reductions run one at a time in order of readiness; only what outlasts the compute is
    exposed: ready 1.0 for 0.5 s -> ends 1.5; ready 2.0 for 1.0 s -> ends 3.0; compute ends 2.5."""
    assert exposed_reduction([(2.0, 1.0), (1.0, 0.5)], 2.5) == pytest.approx(0.5)
    assert exposed_reduction([(0.0, 1.0), (0.5, 1.0)], 5.0) == 0.0  # hidden behind compute
    assert exposed_reduction([(1.0, 2.0), (1.0, 2.0)], 1.0) == pytest.approx(4.0)  # queued
    assert exposed_reduction([], 3.0) == 0.0


def test_zero3_gathers_hide_behind_the_action_before_a_change_of_stage():
    """ZeRO-3's window on one rank: the first gather is exposed whole; a change of stage is
    gathered while the previous action runs (exposed: what outlasts it); staying on a stage
    gathers nothing. Stages 0 and 1 gather in 0.5 s and 3.0 s; actions take 1 s each."""
    class A:
        def __init__(self, stage):
            self.stage = stage
    acts = [A(0), A(0), A(1), A(1), A(0)]
    assert exposed_gathers(acts, [1.0] * 5, [0.5, 3.0]) == pytest.approx(0.5 + 2.0 + 0.0)
    assert exposed_gathers(acts, [1.0] * 5, [0.0, 0.0]) == 0.0
    assert exposed_gathers([A(1)], [1.0], [0.5, 3.0]) == pytest.approx(3.0)


def test_breakdown_parts_sum_to_the_step_on_an_interleaved_timeline():
    """2 ranks x 2 stages each, 4 microbatches, F = B = W = 1, 1 s reductions per stage: on
    each rank the earlier stage's (stage r) gradients are final before its last action, so only
    the later one's reduction can be exposed; every rank's parts sum to the step."""
    schedule = generate("interleaved", ranks=2, microbatches=4, virtual=2)
    costs = Costs(per_stage=((1.0, 1.0, 1.0),) * 4)
    sim = simulate(schedule, costs)

    ops = [OpTimes(1.0, 1.0, 1.0)] * 4
    step, ranks = breakdown(schedule, sim, ops, costs, [1.0] * 4, [0.25, 0.25])
    for r in ranks:
        assert r.compute + r.comm + r.bubble + r.optimizer == pytest.approx(step)
    # with ZeRO-3 gathers of 2.5 s per stage each rank's first one is exposed whole, each
    # later change of stage what outlasts the action before it (1 s; BW 2 s); the parts
    # still sum to the step
    gstep, granks = breakdown(schedule, sim, ops, costs, [0.0] * 4, [0.25, 0.25], [2.5] * 4)
    for r, g in zip(ranks, granks):
        acts = schedule.order[r.rank]
        hidden = sum(2.5 - (2.0 if p.op == "BW" else 1.0)
                     for p, n in zip(acts, acts[1:]) if p.stage != n.stage)
        assert hidden > 0 and g.comm == pytest.approx(2.5 + hidden)
        assert g.compute + g.comm + g.bubble + g.optimizer == pytest.approx(gstep)
        actions = schedule.order[r.rank]
        assert r.compute == pytest.approx(sum(2.0 if a.op == "BW" else 1.0 for a in actions))
    ends = [dict((a.stage, e) for a, e in zip(schedule.order[r], sim.end[r]) if a.op in ("W", "BW"))
            for r in range(2)]
    for r in range(2):
        last = sim.end[r][-1]
        queue = sorted(ends[r].values())
        t = 0.0
        for ready in queue:
            t = max(t, ready) + 1.0
        assert ranks[r].comm == pytest.approx(max(0.0, t - last))
    assert step == pytest.approx(max(sim.end[r][-1] + ranks[r].comm + 0.25 for r in range(2)))


def _gpt(make_plan, tp: int, device=DeviceSpec(name="a100")):
    pre = "layers.*."
    tensor = TensorSpec(column=(pre + "attn.q", pre + "attn.k", pre + "attn.v", pre + "mlp.up"),
                        row=(pre + "attn.proj", pre + "mlp.down")) if tp > 1 else TensorSpec()
    return make_plan("examples/models/gpt.py:GPT", {"vocab": 64, "dim": 32, "layers": 2,
                                                    "heads": 4, "seq_len": 16},
                     pp=1, inputs=(InputSpec("input_ids", "int64", ("batch", "seq")),),
                     microbatches=1, mesh=MeshSpec(pp=1, tp=tp), tensor=tensor,
                     train=TrainSpec(global_batch=2), device=device)


def test_tensor_parallel_splits_what_the_rewrite_splits(make_plan):
    """tp = 2: the column layers' N and the row layers' K halve, the attention core between
    them works on half the heads, the norms and the residual stay whole."""
    compiled = compile_plan(_gpt(make_plan, 2))
    work = compiled.estimates.timing.work[0]
    kinds = {}
    for (g, kind, _), n in work.gemms.items():
        kinds.setdefault(kind, set()).add((g.m, g.n, g.k))
    assert kinds["column"] == {(32, 32, 32), (32, 128, 32)}  # q, k, v; mlp.up (unsharded)
    assert kinds["row"] == {(32, 32, 32), (32, 32, 128)}  # proj; mlp.down
    assert {k for k in kinds} >= {"inner"}  # the attention core reads split values
    whole = work.memory.get((False, False), [0, 0, 0])
    assert whole[0] > 0  # layer norms, residual adds: whole on every TP rank


def test_retime_on_another_device_without_tracing(make_plan):
    """Timing.time_on: the same compiled plan on a device with twice the peak and free memory
    and links takes half the compute; MFU is the model FLOPs over the step at peak."""
    compiled = compile_plan(_gpt(make_plan, 1))
    timing = compiled.estimates.timing
    base = device_model(compiled.plan)
    hw = dataclasses.replace(base.hardware, memory_bandwidth=1e30, intra_node=1e30,
                             inter_node=1e30, latency=0.0,
                             efficiency=Efficiency(0.5, 1.0, 1.0))
    one = timing.time_on(model_of(compiled.plan, hw))
    two = timing.time_on(model_of(compiled.plan, dataclasses.replace(
        hw, flops={k: 2 * v for k, v in hw.flops.items()})))
    assert two.step_s == pytest.approx(one.step_s / 2, rel=1e-9)
    assert one.mfu == pytest.approx(timing.model_flops_per_gpu / one.step_s / hw.flops["fp32"])
    flops = sum(3 * st.flops for st in compiled.stages) * compiled.plan.microbatches
    assert one.step_s == pytest.approx(flops / (hw.flops["fp32"] * 0.5), rel=1e-9)
    from pipeplan.compiler import predicted  # the plan's own device, re-timed
    assert predicted(compiled).step_s == pytest.approx(compiled.estimates.step_time_s)


def test_dtensor_host_time_only_where_eager_tp_runs_dtensors(make_plan):
    """Eager tensor parallelism runs a stage's ops on DTensors: each op's host time grows by
    the device's DTensor dispatch (forward; backward split between B and W as the plain host
    time is); graphs mode runs traced plain tensors, and tp = 1 none: nothing added."""
    from pipeplan.compiler.estimate.optime import on_dtensors, op_times
    from pipeplan.dsl.ast import CompileSpec
    compiled = compile_plan(_gpt(make_plan, 2))
    plan = compiled.plan  # its one stage as a later stage's, a gradient leaving it (B's work)
    work = dataclasses.replace(compiled.estimates.timing.work[0], input_grads=True)
    hw = dataclasses.replace(profile("a100"), op_s=1e-5, op_backward_s=2e-5)
    plain = op_times(plan, work, hw)
    added = op_times(plan, work, dataclasses.replace(hw, dtensor_op_s=1e-3,
                                                     dtensor_op_backward_s=4e-3))
    assert on_dtensors(plan, work) and work.ops > 0
    assert added.f - plain.f == pytest.approx(work.ops * 1e-3)
    assert added.b - plain.b == pytest.approx(work.ops * 4e-3 / 2 + work.recompute_ops * 1e-3)
    assert added.w - plain.w == pytest.approx(work.ops * 4e-3 / 2)
    graphs = dataclasses.replace(plan, compile=CompileSpec(mode="graphs"))
    assert not on_dtensors(graphs, work)
    whole = compile_plan(_gpt(make_plan, 1))
    assert not on_dtensors(whole.plan, whole.estimates.timing.work[0])


def test_a_separate_w_pays_its_calls_and_a_first_stage_runs_its_backward_in_w(make_plan):
    """The runtime's split backward (backends/runtime/stage.py): a stage a gradient leaves
    runs B (input gradients) then W, one autograd call per seed, each `split_call_s` on the
    host in eager mode (a compiled stage's W is one graph: nothing), charged to W and not
    to the fused BW; a stage no gradient leaves (the first) does nothing in B, its W the
    whole backward (the runtime's seed counts: tests/backends/test_split_backward.py)."""
    from pipeplan.compiler.estimate.optime import op_times
    from pipeplan.compiler.estimate.predict import _op_time
    from pipeplan.dsl.ast import CompileSpec
    from pipeplan.schedules import Action
    compiled = compile_plan(_gpt(make_plan, 1))
    plan, first = compiled.plan, compiled.estimates.timing.work[0]
    assert not first.input_grads and first.seeds == 0  # its inputs: the batch's ids
    later = dataclasses.replace(first, input_grads=True, seeds=7)
    hw = dataclasses.replace(profile("a100"), op_s=1e-5, op_backward_s=2e-5, split_call_s=3e-4)
    split, whole = op_times(plan, later, hw), op_times(plan, first, hw)
    assert split.split == pytest.approx(7 * 3e-4) and split.b > 0
    assert (whole.b, whole.split) == (0.0, 0.0)
    assert whole.w == pytest.approx(split.b + split.w) and whole.f == split.f
    ops = [split]
    assert _op_time(ops, Action("W", 0, 0)) == pytest.approx(split.w + 7 * 3e-4)
    assert _op_time(ops, Action("BW", 0, 0)) == pytest.approx(split.b + split.w)
    graphs = dataclasses.replace(plan, compile=CompileSpec(mode="graphs"))
    assert op_times(graphs, later, hw).split == 0.0


def test_each_action_pays_its_cores_resume_where_the_ranks_outnumber_the_cores(make_plan):
    """predict.resumed: where the plan's ranks outnumber the cores each action resumes on a
    core another process used (cpu_probe.measure_resume), once per action: F, B, a fused
    BW and a separate W each pay it once, a first stage's (whose B does nothing) in W; no
    ranks beyond the cores, or no sharing, nothing."""
    from pipeplan.compiler.estimate.device import Sharing
    from pipeplan.compiler.estimate.optime import takes_input_grads
    plan = make_plan("examples/models/gpt.py:GPT", {"vocab": 64, "dim": 32, "layers": 2,
                                                    "heads": 4, "seq_len": 16},
                     pp=2, inputs=(InputSpec("input_ids", "int64", ("batch", "seq")),),
                     microbatches=2, mesh=MeshSpec(pp=2), train=TrainSpec(global_batch=4),
                     device=DeviceSpec(name="a100"))
    compiled = compile_plan(plan)
    timing = compiled.estimates.timing
    base = model_of(compiled.plan, dataclasses.replace(profile("a100"), resume_s=1e-3))
    costs = {k: timing.costs(dataclasses.replace(base, shared_at=at))[1]
             for k, at in (("alone", None), ("over", (Sharing(4, 2), 1.0)),
                           ("fits", (Sharing(2, 2), 1.0)))}
    assert costs["fits"] == costs["alone"]
    stages = range(len(compiled.stages))
    before, after = (costs[k].stage_table(tuple(stages)) for k in ("alone", "over"))
    assert [takes_input_grads(st) for st in compiled.stages] == [False, True]
    for st in compiled.stages:
        s, grads = st.index, takes_input_grads(st)
        assert after.time("F", s) - before.time("F", s) == pytest.approx(1e-3)
        assert after.time("B", s) - before.time("B", s) == pytest.approx(1e-3 if grads else 0)
        assert after.time("W", s) - before.time("W", s) == pytest.approx(1e-3)
        assert after.time("BW", s) - before.time("BW", s) == pytest.approx(1e-3)


@pytest.mark.parametrize("optimizer", ["adamw(lr = 0.01, weight_decay = 0.1)", "sgd(lr = 0.1)",
                                       "sgd(lr = 0.1, momentum = 0.9)"])
@pytest.mark.parametrize("zero", [0, 2])
def test_the_optimizer_step_pays_the_host_per_tensor_it_steps(optimizer, zero):
    """The optimizer's step on a host that pays per op: optime.optimizer_ops (the ops the
    CPU probe counts; the runtime's own optimizer, backends/runtime/optim.py, built from the
    plan, dispatches as many, counted here on it) x the host time per op, for the tensors the rank steps (each
    parameter; each flat shard under ZeRO), beside its bytes over memory bandwidth;
    nothing on an accelerator."""
    from pipeplan.backends.runtime.optim import build_optimizer
    from pipeplan.compiler.capture.analysis import OpCounter
    from pipeplan.compiler.estimate.cpu_probe import count_optimizer_ops
    from pipeplan.compiler.estimate.optime import optimizer_ops
    from pipeplan.compiler.estimate.predict import optimizer_s
    from pipeplan.dsl import load_plan
    plan = load_plan(os.path.join(os.path.dirname(__file__), "..", "..", "examples",
                                  "gpt_pp4_1f1b.plan"),
                     overrides=[f"train.optimizer={optimizer}", f"zero={zero}", "mesh.pp=2",
                                f"mesh.dp={2 if zero else 1}", "pipeline.split=auto"])
    params = [torch.nn.Parameter(torch.randn(n)) for n in (3, 40, 7)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = build_optimizer(params, plan.train)
    opt.step()
    with OpCounter() as counted:
        opt.step()
    cpu = dataclasses.replace(profile("a100"), op_s=1e-5, optimizer_ops=tuple(
        tuple(row) for row in count_optimizer_ops()))
    fixed, per = optimizer_ops(plan.train.optimizer, cpu)
    assert fixed + per * len(params) == counted.count and per > 0
    assert optimizer_ops(plan.train.optimizer, profile("a100")) == (0, 0)
    compiled = compile_plan(plan)
    timing = compiled.estimates.timing
    held = [sum(len(st.param_names) for st in compiled.stages if st.rank == r)
            for r in range(plan.mesh.pp)]
    if zero == 0:
        assert timing.optimizer_tensors == held
    else:  # a flat shard per kind of parameter on each stage: fewer than its parameters
        assert all(0 < n < h for n, h in zip(timing.optimizer_tensors, held))
    for nbytes, n in zip(timing.optimizer_bytes, timing.optimizer_tensors):
        on_gpu = optimizer_s(compiled.plan, nbytes, n, profile("a100"))
        assert optimizer_s(compiled.plan, nbytes, n, cpu) - on_gpu == pytest.approx(
            (fixed + per * n) * 1e-5)
        assert on_gpu == pytest.approx(nbytes / (cpu.memory_bandwidth * cpu.efficiency.memory))


def test_dtensor_wraps_and_redistributions_in_eager_tp_actions(make_plan):
    """Eager tp also pays per tensor its rewrite wraps (the stage's parameters, buffers,
    inputs and the tensors its graph makes: tests/parallel/test_tensor_parallel.py counts
    them in the rewritten stage) and per redistribution (its TP collectives per microbatch, each in its pass:
    4 forward, 4 backward here): the action costs grow by exactly that on a device that
    measured them, and not at all in graphs mode."""
    from pipeplan.compiler.estimate.device import DeviceModel
    from pipeplan.compiler.estimate.optime import dtensor_host, op_times
    from pipeplan.compiler.estimate.predict import action_costs, wrapped
    from pipeplan.dsl.ast import CompileSpec
    compiled = compile_plan(_gpt(make_plan, 2))
    plan, timing = compiled.plan, compiled.estimates.timing
    st = compiled.stages[0]
    hw = profile("a100")
    priced = dataclasses.replace(hw, dtensor_wrap_s=1e-3, dtensor_wrap_backward_s=3e-3,
                                 dtensor_redistribute_s=5e-3)
    tensors = wrapped(st)  # (test_tensor_parallel.py: equals the rewrite's own wraps)
    calls = compiled.estimates.stage_collectives[0]  # the report's per-step calls
    n = sum(c for (group, _), (c, _) in calls.items() if group == "tp") / plan.microbatches
    assert n > 0 and tensors > len(st.param_names)
    f, b = dtensor_host(plan, priced, tensors, (int(n) // 2, int(n) - int(n) // 2))
    assert (f, b) == pytest.approx((tensors * 1e-3 + n // 2 * 5e-3,
                                    tensors * 3e-3 + (n - n // 2) * 5e-3))
    ops = [op_times(plan, w, hw) for w in timing.work]
    base = action_costs(plan, compiled.stages, ops, timing.tp_traffic, timing.moe_traffic,
                        DeviceModel(hardware=hw))
    more = action_costs(plan, compiled.stages, ops, timing.tp_traffic, timing.moe_traffic,
                        DeviceModel(hardware=priced))
    (f0, b0, w0), (f1, b1, w1) = base.per_stage[0], more.per_stage[0]
    # its one stage sends no gradient back: its whole backward, the host's too, is W's
    assert (f1 - f0, b1 - b0, w1 - w0) == pytest.approx((f, 0.0, b))
    graphs = dataclasses.replace(plan, compile=CompileSpec(mode="graphs"))
    assert dtensor_host(graphs, priced, tensors, (int(n), 0)) == (0.0, 0.0)


def test_mesh_links_equal_the_minimum_over_every_group_of_the_layout():
    """mesh_links reads at most one node's worth of groups per axis (a group's bandwidth
    depends on its first rank modulo the node size): the same links as the minimum over
    every tp, dp, p2p and ep group of the rank layout (dsl/layout.global_rank and groups,
    enumerated)."""
    import random

    from pipeplan.compiler.estimate.device import DeviceModel, mesh_links
    from pipeplan.dsl.layout import global_rank, groups, mesh_layout

    rng = random.Random(1)
    seen = set()
    for _ in range(400):
        pp, dp, tp, cp = (rng.choice([1, 2, 3, 4, 6, 8, 12]) for _ in range(4))
        mesh = MeshSpec(pp=pp, dp=dp, tp=tp, cp=cp)
        dev = DeviceModel(flops_per_s=1e12, link_bytes_per_s=1e9, latency_s=1e-5,
                          tp_link_bytes_per_s=3e9,
                          ranks_per_node=rng.choice([None, 1, 2, 3, 4, 6, 8]))
        rank = lambda p, d, t, c=0: global_rank(mesh, p, d, t, c)  # noqa: E731
        per_pp = dp * cp * tp
        want = (min(dev.link([rank(p, d, t) for t in range(tp)], True)
                    for p in range(pp) for d in range(dp)),
                min(dev.link([rank(p, d, t, c) for d in range(dp) for c in range(cp)
                              for t in range(tp)]) for p in range(pp)),
                min((dev.link([g, g + per_pp]) for g in range((pp - 1) * per_pp)),
                    default=dev.link_bytes_per_s))
        want += (min(dev.link(g) for g in groups(mesh_layout(mesh), "ep")),)
        got = mesh_links(dataclasses.replace(_plan_with_mesh(), mesh=mesh), dev)
        assert (got.tp, got.dp, got.p2p, got.ep) == want, (mesh, dev.ranks_per_node)
        seen.add(want)
    assert len(seen) >= 6  # groups inside a node, across nodes with 1, 2, ... ranks in each


def _plan_with_mesh():
    from pipeplan.dsl.ast import Plan, ModelSpec
    return Plan(model=ModelSpec(source="x.py:M"))


@pytest.mark.parametrize("method, forward, backward", [("ulysses", 4, 4), ("ring", 1, 2)])
def test_context_parallel_exchanges_wait_a_latency_per_message(method, forward, backward):
    """Under cp each attention op's exchanges cost a message latency each, on top of their
    bytes: Ulysses' 4 all-to-alls forward and 4 backward, each cp - 1 pairwise exchanges;
    the ring's K/V hop forward, its K/V and dK/dV hops backward (cp - 1 each). pp2 x cp2,
    2 attention layers per stage: the actions' seconds grow by exactly that many latencies
    when the latency does (hand count against backends/parallel/cp/'s calls, which the
    meter counts in tests/parallel/test_ring_attention.py)."""
    from pipeplan.dsl import parse_plan
    from pipeplan.tests.parallel.test_context_parallel import PLAN

    text = PLAN if method == "ulysses" else PLAN.replace("method = ulysses", "method = ring")
    compiled = compile_plan(parse_plan(text, "cp.plan"))
    assert compiled.plan.mesh.cp == 2 and compiled.plan.mesh.pp == 2
    timing = compiled.estimates.timing
    a100 = profile("a100")
    at = {lat: timing.costs(model_of(compiled.plan, dataclasses.replace(a100, latency=lat)))[1]
          for lat in (0.0, 1e-3)}
    layers = 2
    for st, before, after in zip(compiled.stages, at[0.0].per_stage, at[1e-3].per_stage):
        f, back, other = _added(st, before, after)
        assert f == pytest.approx(layers * forward * (2 - 1) * 1e-3, rel=1e-9)
        assert back == pytest.approx(layers * backward * (2 - 1) * 1e-3, rel=1e-9)
        assert other == 0
    calls = compiled.estimates.ranks[0].collective_calls
    op = "ring p2p" if method == "ring" else "alltoall"
    per_op = 3 * (2 - 1) if method == "ring" else 8
    assert calls[("cp", op)] == layers * compiled.plan.microbatches * per_op


def test_expert_all_to_alls_wait_a_latency_per_exchange(make_plan):
    """Each expert all-to-all over ep ranks waits ep - 1 latencies (pairwise exchanges), as
    many calls as the runtime makes (collectives.ep_calls, metered in
    tests/parallel/test_comm_meter.py: 7 per experts call), half in F, half in B."""
    from pipeplan.compiler.estimate.collectives import ep_calls
    from pipeplan.dsl import parse_plan

    path = os.path.join(os.path.dirname(__file__), "..", "..", "examples",
                        "moe_pp2_ep2_zbv.plan")
    plan = parse_plan(open(path).read(), path)
    compiled = compile_plan(plan)
    ep = compiled.plan.mesh.ep
    assert ep == 2
    timing = compiled.estimates.timing
    a100 = profile("a100")
    at = {lat: timing.costs(model_of(compiled.plan, dataclasses.replace(a100, latency=lat)))[1]
          for lat in (0.0, 1e-3)}
    assert ep_calls(compiled.plan, "tokens", prepass=False) \
        + ep_calls(compiled.plan, "weights", prepass=False) == 7
    for st, before, after in zip(compiled.stages, at[0.0].per_stage, at[1e-3].per_stage):
        layers = sum(1 for t in timing.moe_traffic if t.stage == st.index
                     and t.role == "tokens")
        assert layers > 0
        f, back, other = _added(st, before, after)
        assert f == pytest.approx(layers * 7 * (ep - 1) * 1e-3 / 2, rel=1e-9)
        assert back == pytest.approx(layers * 7 * (ep - 1) * 1e-3 / 2, rel=1e-9)
        assert other == 0


@pytest.mark.parametrize("overrides, case", [
    ([], "ep"),
    (["experts.dropless=false", "experts.capacity_factor=1.5"], "ep_capacity"),
    (["experts.dropless=false", "experts.capacity_factor=1.5", "mesh.ep=1"], "capacity"),
    (["compile.mode=graphs"], None),
    (["mesh.ep=1"], None)])
def test_each_experts_call_pays_the_dispatchers_measured_host_time(overrides, case):
    """On a host that pays per op, each experts call the runtime dispatches (ep > 1 or a
    capacity: compiler/parallel/ep_dispatch.routed_call) adds the probe's measured time
    for its case (cpu_probe.measure_dispatch times that same function), forward in F and
    backward in B (W on a stage no gradient leaves); nothing for the static dispatch
    (compiled stages) or experts run as captured, nor on an accelerator."""
    from pipeplan.dsl import load_plan
    path = os.path.join(os.path.dirname(__file__), "..", "..", "examples",
                        "moe_pp2_ep2_zbv.plan")
    compiled = compile_plan(load_plan(path, overrides=overrides))
    timing = compiled.estimates.timing
    cases = (("ep", 3e-4, 2e-4), ("ep_capacity", 5e-4, 4e-4), ("capacity", 7e-4, 6e-4))
    a100 = profile("a100")
    before, after = (timing.costs(model_of(compiled.plan, dataclasses.replace(
        a100, dispatch_s=d)))[1].per_stage for d in ((), cases))
    f_s, b_s = next(((f, b) for c, f, b in cases if c == case), (0.0, 0.0))
    for st, b0, b1 in zip(compiled.stages, before, after):
        calls = sum(1 for t in timing.moe_traffic if t.stage == st.index
                    and t.role == "tokens")
        assert calls > 0
        assert _added(st, b0, b1) == pytest.approx((calls * f_s, calls * b_s, 0.0),
                                                   rel=1e-9, abs=1e-15)


def _added(stage, before, after) -> tuple:
    """(F's, the backward's, the other backward op's) seconds added from `before` to
    `after`, (F, B, W) each: the backward's in B, or in W on a stage no gradient leaves
    (its whole backward runs there: optime.py)."""
    from pipeplan.compiler.estimate.optime import takes_input_grads
    (f0, b0, w0), (f1, b1, w1) = before, after
    if takes_input_grads(stage):
        return f1 - f0, b1 - b0, w1 - w0
    return f1 - f0, w1 - w0, b1 - b0


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_zero_1_2_all_gather_after_the_optimizer_is_exposed_whole(make_plan, zero):
    """ZeRO-1/2 all-gather the updated shards after the optimizer step, blocking
    (backends/parallel/zero/sharding.py: after_step): its seconds (a latency per ring step
    + (dp-1)/dp of the padded parameters over the dp link) add to the step whole, beside
    the reduction (an all-reduce at ZeRO-1, a reduce-scatter at 2) the backward may hide;
    ZeRO-0 and 3 have none (3 gathers around actions instead). Hand arithmetic on the
    GPT at dp 4."""
    from pipeplan.compiler.estimate.predict import Prediction
    from pipeplan.compiler.parallel.zero import padded

    plan = dataclasses.replace(_gpt(make_plan, 1), mesh=MeshSpec(pp=1, dp=4), zero=zero,
                               train=TrainSpec(global_batch=8))
    compiled = compile_plan(plan)
    timing = compiled.estimates.timing
    n = sum(p.numel() for p in compiled.stages[0].module.parameters())
    full = padded(n, 4) * 4  # float32 bytes of the flat buffer
    total = compiled.estimates.ranks[0].comm_bytes["dp"]
    if zero in (1, 2):
        assert timing.regather_bytes == [full // 4 * 3]
        assert timing.dp_bytes[0] + timing.regather_bytes[0] == total
    else:
        assert not any(timing.regather_bytes)
    dev = model_of(compiled.plan, profile("a100"))
    with_it: Prediction = timing.time_on(dev)
    without = dataclasses.replace(timing, regather_bytes=None).time_on(dev)
    link = mesh_links(compiled.plan, dev).dp
    want = dev.latency_s * 3 + full // 4 * 3 / link if zero in (1, 2) else 0.0
    assert with_it.step_s - without.step_s == pytest.approx(want, rel=1e-9, abs=1e-15)
    assert with_it.ranks[0].comm - without.ranks[0].comm == pytest.approx(want, abs=1e-15)


def test_a_rank_sharing_the_cpu_never_runs_faster_than_alone():
    """Sharing.factor: the fair share of the cores, never under 1 (the planner's bounds read
    the speeds alone); each action resumes its core only where the ranks outnumber them."""
    from pipeplan.compiler.estimate.device import Sharing

    s = Sharing(ranks=4, cores=2, replicas=1)
    assert s.factor(1.0) == 1.0 and s.factor(2.0) == 1.0
    assert s.factor(4.0) == pytest.approx(2.0)
    assert Sharing(ranks=4, cores=2, replicas=4).factor(1.0) == pytest.approx(2.0)
    assert s.resume and not Sharing(ranks=2, cores=2).resume


def test_tp_collectives_wait_in_the_pass_the_rewrite_places_them(make_plan):
    """tp = 2, two GPT layers in one stage, the embedding and the head vocab-parallel: the
    forward all-reduces the row layers' outputs (attn.proj, mlp.down: 2 a layer), the split
    embedding's output (1) and the parallel loss's max, sum and target logit (3): 8; the
    backward the column layers' input gradients (q, k, v share one input; mlp.up: 2 a
    layer) and the head's (1): 5. A latency more per message lengthens F by 8 all-reduces'
    ring steps (2 each at tp = 2) and B by 5; the 13 calls are those the report counts (each
    compared with the runtime's meter in tests/parallel/test_estimates_exact.py)."""
    from pipeplan.compiler.estimate.device import DeviceModel
    from pipeplan.compiler.estimate.optime import op_times
    from pipeplan.compiler.estimate.predict import action_costs
    plan = _gpt(make_plan, 2)
    plan = dataclasses.replace(plan, tensor=dataclasses.replace(
        plan.tensor, vocab=("tok_emb", "lm_head")))
    compiled = compile_plan(plan)
    plan, timing = compiled.plan, compiled.estimates.timing
    calls = compiled.estimates.stage_collectives[0]
    assert calls == {("tp", "allreduce"): (13 * plan.microbatches, calls[("tp", "allreduce")][1])}
    hw = profile("a100")
    ops = [op_times(plan, w, hw) for w in timing.work]

    def costs(latency):
        return action_costs(plan, compiled.stages, ops, timing.tp_traffic, timing.moe_traffic,
                            DeviceModel(hardware=hw, latency_s=latency)).per_stage[0]
    assert _added(compiled.stages[0], costs(0.0), costs(1e-3)) == \
        pytest.approx((8 * 2 * 1e-3, 5 * 2 * 1e-3, 0.0))


def test_the_steps_own_collectives_hold_every_optimizer_until_the_last_rank_ends():
    """predict.breakdown with the trainer's own collectives (StepSync) on a hand-built step:
    rank 0 runs F0 0-1 and BW0 4-6, rank 1 F1 1-2 and BW1 2-4; optimizers 0.2 and 0.3.
    Every rank starts the loss all-reduce as its actions end and waits for it before its
    optimizer, so rank 1 (done at 4) cannot step before rank 0 ends (6): 6 + 0.3, not
    max(6 + 0.2, 4 + 0.3). With the all-reduce taking 0.5: 6.5 + 0.3, each rank's last
    0.5 of waiting communication (rank 1's first 2 bubble). Rank 0's tied sum (1 s, overlapped) starts as its
    stage's last BW ends (6): 7 + 0.2; blocking, after the DP reduction's tail (1 s from
    6): 8 + 0.2. Every rank's parts sum to the step."""
    from pipeplan.compiler.estimate.predict import StepSync, breakdown
    from pipeplan.schedules import Action, Schedule
    order = ((Action("F", 0, 0), Action("BW", 0, 0)), (Action("F", 1, 0), Action("BW", 1, 0)))
    sched = Schedule("custom", 2, 2, 1, (0, 1), order)
    costs = Costs(per_stage=((1.0, 2.0, 0.0), (1.0, 2.0, 0.0)))
    sim = simulate(sched, costs)
    assert [e[-1] for e in sim.end] == [6.0, 4.0]
    ops = [OpTimes(1.0, 1.0, 1.0)] * 2
    cases = [(StepSync(), [0.0, 0.0], 6.3, (0.0, 0.0)),
             (StepSync(loss_s=0.5), [0.0, 0.0], 6.8, (0.5, 0.5)),
             (StepSync(0.5, (((0, 1.0, True),), ())), [0.0, 0.0], 7.2, (1.0, 0.5)),
             (StepSync(0.5, (((0, 1.0, False),), ())), [1.0, 0.0], 8.2, (2.0, 0.5)),
             # clipping: the norm's all-reduces start after the last rank's gradient sync
             # (rank 0's, at 7 with its 1 s of DP tail) and end 0.25 later: 7.25 + 0.3;
             # rank 0 waits in them 0.25 s, rank 1 in the loss's (its last 0.5 s before
             # 6.5) and the norm's, the rest of its wait bubble
             (StepSync(0.5, norm_s=0.25), [1.0, 0.0], 7.55, (1.25, 0.75))]
    for sync, dp, want, comm in cases:
        step, ranks = breakdown(sched, sim, ops, costs, dp, [0.2, 0.3], sync=sync)
        assert step == pytest.approx(want)
        assert tuple(r.comm for r in ranks) == pytest.approx(comm)
        for r in ranks:
            assert r.compute + r.comm + r.bubble + r.optimizer == pytest.approx(step)


@pytest.mark.parametrize("zero, dp, tp, want", [
    (0, 1, 2, [("tp",), ("tp",)]),  # tensor-parallel slices: one all-reduce over tp
    (0, 2, 1, [(), ()]),  # replicated parameters: whole on every rank, nothing to sum
    (1, 2, 1, [("dp",), ("dp",)]),  # ZeRO: each flat shard over its dp group
    (1, 2, 2, [("dp", "dp", "tp"), ("dp", "dp", "tp")])])  # + the tp kind's over tp
def test_the_clipped_norm_sums_over_the_groups_that_shard_it(make_plan, zero, dp, tp, want):
    """Clipping, the norm's all-reduces per pipeline rank (norm_groups_of: the runtime's
    GradSync.norm / global_norm, one per group sharding some of its gradients; under ZeRO,
    zero/sharding.py: grad_sq_norm, each flat shard's reduce group and its kind's spread
    group), then one over the pipeline (StepSync.norm_s: the slowest rank's; 8-byte
    all-reduces, a latency per ring step each); nothing when the plan does not clip."""
    from pipeplan.compiler.estimate.device import DeviceModel, mesh_links
    from pipeplan.compiler.estimate.predict import collective_s
    pre = "layers.*."
    tensor = TensorSpec(column=(pre + "attn.q", pre + "attn.k", pre + "attn.v", pre + "mlp.up"),
                        row=(pre + "attn.proj", pre + "mlp.down")) if tp > 1 else TensorSpec()
    plan = make_plan("examples/models/gpt.py:GPT", {"vocab": 64, "dim": 32, "layers": 2,
                                                     "heads": 4, "seq_len": 16}, pp=2,
                     inputs=(InputSpec("input_ids", "int64", ("batch", "seq")),),
                     microbatches=2, mesh=MeshSpec(pp=2, dp=dp, tp=tp), tensor=tensor,
                     train=TrainSpec(global_batch=4 * dp, grad_clip=1.0),
                     device=DeviceSpec(name="a100"), zero=zero)
    timing = compile_plan(plan).estimates.timing
    assert [tuple(sorted(g)) for g in timing.norm_groups] == [tuple(sorted(w)) for w in want]
    device = DeviceModel(hardware=profile("a100"), latency_s=1e-3)
    links = mesh_links(timing.plan, device)
    size = {"tp": tp, "dp": dp}
    link = {"tp": links.tp, "dp": links.dp}
    each = max(sum(collective_s("allreduce", 8, size[g], link[g], 1e-3) for g in groups)
               for groups in want)
    sync = timing.step_sync(device)[0]
    assert sync.norm_s == pytest.approx(each + collective_s("allreduce", 8, 2, links.p2p,
                                                            1e-3))
    unclipped = dataclasses.replace(timing, plan=dataclasses.replace(
        timing.plan, train=dataclasses.replace(timing.plan.train, grad_clip=None)))
    assert unclipped.step_sync(device)[0].norm_s == 0.0


def test_the_tied_sums_and_the_loss_all_reduce_on_a_device(make_plan):
    """predict.step_sync from the compiled plan's tied gradients: the GPT's tied embedding
    and head on pipeline ranks 0 and 1, each summing its gradient's bytes (the estimate's
    tied collective) over the 2 holders, overlapped with the backward (no ZeRO, one dp
    replica) or after the DP reduction (dp = 2); the loss all-reduce over the world's ranks:
    2 (n - 1) ring steps, each the device's ring step."""
    import dataclasses

    from pipeplan.compiler.estimate.device import DeviceModel, mesh_links
    from pipeplan.compiler.estimate.predict import collective_s, step_sync
    compiled = compile_plan(make_plan("examples/models/gpt.py:GPT", {
        "vocab": 64, "dim": 32, "layers": 2, "heads": 4, "seq_len": 16}, pp=2,
        inputs=(InputSpec("input_ids", "int64", ("batch", "seq")),), microbatches=2,
        mesh=MeshSpec(pp=2), train=TrainSpec(global_batch=4)))
    timing, est = compiled.estimates.timing, compiled.estimates
    tied = est.ranks[0].collectives[("tied", "allreduce")]
    assert timing.tied == [[(0, tied, 2)], [(1, tied, 2)]]
    device = DeviceModel(hardware=profile("a100"))
    link = mesh_links(compiled.plan, device).p2p
    sync, loss_steps, steps = step_sync(compiled.plan, timing.tied, 2, device)
    one = collective_s("allreduce", tied, 2, link, device.ring_step_s)
    assert sync.tied == (((0, one, True),), ((1, one, True),)) and steps == [2, 2]
    assert loss_steps == 2 and sync.loss_s == pytest.approx(
        2 * device.ring_step_s + 8 / link)
    dp2 = dataclasses.replace(compiled.plan, mesh=MeshSpec(pp=2, dp=2))
    sync, loss_steps, _ = step_sync(dp2, timing.tied, 2, device)
    assert not sync.tied[0][0][2] and loss_steps == 2 * (4 - 1)
