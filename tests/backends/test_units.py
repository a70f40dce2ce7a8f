"""Unit tests of the runtime's pure parts: coordinates, data, LR, transfers, comparison."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pipeplan.backends.runtime import data
from pipeplan.backends.runtime.comm import Direction, plan_rank
from pipeplan.backends.verify.compare import compare
from pipeplan.backends.runtime.launcher import free_port
from pipeplan.backends.runtime.optim import build_optimizer, lr_factor
from pipeplan.backends.runtime.topology import Coords, global_rank
from pipeplan.compiler.compiled import BATCH, StageSpec, ValueRef, ValueSpec
from pipeplan.dsl.ast import (DataSpec, LRScheduleSpec, MeshSpec, ModelSpec, OptimizerSpec, PipelineSpec, Plan, TrainSpec)
from pipeplan.errors import PipeplanError
from pipeplan.schedules import generate


def plan(dp=2, m=2, batch=8, **data_kw):
    return Plan(model=ModelSpec("x:Y"), data=DataSpec(seq_len=5, vocab=50, seed=3, **data_kw),
                mesh=MeshSpec(pp=2, dp=dp), pipeline=PipelineSpec(microbatches=m),
                train=TrainSpec(global_batch=batch))


def test_coords_round_trip_pp_outermost():
    mesh = MeshSpec(pp=3, dp=2, tp=2)
    seen = set()
    for r in range(mesh.world_size):
        c = Coords.of(r, mesh)
        assert global_rank(mesh, c.pp, c.dp, c.tp) == r
        seen.add((c.pp, c.dp, c.tp))
    assert len(seen) == 12
    assert Coords.of(5, mesh) == Coords(1, 0, 1)


def test_synthetic_batches_are_deterministic_and_shifted():
    p = plan()
    a, b = data.global_batch(p, 4), data.global_batch(p, 4)
    assert torch.equal(a.input_ids, b.input_ids)
    assert not torch.equal(a.input_ids, data.global_batch(p, 5).input_ids)
    assert a.input_ids.shape == (8, 5)
    assert torch.equal(a.input_ids[:, 1:], a.targets[:, :-1])
    assert int(a.input_ids.max()) < 50
    # learnable: each token mostly determines the next (a fixed successor table per seed)
    pairs = torch.stack([a.input_ids.flatten(), a.targets.flatten()], 1)
    succ = {}
    for x, y in pairs.tolist():
        succ.setdefault(x, []).append(y)
    agree = sum(max(ys.count(y) for y in ys) for ys in succ.values())
    assert agree >= 0.8 * len(pairs)


def test_dp_ranks_and_microbatches_tile_the_global_batch():
    p = plan(dp=2, m=2, batch=8)
    whole = data.global_batch(p, 0).input_ids
    pieces = [mb.input_ids for d in range(2) for mb in data.dp_microbatches(p, 0, d)]
    assert [x.shape[0] for x in pieces] == [2, 2, 2, 2]
    assert torch.equal(torch.cat(pieces), whole)  # chunk d*m+i = dp rank d's microbatch i


def test_token_file_windows(tmp_path):
    tokens = np.arange(100, dtype=np.uint16)
    path = tmp_path / "tok.bin"
    tokens.tofile(path)
    p = plan(dp=1, m=1, batch=2, kind="file", path=str(path))
    b0, b1 = data.global_batch(p, 0), data.global_batch(p, 1)
    assert b0.input_ids[0].tolist() == [0, 1, 2, 3, 4] and b0.targets[0].tolist() == [1, 2, 3, 4, 5]
    assert b0.input_ids[1, 0] == 6 and b1.input_ids[0, 0] == 12
    np.save(tmp_path / "tok.npy", tokens.astype(np.int32))
    q = plan(dp=1, m=1, batch=2, kind="file", path=str(tmp_path / "tok.npy"))
    assert torch.equal(data.global_batch(q, 0).input_ids, b0.input_ids)
    with pytest.raises(PipeplanError, match="does not exist"):
        data.global_batch(plan(kind="file", path=str(tmp_path / "nope.bin")), 0)


def test_lr_schedules():
    const = LRScheduleSpec("constant", warmup=2)
    assert [lr_factor(const, t, 10, 1.0) for t in range(4)] == [0.5, 1.0, 1.0, 1.0]
    cos = LRScheduleSpec("cosine", warmup=0, min_lr=0.1)
    assert lr_factor(cos, 0, 10, 1.0) == pytest.approx(1.0)
    assert lr_factor(cos, 5, 10, 1.0) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 2)))
    assert lr_factor(cos, 10, 10, 1.0) == pytest.approx(0.1)


def test_optimizers_take_the_plans_arguments():
    w = torch.nn.Parameter(torch.zeros(2))
    sgd = build_optimizer([w], TrainSpec(optimizer=OptimizerSpec("sgd", lr=0.5, momentum=0.9)))
    assert isinstance(sgd, torch.optim.SGD) and sgd.param_groups[0]["momentum"] == 0.9
    adamw = build_optimizer([w], TrainSpec(optimizer=OptimizerSpec(lr=0.1, betas=(0.8, 0.9),
                                                                   weight_decay=0.2)))
    assert isinstance(adamw, torch.optim.AdamW)
    assert adamw.param_groups[0]["betas"] == (0.8, 0.9) and adamw.param_groups[0]["weight_decay"] == 0.2


def _stages(n, float_out=True):
    act = ValueSpec("h", (2, 3), "float32" if float_out else "int64")
    return [StageSpec(k, 0, (ValueRef("input_ids", BATCH),) if k == 0 else (ValueRef("h", k - 1),),
                      (act,) if k < n - 1 else (ValueSpec("loss", (), "float32"),), ())
            for k in range(n)]


def test_transfers_follow_the_schedule_and_skip_same_rank_hand_offs():
    s = generate("zbv", ranks=2, microbatches=4)  # rank 0: stages 0, 3; rank 1: stages 1, 2
    planned = {r: plan_rank(s, _stages(4), r) for r in range(2)}
    for r, actions in planned.items():
        assert [p.action for p in actions] == list(s.order[r])
        for p in actions:
            for t in (p.recv, p.send):
                if t is not None:
                    assert t.peer != r
    # stage 1 -> 2 is on rank 1: F(2) receives nothing, F(1) sends nothing
    f1 = [p for p in planned[1] if p.action.op == "F" and p.action.stage == 1]
    f2 = [p for p in planned[1] if p.action.op == "F" and p.action.stage == 2]
    assert all(p.send is None for p in f1) and all(p.recv is None for p in f2)
    # every send has exactly one matching receive on the peer, in the same order per channel
    for src in range(2):
        dst = 1 - src
        sends = [(p.send.direction, p.send.boundary, p.send.microbatch)
                 for p in planned[src] if p.send is not None]
        recvs = [(p.recv.direction, p.recv.boundary, p.recv.microbatch)
                 for p in planned[dst] if p.recv is not None]
        assert sends == recvs
    tags = {p.send.tag(0, 4) for r in planned for p in planned[r] if p.send is not None}
    assert len(tags) == sum(p.send is not None for r in planned for p in planned[r])


def test_integer_boundaries_carry_no_gradient():
    s = generate("1f1b", ranks=2, microbatches=2)
    planned = plan_rank(s, _stages(2, float_out=False), 1)
    assert all(p.send is None for p in planned if p.action.op != "F")
    assert all(p.recv is None or p.recv.direction is Direction.ACTIVATION for p in planned)


def test_compare_flags_differences_and_missing_parameters():
    ref = {"a": torch.ones(3), "b": torch.zeros(2)}
    same = compare([1.0, 0.5], ref, [[1.0, 0.5]], [{"a": torch.ones(3)}, {"b": torch.zeros(2)}])
    assert same.within and same.max_param_diff == 0.0
    off = compare([1.0], ref, [[1.0]], [{"a": torch.ones(3) + 1e-3, "b": torch.zeros(2)}])
    assert not off.within and off.worst_param == "a" and off.max_param_diff == pytest.approx(1e-3, rel=1e-3)
    missing = compare([1.0], ref, [[1.0]], [{"a": torch.ones(3)}])
    assert not missing.within and missing.missing == ("b",)
    assert not compare([1.0], ref, [[1.1]], [ref]).within


def test_free_port_is_bindable():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", free_port()))


def test_measured_bubble_trace_and_costs():
    from pipeplan.backends.runtime.executor import ActionTiming
    from pipeplan.backends.observe.timings import (RankTimings, bubble_report, measured_bubble, measured_costs, measured_latency)
    from pipeplan.backends.observe.trace import chrome_trace

    # rank 0 busy [0,1] and [3,4]; rank 1 busy [1,3]: makespan 4, busy 4 of 8 -> bubble 0.5
    r0 = (ActionTiming("F", 0, 0, 0.0, 1.0, 0.0), ActionTiming("BW", 0, 0, 3.0, 4.0, 2.0))
    r1 = (ActionTiming("F", 1, 0, 1.0, 2.0, 1.0), ActionTiming("BW", 1, 0, 2.0, 3.0, 0.0))
    assert measured_bubble([r0, r1]) == pytest.approx(0.5)
    ranks = [RankTimings(0, 0, 0, 0, (r0,)), RankTimings(1, 1, 0, 0, (r1,))]
    assert measured_costs(ranks, 2, skip=0) == ((1.0, 1.0, 0.0), (1.0, 1.0, 0.0))
    trace = chrome_trace(ranks)
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    # µs: a 1 s action lasts 1e6; receive waits on the p2p lane (tid 1) end where the action starts
    assert [(e["pid"], e["tid"], e["name"], e["ts"], e["dur"]) for e in xs] == [
        (0, 0, "F0.0", 0.0, 1e6), (0, 0, "BW0.0", 3e6, 1e6), (0, 1, "wait BW0.0", 1e6, 2e6),
        (1, 0, "F1.0", 1e6, 1e6), (1, 1, "wait F1.0", 0.0, 1e6), (1, 0, "BW1.0", 2e6, 1e6)]
    schedule = generate("gpipe", ranks=2, microbatches=1)
    report = bubble_report(schedule, ranks)
    assert "measured 0.500" in report and "predicted 0.500" in report
    assert measured_latency(ranks, schedule) == 0.0
    # rank 1 waited from t=0 but F1.0 started 0.25 after F0.0 ended; BW0.0 started the
    # moment BW1.0 ended: samples 0.25 and 0, median 0.125
    late = (ActionTiming("F", 1, 0, 1.25, 2.0, 1.25), r1[1])
    assert measured_latency([ranks[0], RankTimings(1, 1, 0, 0, (late,))], schedule) == 0.125


def test_cpu_lines_say_how_much_of_each_machines_cores_a_step_took():
    """Per machine, the median over the steady steps (after one warm-up) of the ranks'
    processes' CPU seconds per step, of the slots' own threads' CPU, and of the step's wall
    time (the slowest rank's): two ranks on one 2-core host, steps 2-3 taking 0.04 + 0.05
    and 0.05 + 0.06 s of CPU (medians 0.1) in 0.06 and 0.07 s (0.065): 0.1 / (2 x 0.065);
    a rank on another machine its own line; ranks that measured no CPU none."""
    from pipeplan.backends.observe.timings import RankTimings, cpu_lines
    from pipeplan.backends.runtime.executor import ActionTiming

    def step(cpu):
        return (ActionTiming("F", 0, 0, 0.0, 1.0, 0.0, cpu=cpu),)
    a = RankTimings(0, 0, 0, 0, (step(0.01), step(0.02), step(0.03)), cpu=(
        (0.5, 0.9), (0.04, 0.06), (0.05, 0.07)), machine=("h", 2))
    b = RankTimings(1, 1, 0, 0, (step(0.01), step(0.02), step(0.02)), cpu=(
        (0.5, 0.9), (0.05, 0.05), (0.06, 0.06)), machine=("h", 2))
    c = RankTimings(2, 2, 0, 0, (step(0.01),) * 3, cpu=((0.01, 0.02),) * 3,
                    machine=("other", 4))
    lines = cpu_lines([a, b, c, RankTimings(3, 3, 0, 0, (step(0.01),) * 3)])
    assert len(lines) == 2
    assert lines[0].startswith("CPU on h (2 ranks, 2 cores), median of steps 2-3: the ranks' "
                               "processes 100.0 ms per step (45.0 ms in their action slots' "
                               "own threads), the step 65.0 ms")
    assert lines[0].endswith(f"busy {0.1 / (2 * 0.065):.2f} of it")
    assert lines[1].startswith("CPU on other (1 ranks, 4 cores)")


def test_bubble_costs_and_latency_count_whole_slots():
    """The bubble, the per-op costs and the latency all use an action's slot [ready, done]
    (compute plus the runtime's work around it), not its compute alone: the unit the
    simulator charges, so measured and predicted bubbles count the same time as busy."""
    from pipeplan.backends.runtime.executor import ActionTiming
    from pipeplan.backends.observe.timings import (RankTimings, check_bubble, format_bubble, measured_bubble, measured_costs, measured_latency)
    from pipeplan.backends.observe.trace import chrome_trace

    # rank 0: F0 slot [0, 2] (compute [0.5, 1.5]: posting before, sending after), BW0 [5, 7];
    # rank 1: blocked [0, 2.5] on F0's output, F1 slot [2.5, 4.5], BW1 [4.5, 5]
    r0 = (ActionTiming("F", 0, 0, 0.5, 1.5, 0.0, 0.0, 2.0),
          ActionTiming("BW", 0, 0, 5.5, 6.5, 2.0, 5.0, 7.0))
    r1 = (ActionTiming("F", 1, 0, 2.75, 4.25, 2.5, 2.5, 4.5),
          ActionTiming("BW", 1, 0, 4.5, 5.0, 0.0))
    assert r1[1].ready == 4.5 and r1[1].done == 5.0  # defaults: the compute interval
    # busy = 2 + 2 + 2 + 0.5 = 6.5 of 2 x 7; with compute only it would be 4 of 14
    assert measured_bubble([r0, r1]) == pytest.approx(1 - 6.5 / 14)
    ranks = [RankTimings(0, 0, 0, 0, (r0,)), RankTimings(1, 1, 0, 0, (r1,))]
    assert measured_costs(ranks, 2, skip=0) == ((2.0, 2.0, 0.0), (2.0, 0.5, 0.0))
    schedule = generate("gpipe", ranks=2, microbatches=1)
    # F1 waited from 0, ready 0.5 after F0's slot ended; BW0 from 2, ready 0 after BW1: mean
    assert measured_latency(ranks, schedule) == pytest.approx(0.25)
    # so the simulation of the same costs and latency reproduces the measured timeline
    check = check_bubble(schedule, ranks, warmup=0)
    assert check.predicted == pytest.approx(check.measured)
    # replaying the step with its own slots and transfer delays (F1's input came 0.5 after
    # F0's slot ended, BW0's at once) reproduces it too, and the end-of-run line says both
    assert check.replayed == pytest.approx(check.measured)
    assert f"; {check.replayed:.3f} replaying each step's own measured op times" in \
        format_bubble(check)
    # the trace draws the slot outside the compute on the runtime lane; waits end at `ready`
    xs = [(e["pid"], e["tid"], e["ts"], e["dur"]) for e in chrome_trace(ranks)["traceEvents"]
          if e["ph"] == "X" and e["tid"] in (1, 3)]
    assert sorted(xs) == sorted([(0, 3, 0.0, 0.5e6), (0, 3, 1.5e6, 0.5e6), (0, 1, 3e6, 2e6),
                                 (0, 3, 5e6, 0.5e6), (0, 3, 6.5e6, 0.5e6), (1, 1, 0.0, 2.5e6),
                                 (1, 3, 2.5e6, 0.25e6), (1, 3, 4.25e6, 0.25e6)])


def test_progress_bar_on_a_terminal_plain_lines_otherwise():
    """Rank 0's progress: a live bar (step, loss, tokens/s, ETA) on a terminal; the plain
    per-step line scripts parse when stdout is not one."""
    import dataclasses
    import io

    from pipeplan.backends.observe.progress import Progress
    from pipeplan.backends.runtime.trainer import StepReport

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    first = StepReport(0, 2.5, 1.0, 0.01, 0.5, 1000, ())
    tty = Terminal()
    bar = Progress(3, stream=tty)
    bar.step(first)
    bar.step(dataclasses.replace(first, step=1, loss=2.25))
    bar.close()
    shown = tty.getvalue().split("\r")[-1]
    assert shown.startswith("train:") and "2/3" in shown and "loss 2.2500" in shown
    assert "2,000 tok/s" in shown and "<" in shown  # elapsed<ETA
    assert "step 1/3" not in tty.getvalue()
    pipe = io.StringIO()
    plain = Progress(3, stream=pipe)
    plain.step(first)
    plain.close()
    assert plain.bar is None and pipe.getvalue() == (
        "step 1/3  loss 2.5000  lr 1.00e-02  grad_norm 1.000  2,000 tok/s  500 ms\n")


def _bucket_holds_gradients_once(rank, world):
    from pipeplan.backends.runtime.grads import _Bucket

    torch.manual_seed(rank)
    params = [torch.nn.Parameter(torch.zeros(3, 4)), torch.nn.Parameter(torch.zeros(5))]
    grads = [torch.randn(3, 4), torch.randn(5)]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    bucket = _Bucket(params, None)
    during = [p.grad for p in params]  # the values live only in the flat buffer meanwhile
    bucket.finish()
    views = all(p.grad.untyped_storage().data_ptr() == bucket.flat.untyped_storage().data_ptr()
                for p in params)
    return during, views, [p.grad.clone() for p in params], grads


def test_a_data_parallel_bucket_never_holds_the_gradients_twice(spawn):
    """While a bucket's all-reduce runs the parameters' own .grads are gone (the flat buffer
    holds the values), and afterwards they are views of the reduced buffer (no copy): the
    sum over the two ranks, computed here independently."""
    results = spawn(_bucket_holds_gradients_once, 2, timeout=60)
    for during, views, reduced, _ in results:
        assert during == [None, None] and views
        for got, a, b in zip(reduced, results[0][3], results[1][3]):
            assert torch.equal(got, a + b)
