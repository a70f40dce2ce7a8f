"""One float64 equivalence check shared by the TP and context-parallel tests: the plan's
pipelined run on this rank against `tp_reference.reference_run` (which uses no pipeplan code).
Called inside a worker process of `run_workers`."""
from __future__ import annotations

import torch

from .tp_reference import reference_run

TOL = dict(rtol=1e-9, atol=1e-12)


def assert_trains_like_reference(plan, label: str, steps: int, inspect=None) -> None:
    """`steps` optimizer steps of `plan` on this rank equal the single-process reference:
    every loss, and every parameter this rank holds. `inspect(trainer)` may assert on the
    rewritten stages before training."""
    from pipeplan.backends.state.model import build_model
    from pipeplan.backends.runtime.topology import build_topology
    from pipeplan.backends.runtime.trainer import PipelineTrainer
    from pipeplan.compiler.driver import compile_plan

    ref_losses, ref_params = reference_run(plan, build_model(plan), steps)
    compiled = compile_plan(plan, build_model(plan).double())
    trainer = PipelineTrainer(plan, compiled, build_topology(plan.mesh, "cpu"))
    if inspect is not None:
        inspect(trainer)
    losses = [trainer.step(t).loss for t in range(steps)]
    torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64),
                               torch.tensor(ref_losses, dtype=torch.float64), **TOL,
                               msg=lambda m: f"{label}: losses {losses} vs {ref_losses}: {m}")
    params = trainer.named_parameters()
    assert params, label
    for name, value in params.items():
        torch.testing.assert_close(value, ref_params[name], **TOL,
                                   msg=lambda m, name=name: f"{label}: {name}: {m}")
