"""Any transformers model, wrapped or with its default kernels, verifies EQUAL in float64.

* Initialisation: a user module holding a transformers model (`self.model =
  LlamaForCausalLM(config)`, no init rule of its own) is initialised module by module by
  the nearest enclosing `_init_weights` -- Llama's and Mixtral's own -- and trains under
  pp2 1F1B exactly as the single-process reference; `pipeplan check` proves every
  parameter covered and refuses, at the model line, a parameter that no rule writes.
* Kernels: Qwen3-MoE and the wrapped Mixtral keep transformers' default experts kernel
  (`grouped_mm`, which has no float64 kernel); in float64 both the pipelined run and the
  reference run the model's own `batched_mm` instead, said in verify's report.

The pipelined side is verify's rank code (tests/backends/judging.py `train_for_judge`),
the reference `train_reference` (the unmodified model's forward on one process), the verdict `judge`.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from pipeplan.dsl import PlanError
from pipeplan.dsl.ast import (DataSpec, InputSpec, MeshSpec, ModelSpec, OptimizerSpec,
                              PipelineSpec, Plan, TrainSpec)

STEPS = 3
FAMILIES = "pipeplan.tests.parallel.families"


def plan_for(model: str, pp: int = 2, schedule: str = "1f1b") -> Plan:
    return Plan(
        model=ModelSpec(f"{FAMILIES}:{model}", capture="export",
                        inputs=(InputSpec("input_ids", "int64", ("batch", "seq")),)),
        data=DataSpec(seq_len=8, vocab=64, seed=7),
        mesh=MeshSpec(pp=pp),
        pipeline=PipelineSpec(schedule=schedule, microbatches=2,
                              virtual=2 if schedule == "zbv" else 1),
        train=TrainSpec(steps=STEPS, global_batch=4, grad_clip=0.5, seed=11, precision="fp64",
                        optimizer=OptimizerSpec(name="adamw", lr=3e-3, weight_decay=0.1)))


def _worker(rank, world, models):
    from .judging import train_for_judge

    return [train_for_judge(plan_for(m), STEPS) for m in models]


def _judged(results, models) -> None:
    from pipeplan.backends.verify.reference import train_reference
    from pipeplan.backends.verify.run import judge

    failures = []
    for k, model in enumerate(models):
        ref = train_reference(plan_for(model), STEPS)
        verdict = judge(ref, [r[k] for r in results])
        assert len(set(ref.losses)) == STEPS and min(ref.grad_norms) > 0  # it trained
        if not verdict.within:
            failures.append(f"{model}: {verdict.render()}")
    assert not failures, "\n".join(failures)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_wrapped_llama_and_mixtral_pp2_equal_reference(spawn):
    models = ["WrappedLlama", "WrappedMixtral"]
    _judged(spawn(_worker, 2, models, timeout=580), models)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_qwen3_moe_default_grouped_mm_pp2_equals_reference(spawn):
    from pipeplan.backends.verify.reference import train_reference

    ref = train_reference(plan_for("qwen3_moe"), 1)
    assert ref.notes and "batched_mm" in ref.notes[0] and "grouped_mm" in ref.notes[0]
    _judged(spawn(_worker, 2, ["qwen3_moe"], timeout=580), ["qwen3_moe"])


def test_wrapped_models_are_initialised_by_the_enclosing_pretrained_model():
    from pipeplan.compiler.capture.init_rules import check_init, init_owner
    from pipeplan.compiler.capture.loading import load_model

    for name, inner in (("WrappedLlama", "LlamaModel"), ("WrappedMixtral", "MixtralModel")):
        plan = plan_for(name)
        model = load_model(plan, "meta")
        check_init(plan, model)  # every parameter covered: no PlanError
        assert type(init_owner(model, "model.model.layers.0.input_layernorm")).__name__ \
            == inner
        assert type(init_owner(model, "model.lm_head")).__name__.endswith("ForCausalLM")
        assert init_owner(model, "") is None  # the wrapper itself has no rule


def test_default_kernel_switch_only_in_float64():
    import torch

    from pipeplan.compiler.estimate.precision import exact_experts_kernels, kernel_notes
    from pipeplan.compiler.capture.loading import load_model

    plan = plan_for("WrappedMixtral")
    model = load_model(plan, "meta")
    assert exact_experts_kernels(model, torch.float32) is None
    assert model.model.get_experts_implementation()[""] == "grouped_mm"
    note = exact_experts_kernels(model, torch.float64)
    assert model.model.get_experts_implementation()[""] == "batched_mm"
    assert kernel_notes(model) == [note] and "experts_implementation" in note


SKIPS_BIAS = """\
import torch
from torch import nn
class Affine(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.bias = nn.Parameter(torch.empty(d))
    def reset_parameters(self):
        nn.init.ones_(self.weight)  # the bias is left as it is
    def forward(self, x):
        return x * self.weight + self.bias
class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 8)
        self.affine = Affine(8)
        self.head = nn.Linear(8, 64)
    def forward(self, input_ids):
        return self.head(self.affine(self.emb(input_ids)))
"""


def test_check_refuses_a_rule_that_does_not_write_a_parameter(tmp_path):
    """A bias its constructor leaves uninitialised (`torch.empty`) and its rule skips."""
    from pipeplan.compiler import estimates_summary
    from pipeplan.compiler.capture.init_rules import check_init
    from pipeplan.compiler.capture.loading import load_model

    (tmp_path / "m.py").write_text(SKIPS_BIAS)
    plan = dataclasses.replace(plan_for("M", pp=1), model=ModelSpec(
        str(tmp_path / "m.py") + ":M", capture="fx",
        inputs=(InputSpec("input_ids", "int64", ("batch", "seq")),)))
    with pytest.raises(PlanError) as e:
        estimates_summary(plan)
    said = str(e.value)
    assert "module `affine` (Affine): its init rule (Affine.reset_parameters()) does not " \
           "set bias" in said, said
    # the same module with its bias written passes
    (tmp_path / "m2.py").write_text(SKIPS_BIAS.replace(
        "  # the bias is left as it is", "; nn.init.zeros_(self.bias)"))
    check_init(plan, load_model(dataclasses.replace(plan, model=dataclasses.replace(
        plan.model, source=str(tmp_path / "m2.py") + ":M")), "meta"))


def _no_grad_plan() -> Plan:
    """tests/compiler/models.py's NoGradIndexer (its scorers read only under no_grad) on
    dp2 with ZeRO-3 and AdamW's weight decay."""
    return Plan(
        model=ModelSpec("pipeplan.tests.compiler.models:NoGradIndexer", capture="export",
                        inputs=(InputSpec("input_ids", "int64", ("batch", "seq")),)),
        data=DataSpec(seq_len=8, vocab=16, seed=7), mesh=MeshSpec(pp=1, dp=2), zero=3,
        pipeline=PipelineSpec(schedule="1f1b", microbatches=2),
        train=TrainSpec(steps=STEPS, global_batch=8, grad_clip=0.5, seed=11, precision="fp64",
                        optimizer=OptimizerSpec(name="adamw", lr=3e-3, weight_decay=0.1)))


def _no_grad_worker(rank, world):
    from .judging import train_for_judge

    return train_for_judge(_no_grad_plan(), STEPS)


@pytest.mark.slow
def test_a_parameter_read_only_under_no_grad_is_never_stepped(spawn):
    """A scorer read only in a no_grad region gets no gradient from the model, so the
    single-process optimizer never steps it; dp2's reduction and ZeRO-3's flat shards made it
    a zero gradient, and AdamW's weight decay moved it (verify DIFFERENT, 2e-4 off). It is
    trained frozen (compiled.gradless): EQUAL in float64, the scorers at their initial values."""
    from pipeplan.backends.verify.reference import train_reference
    from pipeplan.backends.verify.run import judge
    from pipeplan.compiler import compile_plan

    plan = _no_grad_plan()
    assert compile_plan(plan).gradless == tuple(
        f"layers.{i}.scorer.{w}" for i in (0, 1) for w in ("bias", "weight"))
    results = spawn(_no_grad_worker, 2, timeout=300)
    ref = train_reference(plan, STEPS)
    verdict = judge(ref, results)
    assert verdict.within and verdict.grads_compared, verdict.render()
    assert len(set(ref.losses)) == STEPS


def _frozen_memory_worker(rank, world, zero):
    from pipeplan.backends.runtime.trainer import PipelineTrainer

    plan = dataclasses.replace(_no_grad_plan(), zero=zero, train=dataclasses.replace(
        _no_grad_plan().train, precision="fp32", steps=1))
    trainer = PipelineTrainer.for_plan(plan)
    trainer.step(0)
    return trainer.param_bytes, trainer.grad_bytes, trainer.optimizer_bytes()


@pytest.mark.parametrize("zero", [0, 3])
def test_the_estimate_holds_weights_but_no_state_for_parameters_no_optimizer_steps(spawn, zero):
    """NoGradIndexer's scorers get no gradient (trained frozen): every rank holds their
    weights whole beside ZeRO's flat buffers, and no gradient or optimizer state for them. The
    estimate's parameter, gradient and optimizer bytes equal what each rank's trainer holds
    after its first step (the estimate counted none of the scorers' weights, and their
    gradients and states, before)."""
    from pipeplan.compiler import compile_plan

    plan = dataclasses.replace(_no_grad_plan(), zero=zero, train=dataclasses.replace(
        _no_grad_plan().train, precision="fp32", steps=1))
    est = compile_plan(plan).estimates.ranks
    held = spawn(_frozen_memory_worker, 2, zero, timeout=300)
    for rank, (params, grads, optimizer) in enumerate(held):
        assert (params, grads, optimizer) == (est[rank].param_bytes, est[rank].grad_bytes,
                                              est[rank].optimizer_bytes), (rank, zero)


def _tiny_plan(model: str, capture: str, global_batch: int) -> Plan:
    """tests/compiler/models.py's `model` at pp2 1F1B, float64, AdamW."""
    return Plan(
        model=ModelSpec(f"pipeplan.tests.compiler.models:{model}", capture=capture,
                        inputs=(InputSpec("input_ids", "int64", ("batch", "seq")),)),
        data=DataSpec(seq_len=8, vocab=16, seed=7), mesh=MeshSpec(pp=2),
        pipeline=PipelineSpec(schedule="1f1b", microbatches=2),
        train=TrainSpec(steps=STEPS, global_batch=global_batch, seed=11, precision="fp64",
                        optimizer=OptimizerSpec(name="adamw", lr=3e-3, weight_decay=0.1)))


def _tiny_worker(rank, world, *plan_args):
    from .judging import train_for_judge

    return train_for_judge(_tiny_plan(*plan_args), STEPS)


@pytest.mark.slow
def test_verify_judges_the_buffers_the_forward_writes(spawn):
    """A BatchNorm's running statistics are part of the trained model: verify compares every
    buffer the reference's training wrote (not the reference's extra forward that counts
    draws: undone) on every rank holding it. pp2 1F1B keeps them exact (EQUAL); a statistic
    off by 1e-6 on one rank, or one no rank holds, is DIFFERENT."""
    from pipeplan.backends.verify.reference import train_reference
    from pipeplan.backends.verify.run import judge

    plan = _tiny_plan("Normed", "fx", 8)
    results = spawn(_tiny_worker, 2, "Normed", "fx", 8, timeout=300)
    ref = train_reference(plan, STEPS)
    assert {f"norms.{i}.{b}" for i in range(4)
            for b in ("running_mean", "running_var", "num_batches_tracked")} == set(ref.buffers)
    assert int(ref.buffers["norms.0.num_batches_tracked"]) == STEPS * 2  # 2 chunks a step
    verdict = judge(ref, results, plan=plan)
    assert verdict.within and verdict.buffers_compared, verdict.render()
    assert "max |buffer - reference buffer|" in verdict.render()
    last = next(r for r in results if "norms.3.running_mean" in r["buffers"])
    off = dict(last["buffers"], **{"norms.3.running_mean":
                                   last["buffers"]["norms.3.running_mean"] + 1e-6})
    bad = judge(ref, [r if r is not last else dict(r, buffers=off) for r in results])
    assert not bad.within and bad.worst_buffer == "norms.3.running_mean", bad.render()
    gone = {n: b for n, b in last["buffers"].items() if n != "norms.3.running_var"}
    lost = judge(ref, [r if r is not last else dict(r, buffers=gone) for r in results])
    assert not lost.within and lost.missing == ("norms.3.running_var",), lost.render()


@pytest.mark.slow
def test_a_complex_rotary_table_keeps_its_imaginary_part_in_float64(spawn):
    """torchtitan's complex `freqs_cis` buffer: fp64 converted it with `Module.to(float64)`,
    which keeps a complex tensor's real part alone -- the reference trained another model
    (rotation by cos only) and every rank failed its first send (complex64 where the plan
    said float64). It becomes complex128 on both sides (the constructor's value exactly,
    widened), and pp2 verifies EQUAL."""
    from pipeplan.backends.state.model import build_model
    from pipeplan.backends.verify.reference import train_reference
    from pipeplan.backends.verify.run import judge
    from pipeplan.compiler.estimate.precision import to_precision
    from pipeplan.tests.compiler.models import ComplexRotary

    plan = _tiny_plan("ComplexRotary", "export", 4)
    own = ComplexRotary().freqs_cis
    table = to_precision(build_model(plan), "fp64").freqs_cis
    assert table.dtype == torch.complex128 and torch.equal(table, own.to(torch.complex128))
    results = spawn(_tiny_worker, 2, "ComplexRotary", "export", 4, timeout=300)
    verdict = judge(train_reference(plan, STEPS), results, plan=plan)
    assert verdict.within and verdict.rule.name == "fp64", verdict.render()
