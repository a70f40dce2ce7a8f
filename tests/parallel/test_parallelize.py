"""The integration surface: groups from the mesh, stage rewrite, grad groups, ZeRO per stage.

End to end on real gloo ranks: a MoE GPT over dp4 x ep2 (plain DP sync and
ZeRO-3) and a traced GPT stage over tp2 (with and without sequence parallel)
train like the single-process model.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn.functional as F

from pipeplan.backends.parallelize import (
    ExpertCoords, build_parallel_groups, build_zero_optimizer, expert_group_ranks,
    parallelize_stage, reference_chunk_groups, required_leaf_modules)
from pipeplan.backends.tensor_parallel import gather_full_state
from pipeplan.dsl.ast import ExpertsSpec, MeshSpec, ModelSpec, Plan, TensorSpec
from pipeplan.errors import PipeplanError
from pipeplan.examples.models.gpt import GPT
from pipeplan.examples.models.moe_gpt import MoEGPT

TOL = dict(rtol=1e-5, atol=1e-6)
MODEL = ModelSpec(source="examples/models/moe_gpt.py:MoEGPT")
EXPERTS = ExpertsSpec(modules=("layers.*.moe",), num_experts=8, top_k=2, aux_loss=0.01,
                      z_loss=0.001)
TENSOR = TensorSpec(column=("layers.*.attn.q", "layers.*.attn.k", "layers.*.attn.v",
                            "layers.*.mlp.up"),
                    row=("layers.*.attn.proj", "layers.*.mlp.down"), vocab=("tok_emb", "lm_head"))


def sgd(params):
    # SGD, not AdamW: see test_tensor_parallel.py on the key bias's zero gradient.
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _moe_loss(model, ids, targets):
    logits, aux = model(ids)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten()) + aux


def _ep_worker(rank, world, zero):
    mesh = MeshSpec(pp=1, dp=world, ep=2)
    plan = Plan(model=MODEL, mesh=mesh, experts=EXPERTS, zero=zero)
    groups = build_parallel_groups(mesh, None, dist.group.WORLD)
    torch.manual_seed(0)
    ref = MoEGPT(vocab=32, dim=16, layers=2, heads=2, seq_len=8, num_experts=8)
    model = copy.deepcopy(ref)
    stage = parallelize_stage(model, plan, groups)
    assert sorted(stage.experts) == ["layers.0.moe", "layers.1.moe"]
    assert model.layers[0].moe.w_up.shape[0] == 4
    ref_opt = sgd(ref.parameters())
    zero_opt = build_zero_optimizer({0: stage}, plan, sgd) if zero else None
    opt = None if zero else sgd(model.parameters())
    mbs = 2
    for step in range(3):
        ids = torch.randint(0, 32, (world, mbs, 2, 8))
        targets = torch.randint(0, 32, (world, mbs, 2, 8))
        ref_opt.zero_grad()
        chunks = reference_chunk_groups(world, mbs, 2)
        ref_loss = 0.0
        for group in chunks:
            rows = [(c // mbs, c % mbs) for c in group]
            loss = _moe_loss(ref, torch.cat([ids[d, i] for d, i in rows]),
                             torch.cat([targets[d, i] for d, i in rows])) / len(chunks)
            loss.backward()
            ref_loss += float(loss)
        clip = 0.05 if zero else float("inf")  # ZeRO's global norm spans dp, ep and experts
        ref_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), clip))
        ref_opt.step()

        my_loss = torch.zeros((), dtype=torch.float64)
        for i in range(mbs):
            if zero_opt:
                zero_opt.gather(0)
            loss = _moe_loss(model, ids[rank, i], targets[rank, i]) / (mbs * world)
            if zero_opt:
                zero_opt.release(0)
                zero_opt.gather(0)
            loss.backward()
            if zero_opt:
                zero_opt.release(0)
            my_loss += float(loss)
        if zero_opt:
            zero_opt.reduce_gradients()
            norm = zero_opt.clip_grad_norm_(clip)
            assert abs(norm - ref_norm) < 1e-5 * ref_norm and norm > clip, (norm, ref_norm)
            zero_opt.step()
            zero_opt.zero_grad()
            zero_opt.gather(0)
        else:
            for p in model.parameters():
                group = stage.grad_group(p)
                if group is not None:
                    dist.all_reduce(p.grad, group=group)
            opt.step()
            opt.zero_grad()
        dist.all_reduce(my_loss)
        assert abs(float(my_loss) - ref_loss) < 1e-5, (step, float(my_loss), ref_loss)
        ref_params = dict(ref.named_parameters())
        for name, p in model.named_parameters():
            want = ref_params[name].detach()
            if name.endswith((".w_up", ".w_down")):
                s = model.get_submodule(name.rpartition(".")[0]).shard
                want = want[s.first:s.stop]
            torch.testing.assert_close(p.detach(), want, **TOL,
                                       msg=lambda m, n=name: f"zero={zero} step {step} {n}: {m}")
        full = stage.full_state_dict()
        for name, value in ref.state_dict().items():
            torch.testing.assert_close(full[name], value, **TOL, msg=name)
        if zero_opt:
            zero_opt.release(0)


class _AttentionLeaves(fx.Tracer):
    def is_leaf_module(self, m, qualname):
        return qualname.endswith(".attn") or super().is_leaf_module(m, qualname)


def _traced_tp_worker(rank, world, sequence_parallel):
    mesh = MeshSpec(tp=world)
    plan = Plan(model=MODEL, mesh=mesh,
                tensor=TensorSpec(TENSOR.column, TENSOR.row, TENSOR.vocab, sequence_parallel))
    groups = build_parallel_groups(mesh, dist.group.WORLD, None)
    torch.manual_seed(0)
    ref = GPT(vocab=32, dim=16, layers=2, heads=2, seq_len=8)
    model = copy.deepcopy(ref)
    stage_module = fx.GraphModule(model, _AttentionLeaves().trace(model))
    stage = parallelize_stage(stage_module, plan, groups)
    assert stage.tensor.rewrites["layers.1.attn"] == "attention"
    ids, targets = torch.randint(0, 32, (2, 8)), torch.randint(0, 32, (2, 8))
    F.cross_entropy(ref(ids).flatten(0, 1), targets.flatten()).backward()
    loss = F.cross_entropy(stage_module(ids).flatten(0, 1), targets.flatten())
    loss.backward()
    stage.sync_sequence_parallel()
    weights = stage.full_state_dict()
    for n, value in ref.state_dict().items():
        assert torch.equal(weights[n], value), n
    grads = {n: p.grad for n, p in stage_module.named_parameters()}
    for n, p in stage_module.named_parameters():
        p.data = grads[n]  # gather the gradients through the parameters' shard layout
    full = gather_full_state(stage_module, groups.tp)
    for n, p in ref.named_parameters():
        torch.testing.assert_close(full[n], p.grad, rtol=1e-5, atol=1e-5,
                                   msg=lambda m, n=n: f"sp={sequence_parallel} {n}: {m}")


def _traced_through_worker(rank, world):
    mesh = MeshSpec(pp=1, dp=world, ep=2)
    plan = Plan(model=MODEL, mesh=mesh, experts=EXPERTS)
    groups = build_parallel_groups(mesh, None, dist.group.WORLD)
    model = MoEGPT(vocab=32, dim=16, layers=1, heads=2, seq_len=8, num_experts=8)
    with pytest.raises(PipeplanError, match="traced into the stage graph"):
        parallelize_stage(fx.symbolic_trace(model), plan, groups)


@pytest.mark.slow
@pytest.mark.parametrize("zero", [0, 3])
def test_moe_gpt_dp4_ep2_trains_like_reference(run_workers, zero):
    run_workers(_ep_worker, 4, zero)


@pytest.mark.slow
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_traced_gpt_stage_tp2_gradients(run_workers, sequence_parallel):
    run_workers(_traced_tp_worker, 2, sequence_parallel)


@pytest.mark.slow
def test_moe_traced_through_is_a_clear_error(run_workers):
    run_workers(_traced_through_worker, 2)


def test_expert_groups_redivide_dp():
    mesh = MeshSpec(pp=2, dp=4, tp=1, ep=2)
    ep, edp = expert_group_ranks(mesh)
    assert ep == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert edp == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert ExpertCoords.of(3, mesh) == ExpertCoords(ep_rank=1, ep_block=1)
    ep, edp = expert_group_ranks(MeshSpec(pp=1, dp=2, tp=2, ep=2))
    assert ep == [[0, 2], [1, 3]] and edp == [[0], [2], [1], [3]]


def test_reference_chunks_and_leaves():
    assert reference_chunk_groups(dp=4, microbatches=2, ep=2) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert reference_chunk_groups(dp=2, microbatches=3, ep=1) == [[0], [1], [2], [3], [4], [5]]
    plan = Plan(model=MODEL, mesh=MeshSpec(tp=2, dp=2, ep=2), experts=EXPERTS, tensor=TENSOR)
    assert required_leaf_modules(plan) == ("layers.*.moe", "layers.*.attn")


def test_bad_meshes_are_errors():
    with pytest.raises(PipeplanError, match="must divide dp"):
        build_parallel_groups(MeshSpec(dp=2, ep=4))
    plan = Plan(model=MODEL, tensor=TensorSpec(sequence_parallel=True))
    with pytest.raises(PipeplanError, match="sequence_parallel needs mesh.tp > 1"):
        parallelize_stage(GPT(vocab=32, dim=16, layers=1, heads=2, seq_len=8), plan,
                          build_parallel_groups(plan.mesh))


PLAN_TEXT = """model {
  source = "models/gpt.py:GPT"
  args = { vocab = 256, dim = 64, layers = 2, heads = 4, seq_len = 64 }
}
data = synthetic(seed = 0, vocab = 256, seq_len = 64)
mesh {
  dp = 2
  tp = 8
}
tensor {
  column = [layers.*.attn.q, layers.*.attn.k, layers.*.attn.v]
  row = [layers.*.attn.proj]
}
"""


def test_model_checks_point_at_the_plan_line():
    from pipeplan.dsl.errors import PlanError
    from pipeplan.dsl.load import parse_plan
    from pipeplan.backends.parallelize import check_parallel_model

    plan = parse_plan(PLAN_TEXT, "gpt.plan")
    model = GPT(vocab=256, dim=64, layers=2, heads=4, seq_len=64)
    with pytest.raises(PlanError) as info:
        check_parallel_model(plan, model)
    text = str(info.value)
    assert "gpt.plan:11:" in text and "does not divide the 4 attention heads of layers.0.attn" in text
    assert "^" in text
    check_parallel_model(parse_plan(PLAN_TEXT.replace("tp = 8", "tp = 2"), "gpt.plan"), model)


def test_model_checks_experts():
    from pipeplan.dsl.errors import PlanError
    from pipeplan.backends.parallelize import check_parallel_model

    model = MoEGPT(vocab=32, dim=16, layers=1, heads=2, seq_len=8, num_experts=4)
    plan = Plan(model=MODEL, mesh=MeshSpec(dp=2, ep=2), experts=EXPERTS)  # says 8 experts
    with pytest.raises(PlanError, match="num_experts = 8 but layers.0.moe has 4"):
        check_parallel_model(plan, model)
    plan = Plan(model=MODEL, mesh=MeshSpec(dp=2, ep=2),
                experts=ExpertsSpec(modules=("layers.*.attn",), num_experts=4))
    with pytest.raises(PlanError, match="not a stacked-expert MoE"):
        check_parallel_model(plan, model)
