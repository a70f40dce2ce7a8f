"""The compiler's real stage GraphModules, rewritten by parallelize_stage, train like the model.

The example plans are compiled as the runtime compiles them; each of 2 gloo ranks runs all 4 stages itself (the pipeline's p2p
is the runtime's business, tested there) with the runtime's StageRunner and
split backward, and its gradients, summed per `grad_group` (or gathered from
their TP shards), equal the single-process reference's:

* MoE example, dp2 x ep2 (one dp rank per process, one EP group): the
  reference runs chunk by chunk (the model's aux loss per call); sequence
  parallel with MoE layers is refused at the plan line (test_experts_plan_errors);
* dense hybrid example, tp2 (with and without sequence parallel): the last
  stage's loss becomes the vocab-parallel cross-entropy.
"""
from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from pipeplan.backends.runtime import data
from pipeplan.backends.state.model import model_loss
from pipeplan.backends.parallel import (build_parallel_groups, parallelize_stage)
from pipeplan.backends.runtime.stage import StageRunner
from pipeplan.backends.parallel.tp import gather_full, tp_shard_dims
from pipeplan.compiler.compiled import BATCH
from pipeplan.compiler.driver import compile_plan
from pipeplan.compiler.capture.loading import load_model
from pipeplan.dsl.ast import MeshSpec
from pipeplan.dsl.load import load_plan

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SMALL = ["model.args.dim=16", "model.args.seq_len=8", "data.seq_len=8", "model.args.vocab=32",
         "data.vocab=32", "train.global_batch=8", "pipeline.microbatches=2"]
TOL = dict(rtol=1e-5, atol=1e-5)


def _compiled(name: str, overrides=()):
    plan = load_plan(str(EXAMPLES / name), overrides=SMALL + list(overrides))
    leaves = plan.model.leaf_modules
    plan = dataclasses.replace(plan, model=dataclasses.replace(plan.model, leaf_modules=leaves))
    model = load_model(plan, "cpu")
    return plan, copy.deepcopy(model), compile_plan(plan, model)


def _run_stages(plan, compiled, stages, dp, dp_rank):
    """Every stage's F, then B and W, for each microbatch, as one rank holding them all."""
    m = plan.microbatches
    last = len(stages) - 1
    runners = [StageRunner(spec, st.module, spec.index == last, 1.0 / (m * dp))
               for spec, st in zip(compiled.stages, stages)]
    batches = data.dp_microbatches(plan, 0, dp_rank)
    for mb in range(m):  # forward through every stage, then B and W back
        values = {}
        for spec, runner in zip(compiled.stages, runners):
            inputs = [batches[mb].field(r.name) if r.source == BATCH else values[r.name]
                      for r in spec.inputs]
            values.update({o.name: v for o, v in zip(spec.outputs, runner.forward(mb, inputs))})
        grads = None
        for spec, runner in reversed(list(zip(compiled.stages, runners))):
            out_grads = None if grads is None else [grads.get(o.name) for o in spec.outputs]
            grads = runner.backward_input(mb, out_grads)
            runner.backward_weight(mb)


def _moe_worker(rank, world, plan, ref, compiled):
    groups = build_parallel_groups(MeshSpec(dp=world, ep=world), None, dist.group.WORLD)
    modules = copy.deepcopy([s.module for s in compiled.stages])  # keeps tied weights tied
    stages = [parallelize_stage(m, plan, groups, compiled.experts) for m in modules]
    assert all(len(s.experts) == 1 for s in stages)
    _run_stages(plan, compiled, stages, world, rank)
    m = plan.microbatches

    chunks = data.chunks(data.global_batch(plan, 0), world * m)
    groups_of_chunks = [[c] for c in range(world * m)]
    for group in groups_of_chunks:
        batch = data.concat([chunks[c] for c in group])
        (model_loss(plan, ref(batch.input_ids), batch.targets) / len(groups_of_chunks)).backward()

    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    seen = set()
    for st in stages:
        for name, p in st.module.named_parameters(remove_duplicate=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            grad = p.grad.clone()
            group = st.grad_group(p)
            if group is not None:
                dist.all_reduce(grad, group=group)
            want = ref_params[name].grad
            layer = st.experts.get(name.rpartition(".")[0])
            if layer is not None and name.endswith((".w_up", ".w_down")):
                want = want[layer.shard.first:layer.shard.stop]
            torch.testing.assert_close(grad, want, **TOL, msg=lambda msg, n=name: f"{n}: {msg}")
    assert len(seen) == len(list(ref.parameters()))


@pytest.mark.slow
def test_compiled_moe_stages_dp2_ep2_equal_reference(run_workers):
    plan, ref, compiled = _compiled("moe_pp2_ep2_zbv.plan")
    run_workers(_moe_worker, 2, plan, ref, compiled)


def _tp_worker(rank, world, plan, ref, compiled):
    groups = build_parallel_groups(MeshSpec(tp=world), dist.group.WORLD, None)
    modules = copy.deepcopy([s.module for s in compiled.stages])
    stages = [parallelize_stage(m, plan, groups) for m in modules]
    assert stages[-1].tensor.rewrites.get("lm_head") == "vocab+loss"
    _run_stages(plan, compiled, stages, 1, 0)
    for chunk in data.chunks(data.global_batch(plan, 0), plan.microbatches):
        (model_loss(plan, ref(chunk.input_ids), chunk.targets) / plan.microbatches).backward()

    # The embedding (stage 0) and the LM head (stage 3) stay one tied vocab shard.
    assert stages[0].module.get_submodule("tok_emb").weight is \
        stages[-1].module.get_submodule("lm_head").weight
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    for st in stages:
        st.sync_sequence_parallel()
    seen = set()
    for st in stages:
        dims = tp_shard_dims(st.module)
        for name, p in st.module.named_parameters(remove_duplicate=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            full = gather_full(p.grad, dims.get(name), groups.tp)
            torch.testing.assert_close(full, ref_params[name].grad, **TOL,
                                       msg=lambda msg, n=name: f"{n}: {msg}")
    assert len(seen) == len(list(ref.parameters()))


@pytest.mark.slow
@pytest.mark.parametrize("sequence_parallel", ["false", "true"])
def test_compiled_gpt_stages_tp2_equal_reference(run_workers, sequence_parallel):
    plan, ref, compiled = _compiled("hybrid_pp2_dp2_tp2.plan",
                                    ["mesh.dp=1", "zero=0", "model.args.heads=2", "tensor.vocab=[tok_emb, lm_head]",
                                     f"tensor.sequence_parallel={sequence_parallel}"])
    run_workers(_tp_worker, 2, plan, ref, compiled)
