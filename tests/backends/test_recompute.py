"""Activation recompute in the runtime: exact gradients, one recompute per microbatch, less saved.

* In one process, through the runtime's StageRunner on the compiled GPT's
  two stages: full and selective recompute give bitwise the gradients of no
  recompute, with BW and with split backward (B then W), each region is
  recomputed once per microbatch (W after B reuses B's recompute), and the
  saved-tensor bytes per microbatch fall; they are compared with the
  compiler's estimate (numbers in docs/runtime.md).
* Pipelined (gloo, pp=2, 3 steps, fp64): full and selective under every
  schedule kind (split backward B/W in zbh1, zbh2, zbv, ...) equal
  single-process training, judged in float64 (rtol 1e-9, atol 1e-12).
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import weakref

import pytest
import torch

from pipeplan.backends.runtime import data, recompute
from pipeplan.backends.state.model import build_model
from pipeplan.backends.verify.reference import train_reference
from pipeplan.backends.runtime.stage import StageRunner
from pipeplan.backends.runtime.trainer import PipelineTrainer
from pipeplan.backends.verify.run import FirstStepGrads, judge, rank_result
from pipeplan.compiler.driver import compile_plan
from pipeplan.dsl.ast import RecomputeRule
from pipeplan.errors import PipeplanError

from .test_equivalence import KINDS, STEPS, make_plan

FULL = RecomputeRule("layers.*", "full")
SELECTIVE = RecomputeRule("layers.*", "selective")


def recompute_plan(kind: str, rule):
    plan = make_plan("gpt", kind, 2, 1)
    return dataclasses.replace(plan, recompute=(rule,) if rule else ())


def run_two_stages(rule, split: bool, monkeypatch):
    """Both stages of the pp=2 GPT in this process for two microbatches; returns (grads by
    name, saved bytes per stage of microbatch 1, estimates, each recompute's count so far)."""
    plan = recompute_plan("1f1b", rule)
    compiled = compile_plan(plan, build_model(plan))
    calls = []
    original = recompute._RegionCall._recompute
    def counted(self):  # how many times this region call has recomputed so far
        self.times = getattr(self, "times", 0) + 1
        calls.append(self.times)
        original(self)

    monkeypatch.setattr(recompute._RegionCall, "_recompute", counted)
    specs = compiled.stages
    runners = [StageRunner(st, st.module, st.index == 1, 0.25, recompute=plan.recompute)
               for st in specs]
    for r in runners:
        r.measure_saved()
    batches = data.dp_microbatches(plan, 0, 0)
    for mb in range(2):
        b = batches[mb]
        out = runners[0].forward(mb, [b.field(x.name) for x in specs[0].inputs])
        vals = {v.name: o for v, o in zip(specs[0].outputs, out)}
        runners[1].forward(mb, [b.field(x.name) if x.source == "batch" else vals[x.name]
                                for x in specs[1].inputs])
        if split:
            g = runners[1].backward_input(mb)
            runners[1].backward_weight(mb)
            runners[0].backward_input(mb, [g.get(v.name) for v in specs[0].outputs])
            runners[0].backward_weight(mb)
        else:
            g = runners[1].backward_full(mb)
            runners[0].backward_full(mb, [g.get(v.name) for v in specs[0].outputs])
    grads = {n: p.grad.clone() for r in runners for n, p in r.module.named_parameters()}
    return grads, [r.saved_bytes[1] for r in runners], [st.activation_bytes for st in specs], calls


@pytest.mark.parametrize("rule", [FULL, SELECTIVE], ids=["full", "selective"])
@pytest.mark.parametrize("split", [False, True], ids=["BW", "B+W"])
def test_recompute_is_exact_once_and_saves_less(rule, split, monkeypatch):
    want, saved_none, est_none, _ = run_two_stages(None, False, monkeypatch)
    got, saved, est, calls = run_two_stages(rule, split, monkeypatch)
    for name, g in want.items():
        assert (got[name] - g).abs().max() == 0, name
    # 2 layers per stage x 2 stages x 2 microbatches, each recomputed exactly once
    assert calls == [1] * 8
    for s in (0, 1):
        assert saved[s] < saved_none[s]
        if rule is FULL:  # only block inputs (+ what lies outside the blocks) stay
            assert saved[s] < saved_none[s] / 4
            assert abs(saved[s] - est[s]) <= 0.1 * est[s]  # measured vs the compiler's estimate
    assert all(abs(m - e) <= 0.1 * e for m, e in zip(saved_none, est_none))


@pytest.mark.parametrize("rule", [FULL, SELECTIVE], ids=["full", "selective"])
@pytest.mark.parametrize("split", [False, True], ids=["BW", "B+W"])
def test_recompute_state_dies_with_the_microbatch(rule, split, monkeypatch):
    """Nothing of a microbatch's recompute (placeholders, cache) outlives its backward."""
    plan = recompute_plan("1f1b", rule)
    spec = compile_plan(plan, build_model(plan)).stages[1]
    runner = StageRunner(spec, spec.module, True, 0.25, recompute=plan.recompute)
    alive = weakref.WeakSet()
    init = recompute._RegionCall.__init__
    monkeypatch.setattr(recompute._RegionCall, "__init__",
                        lambda self, *a: alive.add(self) or init(self, *a))
    batch = data.dp_microbatches(plan, 0, 0)[0]
    for mb in range(3):
        x = torch.randn(2, 16, 32, dtype=torch.float64)  # make_plan trains in fp64
        runner.forward(mb, [x if v.source != "batch" else batch.field(v.name)
                            for v in spec.inputs])
        if split:
            runner.backward_input(mb)
            runner.backward_weight(mb)
        else:
            runner.backward_full(mb)
    gc.collect()
    assert len(alive) == 0 and runner.program is not None


CONFIGS = [(kind, rule) for kind in KINDS for rule in (FULL, SELECTIVE)]


def _worker(rank, world):
    out = []
    for kind, rule in CONFIGS:
        plan = recompute_plan(kind, rule)
        trainer = PipelineTrainer.for_plan(plan)
        assert any(r.program is not None for r in trainer.runners.values())
        grads = FirstStepGrads(trainer)
        losses = [trainer.step(t).loss for t in range(STEPS)]
        out.append(rank_result(losses, trainer, grads))
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_pipelined_recompute_equals_single_process(spawn):
    results = spawn(_worker, 2, timeout=240)
    ref = train_reference(recompute_plan("1f1b", None), STEPS)
    failures = []
    for k, (kind, rule) in enumerate(CONFIGS):
        got = judge(ref, [r[k] for r in results])  # float64: rtol 1e-9, atol 1e-12
        if not got.within:
            failures.append(f"{kind} {rule.mode}: " + got.render())
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("write", ["method", "aten"])
def test_inplace_write_into_a_region_input_is_refused(write):
    """`x.mul_(2)` as fx writes it, or `aten.mul_` as export does (read off its schema)."""
    class Block(torch.nn.Module):
        def forward(self, x):
            return (x.mul_(2) if write == "method" else torch.ops.aten.mul_.Tensor(x, 2)) + 1

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.block = Block()

        def forward(self, x):
            return self.block(x * 1)

    gm = torch.fx.symbolic_trace(Model())
    with pytest.raises(PipeplanError, match="modifies its input .* in place"):
        recompute.StageProgram(gm, (RecomputeRule("block", "full"),), contextlib.nullcontext,
                               recompute.Phase())


class _Residual(torch.nn.Module):
    """Falcon's block end, as export writes it: the MLP's output summed into in place with
    the attention's (`aten.add_`); `reread`: the overwritten value is also read elsewhere."""

    def __init__(self, reread: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.attn, self.up, self.down = (torch.nn.Linear(8, 8), torch.nn.Linear(8, 16),
                                         torch.nn.Linear(16, 8))
        self.reread = reread

    def forward(self, x):
        a = self.attn(x)
        y = self.down(torch.relu(self.up(x)))
        other = y * 3 if self.reread else 0
        y = torch.ops.aten.add_.Tensor(y, a)  # (export's later uses read the write's node)
        return torch.tanh(y) + other  # (a rerun node that reads the write)


class _Wrapped(torch.nn.Module):
    def __init__(self, reread: bool = False):
        super().__init__()
        self.block = _Residual(reread)

    def forward(self, x):
        return self.block(x * 1).sum()


def test_an_aten_write_in_place_under_selective_recompute_is_kept():
    """A write in place (an ATen op whose schema marks the argument written) reruns under
    neither rule as a second write: `full` reruns it on a recomputed input, `selective`
    keeps it (it has no matmul work, so it was rerun on its kept input and failed:
    "a leaf Variable that requires grad is being used in an in-place operation")."""
    x = torch.randn(4, 8, dtype=torch.float64)
    model = _Wrapped().double()
    model(x).backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    for mode in ("selective", "full"):
        model.zero_grad()
        gm = torch.fx.symbolic_trace(model)
        program = recompute.StageProgram(gm, (RecomputeRule("block", mode),),
                                         contextlib.nullcontext, recompute.Phase())
        program(x).backward()
        for n, p in gm.named_parameters():
            torch.testing.assert_close(p.grad, want[n], rtol=0, atol=0, msg=f"{mode} {n}")


def test_an_aten_write_into_a_value_read_elsewhere_is_refused_under_selective():
    gm = torch.fx.symbolic_trace(_Wrapped(reread=True))
    with pytest.raises(PipeplanError, match="overwrites .* in place, which .* also reads"):
        recompute.StageProgram(gm, (RecomputeRule("block", "selective"),),
                               contextlib.nullcontext, recompute.Phase())
    recompute.StageProgram(gm, (RecomputeRule("block", "full"),), contextlib.nullcontext,
                           recompute.Phase())
