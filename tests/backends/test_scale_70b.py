"""A 70B-shaped plan (the full 80 layers, Llama-shaped, width scaled down to fit a test) on
pp=8: compiled on meta, one rank materialises only its tenth of the blocks and runs its
first action of step 1; nothing else of the model ever gets storage."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipeplan.backends.state.model import own_stages
from pipeplan.backends.runtime.stage import StageRunner
from pipeplan.compiler.driver import compile_plan
from pipeplan.dsl.ast import DataSpec, MeshSpec, ModelSpec, PipelineSpec, Plan, TrainSpec

LLAMA = str(Path(__file__).parents[1] / "compiler" / "models.py") + ":Llama"


@pytest.mark.slow
def test_70b_shape_rank_reaches_its_first_action_holding_only_its_stages():
    args = {"vocab": 512, "dim": 128, "layers": 80, "heads": 8, "kv_heads": 2, "ffn": 352}
    plan = Plan(model=ModelSpec(LLAMA, args=args, capture="fx"),
                data=DataSpec(seq_len=16, vocab=512, seed=0), mesh=MeshSpec(pp=8),
                pipeline=PipelineSpec(schedule="1f1b", microbatches=8),
                train=TrainSpec(steps=1, global_batch=8, seed=0))
    compiled = compile_plan(plan)
    rank = 3
    nbytes = own_stages(plan, compiled, rank)
    assert nbytes == compiled.estimates.ranks[rank].param_bytes
    total = sum(p.numel() * 4 for p in {id(p): p for s in compiled.stages
                                        for p in s.module.parameters()}.values())
    assert nbytes < total / 6  # a tenth of the blocks (no embedding, no head)
    for st in compiled.stages:
        on = {p.device.type for p in st.module.parameters()}
        assert on == ({"cpu"} if st.rank == rank else {"meta"}), st.index
    first = compiled.schedule.order[rank][0]
    spec = compiled.stages[first.stage]
    assert first.op == "F" and first.microbatch == 0 and spec.rank == rank
    runner = StageRunner(spec, spec.module, is_last=False)
    inputs = [torch.randn(v.shape) for v in compiled.stages[first.stage - 1].outputs]
    (out,) = runner.forward(0, inputs)
    assert out.shape == spec.outputs[0].shape and bool(torch.isfinite(out).all())
