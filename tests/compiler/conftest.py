"""Fixtures for the compiler tests: plans built from the AST dataclasses, and stage chaining."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipeplan.compiler.compiled import BATCH, CompiledPlan
from pipeplan.dsl.ast import DataSpec, MeshSpec, ModelSpec, PipelineSpec, Plan, SplitSpec, TrainSpec

REPO = Path(__file__).resolve().parents[2]


def build_plan(source: str, args: dict | None = None, *, pp: int = 2, virtual: int = 1,
               schedule: str = "1f1b", microbatches: int = 2, global_batch: int = 4,
               seq_len: int = 16, split: SplitSpec | None = None, loss: str = "cross_entropy",
               inputs: tuple | None = None, **fields) -> Plan:
    model = ModelSpec(source=source, args=args or {}, loss=loss,
                      **({"inputs": inputs} if inputs else {}),
                      **fields.pop("model_fields", {}))
    # synthetic tokens must stay below the model's vocabulary (the compiler checks it)
    return Plan(model=model, data=DataSpec(seq_len=seq_len, vocab=(args or {}).get("vocab", 8)),
                mesh=fields.pop("mesh", MeshSpec(pp=pp)),
                pipeline=PipelineSpec(schedule=schedule, microbatches=microbatches, virtual=virtual,
                                      split=split or SplitSpec()),
                train=fields.pop("train", TrainSpec(global_batch=global_batch)),
                path=str(REPO / "test.plan"), **fields)


def run_chain(compiled: CompiledPlan, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Run the stage GraphModules in order, feeding each its inputs by ValueRef."""
    values: dict[tuple, torch.Tensor] = {}
    for st in compiled.stages:
        args = [batch[r.name] if r.source == BATCH else values[(r.source, r.name)]
                for r in st.inputs]
        for r in st.inputs:
            assert r.source == BATCH or r.source == st.index - 1
        out = st.module(*args)
        assert isinstance(out, tuple) and len(out) == len(st.outputs)
        for spec, v in zip(st.outputs, out):
            assert tuple(v.shape) == spec.shape and str(v.dtype) == "torch." + spec.dtype
            values[(st.index, spec.name)] = v
    last = compiled.stages[-1]
    assert [o.name for o in last.outputs] == ["loss"]
    return values[(last.index, "loss")]


@pytest.fixture
def make_plan():
    return build_plan


@pytest.fixture
def chain():
    return run_chain
