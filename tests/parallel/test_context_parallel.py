"""Context parallel (Ulysses) equals single-process float64 training, and what it cannot
split is refused at the plan line.

Equivalence: `RopeLM` (tests/parallel/cp_models.py: RoPE from position_ids, GQA with 4
heads / 2 KV heads, causal SDPA) with pp2 x cp2 under 1f1b and zbv (split B/W backward
through the all-to-alls), 3 AdamW steps with clipping, against tp_reference.reference_run
(the unmodified model on whole sequences, torch's AdamW; shares no code with the path).
"""
from __future__ import annotations

import pytest
import torch

from pipeplan.dsl.ast import (ContextSpec, DataSpec, InputSpec, MeshSpec, ModelSpec,
                              OptimizerSpec, PipelineSpec, Plan, TrainSpec)

from .tp_reference import reference_run

STEPS = 3
TOL = dict(rtol=1e-9, atol=1e-12)
INPUTS = (InputSpec("input_ids", "int64", ("batch", "seq")),
          InputSpec("position_ids", "int64", ("batch", "seq")))


def make_plan(schedule: str, dp: int = 1) -> Plan:
    return Plan(model=ModelSpec("pipeplan.tests.parallel.cp_models:RopeLM", capture="fx",
                                inputs=INPUTS),
                data=DataSpec(seq_len=16, vocab=64, seed=7,
                              inputs=(("position_ids", "positions"),)),
                mesh=MeshSpec(pp=2, dp=dp, cp=2), context=ContextSpec("ulysses"),
                pipeline=PipelineSpec(schedule=schedule, microbatches=2,
                                      virtual=2 if schedule == "zbv" else 1),
                train=TrainSpec(steps=STEPS, global_batch=4 * dp, grad_clip=0.5, seed=11,
                                optimizer=OptimizerSpec(name="adamw", lr=3e-3,
                                                        weight_decay=0.1)))


def _worker(rank, world, schedules):
    from pipeplan.backends.model import build_model
    from pipeplan.backends.topology import build_topology
    from pipeplan.backends.trainer import PipelineTrainer
    from pipeplan.compiler.driver import compile_plan

    for schedule in schedules:
        plan = make_plan(schedule)
        ref_losses, ref_params = reference_run(plan, build_model(plan), STEPS)
        compiled = compile_plan(plan, build_model(plan).double())
        trainer = PipelineTrainer(plan, compiled, build_topology(plan.mesh, "cpu"))
        n = sum(isinstance(m, torch.nn.Module) and type(m).__name__ == "UlyssesAttention"
                for r in trainer.runners.values() for m in r.module.modules())
        assert n == 4 // plan.mesh.pp, n  # every layer's attention on this rank, wrapped
        losses = [trainer.step(t).loss for t in range(STEPS)]
        torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64),
                                   torch.tensor(ref_losses, dtype=torch.float64), **TOL,
                                   msg=lambda m: f"{schedule}: {losses} vs {ref_losses}: {m}")
        params = trainer.named_parameters()
        assert params
        for name, value in params.items():
            torch.testing.assert_close(value, ref_params[name], **TOL,
                                       msg=lambda m, name=name: f"{schedule}: {name}: {m}")


def test_ulysses_pp2_cp2_equals_reference(run_workers):
    run_workers(_worker, 4, ["1f1b", "zbv"], timeout=280)
