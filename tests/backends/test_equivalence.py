"""Equivalence: every schedule kind, pp in {2, 4} and pp=2 x dp=2, dense tied GPT and MoE GPT.

Three optimizer steps (gradient clipping on, fp32, gloo) must give the same
per-step losses and every parameter as single-process training of the
unmodified model on the same batches (rtol 1e-5, atol 1e-6): SGD with
momentum everywhere; AdamW on pp=2 as well, where the attention key biases
(exact gradient zero, see compare.py) are held to |diff| <= lr x steps. To stay fast on
2 cores, one spawned world runs many configurations in a row (fresh stages
and process groups per configuration, one default group).
"""
from __future__ import annotations

import pytest

from pipeplan.backends.compare import compare, noise_level
from pipeplan.backends.reference import train_reference
from pipeplan.backends.trainer import PipelineTrainer
from pipeplan.dsl.ast import (DataSpec, MeshSpec, ModelSpec, OptimizerSpec, PipelineSpec, Plan,
                              TrainSpec)

KINDS = ("gpipe", "1f1b", "interleaved", "zbh1", "zbh2", "zbv", "vhalf", "vmin", "dualpipev", "auto")
TWO_STAGES_PER_RANK = {"interleaved", "zbv", "vhalf", "vmin", "dualpipev"}
MODELS = {"gpt": "pipeplan.examples.models.gpt:GPT",
          "moe": "pipeplan.examples.models.moe_gpt:MoEGPT"}
STEPS = 3


SGD = OptimizerSpec(name="sgd", lr=0.05, momentum=0.9, weight_decay=0.1)
ADAMW = OptimizerSpec(name="adamw", lr=3e-3, weight_decay=0.1)


def make_plan(model: str, kind: str, pp: int, dp: int, optimizer: OptimizerSpec = SGD) -> Plan:
    args = {"vocab": 64, "dim": 32, "layers": 4, "heads": 4, "seq_len": 16}
    if model == "moe":
        args.update(num_experts=4, top_k=2)
    m = 2 * pp  # dualpipev needs m >= 2p; global batch 8 = dp * m * microbatch_size
    return Plan(model=ModelSpec(MODELS[model], args=args),
                data=DataSpec(seq_len=16, vocab=64, seed=7),
                mesh=MeshSpec(pp=pp, dp=dp),
                pipeline=PipelineSpec(schedule=kind, microbatches=m,
                                      virtual=2 if kind in TWO_STAGES_PER_RANK else 1),
                train=TrainSpec(steps=STEPS, global_batch=8, grad_clip=0.5, seed=11,
                                optimizer=optimizer))


def configs(world: int) -> list[tuple[str, int, int, OptimizerSpec]]:
    """SGD with momentum everywhere (strict: every parameter within rtol/atol); AdamW on
    pp=2 too, where zero-gradient parameters are held to the noise bound (compare.py)."""
    if world == 2:
        return [(k, 2, 1, opt) for opt in (SGD, ADAMW) for k in KINDS]
    return ([(k, 4, 1, SGD) for k in KINDS]
            + [(k, 2, 2, SGD) for k in ("1f1b", "interleaved", "zbh1", "zbv")])


def _worker(rank, world, model):
    out = []
    for kind, pp, dp, opt in configs(world):
        plan = make_plan(model, kind, pp, dp, opt)
        trainer = PipelineTrainer.for_plan(plan)
        losses = [trainer.step(t).loss for t in range(STEPS)]
        out.append((losses, trainer.named_parameters()))
    return out


@pytest.mark.slow
@pytest.mark.timeout(480)
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("model", ["gpt", "moe"])
def test_every_schedule_equals_single_process(spawn, model, world):
    results = spawn(_worker, world, model, timeout=400)
    references = {}
    failures = []
    for k, (kind, pp, dp, opt) in enumerate(configs(world)):
        plan = make_plan(model, kind, pp, dp, opt)
        key = (dp, plan.microbatches, opt.name)
        if key not in references:
            references[key] = train_reference(plan, STEPS)
        ref = references[key]
        noise = frozenset(noise_level(ref.grad_max)) if opt is ADAMW else frozenset()
        got = compare(ref.losses, ref.params, [r[k][0] for r in results],
                      [r[k][1] for r in results], rtol=1e-5, atol=1e-6,
                      noise_params=noise, noise_bound=opt.lr * STEPS * 1.01)
        if not got.within:
            failures.append(f"{kind} pp={pp} dp={dp} {opt.name}: " + got.render(1e-5, 1e-6))
        assert noise <= {n for n in ref.params if n.endswith("attn.k.bias")}
    assert not failures, "\n".join(failures)
    assert len(set(ref.losses)) == STEPS and min(ref.grad_norms) > 0  # it trained
