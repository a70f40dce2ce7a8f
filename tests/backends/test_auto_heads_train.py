"""`tensor.plan = auto` on attention normalised within each head (Qwen 3's and Gemma 3's
q_norm / k_norm), split over tp = 2, trains as the single-process model: verify's judge
on every rank's losses, first-step gradients and parameters (the rule the models' own
float32 nodes set). The split itself: tests/parallel/test_tp_auto.py."""
from __future__ import annotations

import pytest

from pipeplan.dsl.load import parse_plan

def _plan(family: str, sp: bool):
    from pipeplan.backends.verify.run import judged_plan
    from pipeplan.tests.parallel.families import family_plan_text

    tensor = f"tensor {{\n  plan = auto\n  sequence_parallel = {str(sp).lower()}\n}}"
    return judged_plan(parse_plan(family_plan_text(family, tensor, layers=2), "plan.plan"),
                       "fp64")


def _worker(rank, world, family, sp):
    from pipeplan.backends.runtime.trainer import PipelineTrainer
    from pipeplan.backends.verify.run import FirstStepGrads, rank_result

    trainer = PipelineTrainer.for_plan(_plan(family, sp))
    grads = FirstStepGrads(trainer)
    losses = [trainer.step(t).loss for t in range(2)]
    return rank_result(losses, trainer, grads)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family, sp", [("qwen3", True),
                                        pytest.param("gemma3", False, marks=pytest.mark.heavy)])
def test_attention_split_on_heads_with_a_norm_within_each_trains_like_the_model(
        spawn, family, sp):
    from pipeplan.backends.verify.reference import train_reference
    from pipeplan.backends.verify.run import judge
    from pipeplan.compiler import compile_plan

    plan = _plan(family, sp)
    assert compile_plan(plan).tp_rewrites["model.layers.0.self_attn.q_proj"] == "column"
    results = spawn(_worker, 2, family, sp, timeout=240, fresh=True)
    verdict = judge(train_reference(plan, 2), results, "fp64", plan)
    assert verdict.within, verdict.render()
