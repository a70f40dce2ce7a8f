"""compile.mode = graphs on real gloo worlds: equal to single-process training, no doubled work.

Judged as tests/backends/test_equivalence.py judges eager (compare.py's fp64 rule, three
optimizer steps with clipping, step-1 gradients and every parameter against the
unmodified model trained in one process). The default suite runs ZBV on a pp=2 GPT and
checks that a ZBV step runs exactly as many matmuls (counted at dispatch) in graphs mode
as in eager mode: B and W split without running the backward twice. The
heavy test runs every schedule kind on the dense and the MoE GPT, and pp=2 x dp=2 with
ZeRO-1/2.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pipeplan.backends.verify.reference import train_reference
from pipeplan.backends.verify.run import judge
from .judging import train_for_judge
from pipeplan.dsl.ast import CompileSpec, ModelSpec, Plan
from pipeplan.tests.backends.test_equivalence import ADAMW, KINDS, SGD, STEPS, make_plan

MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.bmm.default,
           torch.ops.aten.addmm.default, torch.ops.aten.baddbmm.default}


def graphs(plan: Plan, zero: int = 0) -> Plan:
    return dataclasses.replace(plan, compile=CompileSpec(mode="graphs"), zero=zero)


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.matmuls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.matmuls += func in MATMULS
        return func(*args, **(kwargs or {}))


def _counted_run(plan: Plan, judged: bool):
    """Train `plan` for STEPS steps, counting this rank's matmuls in the second step (the
    first traces the graphs); with `judged`, also this rank's result for the judge."""
    from pipeplan.backends.runtime.trainer import PipelineTrainer
    from pipeplan.backends.verify.run import FirstStepGrads, rank_result

    trainer = PipelineTrainer.for_plan(plan)
    grads = FirstStepGrads(trainer) if judged else None
    losses = [trainer.step(0).loss]
    with _Count() as count:
        losses.append(trainer.step(1).loss)
    if not judged:
        return count.matmuls, None
    losses += [trainer.step(t).loss for t in range(2, STEPS)]
    return count.matmuls, rank_result(losses, trainer, grads)


def _judge_all(configs, results) -> list[str]:
    failures, references = [], {}
    for k, plan in enumerate(configs):
        key = (plan.mesh.dp, plan.microbatches, plan.train.optimizer.name, plan.model.source)
        if key not in references:
            references[key] = train_reference(plan, STEPS)
        got = judge(references[key], [r[k] for r in results])
        assert got.grads_compared and got.rule.name == "fp64"
        if not got.within:
            failures.append(f"{plan.pipeline.schedule} pp={plan.mesh.pp} dp={plan.mesh.dp} "
                            f"zero={plan.zero} {plan.model.source}: " + got.render())
    return failures


def _quick_worker(rank, world):
    zbv = make_plan("gpt", "zbv", 2, 1)
    return _counted_run(zbv, False)[0], _counted_run(graphs(zbv), True)


@pytest.mark.timeout(240)
def test_graphs_mode_zbv_equals_single_process_and_runs_no_extra_matmul(spawn):
    out = spawn(_quick_worker, 2, timeout=200)
    for eager, (compiled, _) in out:
        assert eager > 0 and compiled == eager, (eager, compiled)
    failures = _judge_all([graphs(make_plan("gpt", "zbv", 2, 1))], [[o[1][1]] for o in out])
    assert not failures, "\n".join(failures)


def _every_configs(world: int) -> list[Plan]:
    if world == 2:
        return [graphs(make_plan(m, k, 2, 1, opt)) for m in ("gpt", "moe") for k in KINDS
                for opt in (SGD, ADAMW)]
    return [graphs(make_plan("gpt", k, 2, 2, ADAMW), zero)
            for k, zero in (("1f1b", 1), ("zbv", 2), ("dualpipev", 0), ("interleaved", 2))]


def _every_worker(rank, world):
    return [train_for_judge(p, STEPS) for p in _every_configs(world)]


@pytest.mark.heavy
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("world", [2, 4])
def test_every_schedule_kind_in_graphs_mode_equals_single_process(spawn, world):
    results = spawn(_every_worker, world, timeout=1700)
    failures = _judge_all(_every_configs(world), results)
    assert not failures, "\n".join(failures)


HF = {"llama": "pipeplan.tests.compiler.models:tiny_llama",
      "mixtral": "pipeplan.tests.parallel.moe_models:mixtral"}


def hf_plan(model: str, kind: str) -> Plan:
    """transformers' Llama / Mixtral (float64, batched_mm experts) on pp=2 in graphs mode."""
    base = make_plan("gpt", kind, 2, 1, ADAMW)
    return graphs(dataclasses.replace(base, model=ModelSpec(HF[model], capture="export")))


HF_CONFIGS = [(m, k) for m in HF for k in ("1f1b", "interleaved", "zbv", "dualpipev")]


def _hf_worker(rank, world):
    return [train_for_judge(hf_plan(m, k), STEPS) for m, k in HF_CONFIGS]


@pytest.mark.heavy
@pytest.mark.timeout(3000)
def test_hf_llama_and_mixtral_in_graphs_mode_equal_single_process(spawn):
    results = spawn(_hf_worker, 2, timeout=2900)
    failures = _judge_all([hf_plan(m, k) for m, k in HF_CONFIGS], results)
    assert not failures, "\n".join(failures)


def _inductor_worker(rank, world, cache: str, steps: int):
    import os

    from pipeplan.backends.runtime import inductor

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    plan = _fp32(dataclasses.replace(make_plan("gpt", "zbv", 2, 1),
                                     compile=CompileSpec(mode="inductor")), steps)
    result = train_for_judge(plan, steps)
    return result, [(c.part, c.seconds, c.cache_hit) for c in inductor.COMPILES]


def _fp32(plan: Plan, steps: int) -> Plan:
    return dataclasses.replace(plan, train=dataclasses.replace(plan.train, precision="fp32",
                                                               steps=steps))


@pytest.mark.heavy
@pytest.mark.timeout(3000)
def test_inductor_zbv_20_fp32_steps_within_the_fp32_rule_and_cached(spawn, tmp_path):
    steps = 20
    # two worlds, one after the other: the second finds every graph in the on-disk cache
    runs = [spawn(_inductor_worker, 2, str(tmp_path), steps, timeout=1400) for _ in range(2)]
    ref = train_reference(_fp32(make_plan("gpt", "zbv", 2, 1), steps), steps)
    for out in runs:
        got = judge(ref, [o[0] for o in out], precision="fp32")
        assert got.within, got.render()
    for first, second in zip(*runs):
        cold, warm = first[1], second[1]
        assert cold and len(warm) == len(cold) and all(hit for _, _, hit in warm), warm
        print("inductor compile s, cold:", round(sum(s for _, s, _ in cold), 1),
              "warm:", round(sum(s for _, s, _ in warm), 1))


def test_check_reports_the_inductor_cache_cold_then_warm(monkeypatch, tmp_path):
    """`pipeplan check` under compile.mode = inductor names, per stage, the graphs a run
    will compile (cold) or finds compiled (warm): keyed by each graph's code and inputs, so
    a second compile of the plan (another process: the runtime's own) finds the keys the
    first one's graphs were recorded under."""
    from pipeplan.backends.runtime import inductor
    from pipeplan.backends.runtime.source import compile_checked
    from pipeplan.compiler.graphs.split import split_joint

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    plan = _fp32(dataclasses.replace(make_plan("gpt", "zbv", 2, 1),
                                     compile=CompileSpec(mode="inductor")), 1)
    cold = inductor.cache_report(compile_checked(plan))
    assert cold[0].startswith(f"inductor cache: {tmp_path} ")
    assert len(cold) == 5 and all("cold: the first run compiles" in line for line in cold[1:])
    first = compile_checked(plan)
    g = split_joint(first.stages[0].joint)  # the first stage (the embedding: its own graphs)
    for part in (g.F, g.B, g.W, g.BW):  # as compile_part records a cold compile
        inductor._record(inductor.part_key(part), 1.5)
    again = inductor.cache_report(compile_checked(plan))
    assert again[1].startswith("  stage 0: warm (") and "4.5 s cold" in again[1], again
    assert again[-1].startswith("  stage 3: cold: the first run compiles"), again
