"""The integration surface: groups from the mesh, stage rewrite, grad groups, ZeRO per stage.

End to end on real gloo ranks: a MoE GPT over dp4 x ep2 (plain DP sync and
ZeRO-3) and a traced GPT stage over tp2 (with and without sequence parallel)
train like the single-process model.
"""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn.functional as F

from pipeplan.compiler.patterns import matches_any
from pipeplan.backends.parallel import (build_parallel_groups, build_zero_optimizer, expert_group_ranks, parallelize_stage)
from pipeplan.backends.parallel.tp import gather_full_state
from pipeplan.compiler.parallel.ep import place_experts
from pipeplan.dsl.ast import ExpertsSpec, MeshSpec, ModelSpec, Plan, TensorSpec
from pipeplan.errors import PipeplanError
from pipeplan.examples.models.gpt import GPT
from pipeplan.examples.models.moe_gpt import MoEGPT

TOL = dict(rtol=1e-5, atol=1e-6)
MODEL = ModelSpec(source="examples/models/moe_gpt.py:MoEGPT")
EXPERTS = ExpertsSpec(modules=("layers.*.moe",), num_experts=8, top_k=2)
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
    if zero == 0:  # as a traced stage with the experts calls as leaves (as the capture keeps)
        model = fx.GraphModule(model, _Leaves(("layers.*.moe.experts",)).trace(model))
    stage = parallelize_stage(model, plan, groups, place_experts(plan, ref))
    assert sorted(stage.experts) == ["layers.0.moe.experts", "layers.1.moe.experts"]
    assert model.get_submodule("layers.0.moe.experts").w_up.shape[0] == 4
    ref_opt = sgd(ref.parameters())
    zero_opt = build_zero_optimizer({0: stage}, plan, sgd) if zero else None
    opt = None if zero else sgd(model.parameters())
    mbs = 2
    for step in range(3):
        ids = torch.randint(0, 32, (world, mbs, 2, 8))
        targets = torch.randint(0, 32, (world, mbs, 2, 8))
        ref_opt.zero_grad()
        chunks = [[c] for c in range(world * mbs)]  # one call per chunk: the aux loss is per call
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


class _Leaves(fx.Tracer):
    """The compiler's fx capture with extra leaf-module patterns."""

    def __init__(self, patterns):
        super().__init__()
        self.patterns = patterns

    def is_leaf_module(self, m, qualname):
        return (matches_any(qualname, self.patterns)
                or super().is_leaf_module(m, qualname))


class _GPTWithLoss(GPT):
    """The GPT with the loss in its graph, as the compiler's last stage computes it."""

    def forward(self, ids, targets):
        return F.cross_entropy(super().forward(ids).flatten(0, -2), targets.flatten())


def _traced_tp_worker(rank, world, sequence_parallel):
    mesh = MeshSpec(tp=world)
    plan = Plan(model=MODEL, mesh=mesh,
                tensor=TensorSpec(TENSOR.column, TENSOR.row, TENSOR.vocab, sequence_parallel))
    groups = build_parallel_groups(mesh, dist.group.WORLD, None)
    torch.manual_seed(0)
    ref = _GPTWithLoss(vocab=32, dim=16, layers=2, heads=2, seq_len=8)
    model = copy.deepcopy(ref)
    stage_module = fx.GraphModule(model, _Leaves(()).trace(model))
    stage = parallelize_stage(stage_module, plan, groups)
    assert stage.tensor.rewrites["layers.1.attn.q"] == "column"
    assert stage.tensor.rewrites["lm_head"] == "vocab+loss"  # logits never gathered
    weights = stage.full_state_dict()
    for n, value in ref.state_dict().items():
        assert torch.equal(weights[n], value), n
    ids, targets = torch.randint(0, 32, (2, 8)), torch.randint(0, 32, (2, 8))
    targets[0, :3] = -100  # ignored positions, as F.cross_entropy's default
    ref_loss = ref(ids, targets)
    ref_loss.backward()
    loss = stage_module(ids, targets)
    loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), **TOL)
    stage.sync_sequence_parallel()
    grads = {n: p.grad for n, p in stage_module.named_parameters()}
    for n, p in stage_module.named_parameters():
        p.data = grads[n]  # gather the gradients through the parameters' shard layout
    full = gather_full_state(stage_module, groups.tp)
    for n, p in ref.named_parameters():
        torch.testing.assert_close(full[n], p.grad, rtol=1e-5, atol=1e-5,
                                   msg=lambda m, n=n: f"sp={sequence_parallel} {n}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("zero", [0, 3])
def test_moe_gpt_dp4_ep2_trains_like_reference(run_workers, zero):
    run_workers(_ep_worker, 4, zero)


@pytest.mark.slow
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_traced_gpt_stage_tp2_gradients(run_workers, sequence_parallel):
    run_workers(_traced_tp_worker, 2, sequence_parallel)


def test_expert_groups_redivide_dp():
    mesh = MeshSpec(pp=2, dp=4, tp=1, ep=2)
    ep, edp = expert_group_ranks(mesh)
    assert ep == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert edp == [[0, 2], [1, 3], [4, 6], [5, 7]]
    ep, edp = expert_group_ranks(MeshSpec(pp=1, dp=2, tp=2, ep=2))
    assert ep == [[0, 2], [1, 3]] and sorted(edp) == [[0], [1], [2], [3]]
    # EP across TP: ep consecutive ranks of a stage's dp x tp block
    ep, edp = expert_group_ranks(MeshSpec(pp=2, dp=1, tp=4, ep=2))
    assert ep == [[0, 1], [2, 3], [4, 5], [6, 7]] and edp == [[0, 2], [1, 3], [4, 6], [5, 7]]
    ep, edp = expert_group_ranks(MeshSpec(pp=1, dp=2, tp=2, ep=4))
    assert ep == [[0, 1, 2, 3]] and edp == [[0], [1], [2], [3]]


def test_bad_meshes_are_errors():
    with pytest.raises(PipeplanError, match="must divide dp"):
        build_parallel_groups(MeshSpec(dp=2, ep=4))
    with pytest.raises(PipeplanError, match=r"must divide dp \(2\) or dp x tp \(4\)"):
        build_parallel_groups(MeshSpec(dp=2, tp=2, ep=8))


PLAN_TEXT = """model {
  source = "models/gpt.py:GPT"
  args = { vocab = 256, dim = 64, layers = 2, heads = 4, seq_len = 64 }
}
data = synthetic(seed = 0, vocab = 256, seq_len = 63)
mesh {
  dp = 2
  tp = 2
}
tensor {
  column = [layers.*.attn.q, layers.*.attn.k, layers.*.attn.v]
  row = [layers.*.attn.proj]
  sequence_parallel = true
}
"""


def test_model_checks_point_at_the_plan_line():
    from pipeplan.dsl.errors import PlanError
    from pipeplan.dsl.load import parse_plan
    from pipeplan.compiler.parallel.checks import check_parallel_model

    plan = parse_plan(PLAN_TEXT, "gpt.plan")
    model = GPT(vocab=256, dim=64, layers=2, heads=4, seq_len=64)
    with pytest.raises(PlanError) as info:
        check_parallel_model(plan, model)
    text = str(info.value)
    assert "gpt.plan:13:" in text and "does not divide the sequence length 63" in text
    assert "^" in text
    check_parallel_model(parse_plan(PLAN_TEXT.replace("seq_len = 63", "seq_len = 64"),
                                    "gpt.plan"), model)


def test_model_checks_experts():
    from pipeplan.dsl.errors import PlanError
    from pipeplan.compiler.parallel.checks import check_parallel_model

    from pipeplan.compiler.parallel.ep import experts_modules

    model = MoEGPT(vocab=32, dim=16, layers=1, heads=2, seq_len=8, num_experts=4)
    plan = Plan(model=MODEL, mesh=MeshSpec(dp=2, ep=2),
                experts=ExpertsSpec(modules=("layers.*.attn",), num_experts=4))
    with pytest.raises(PlanError, match="offers no experts module"):
        experts_modules(plan, model)
    from pipeplan.dsl.checks import check_plan  # the mesh rule, once: dsl/layout.py ep_fits
    plan = Plan(model=MODEL, mesh=MeshSpec(dp=1, tp=3, ep=2), experts=EXPERTS)
    with pytest.raises(PlanError, match=r"ep = 2 divides neither dp = 1 nor dp x tp = 3"):
        check_plan(plan)
    check_parallel_model(Plan(model=MODEL, mesh=MeshSpec(dp=1, tp=2, ep=2), experts=EXPERTS),
                         model)  # EP across TP


def _tp_zero_worker(rank, world, zero):
    """dp2 x tp2: ZeRO shards mixing TP-sharded and replicated parameters still give
    the global gradient norm (for clipping) and the reference's parameters."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = MeshSpec(dp=2, tp=2)
    dm = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = dm.get_local_rank("dp")
    plan = Plan(model=MODEL, mesh=mesh, zero=zero,
                tensor=TensorSpec(TENSOR.column, TENSOR.row, TENSOR.vocab))
    groups = build_parallel_groups(mesh, dm.get_group("tp"), dm.get_group("dp"))
    torch.manual_seed(0)
    ref = GPT(vocab=32, dim=16, layers=1, heads=2, seq_len=8)
    model = fx.symbolic_trace(copy.deepcopy(ref))
    stage = parallelize_stage(model, plan, groups)
    zero_opt = build_zero_optimizer({0: stage}, plan, sgd)
    ref_opt = sgd(ref.parameters())
    for step in range(2):
        ids, targets = torch.randint(0, 32, (2, 2, 8)), torch.randint(0, 32, (2, 2, 8))
        ref_opt.zero_grad()
        F.cross_entropy(ref(ids.flatten(0, 1)).flatten(0, 1), targets.flatten()).backward()
        ref_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05))
        ref_opt.step()

        zero_opt.gather(0)
        loss = F.cross_entropy(model(ids[dp_rank]).flatten(0, 1), targets[dp_rank].flatten()) / 2
        zero_opt.release(0)
        zero_opt.gather(0)
        loss.backward()
        zero_opt.release(0)
        zero_opt.reduce_gradients()
        norm = zero_opt.clip_grad_norm_(0.05)
        assert abs(norm - ref_norm) < 1e-5 * ref_norm and norm > 0.05, (norm, ref_norm)
        zero_opt.step()
        zero_opt.zero_grad()
        zero_opt.gather(0)
        full = stage.full_state_dict()
        zero_opt.release(0)
        for name, value in ref.state_dict().items():
            torch.testing.assert_close(full[name], value, **TOL,
                                       msg=lambda m, n=name: f"zero={zero} step {step} {n}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("zero", [1, 3])
def test_zero_with_tensor_parallel_clips_by_the_global_norm(run_workers, zero):
    run_workers(_tp_zero_worker, 4, zero)


def _prefetch_worker(rank, world):
    """ZeRO-3 over two stages on each rank: the next action's stage is gathered ahead."""
    from pipeplan.backends.parallel.zero.sharding import PrefetchWindow

    mesh = MeshSpec(dp=world)
    plan = Plan(model=MODEL, mesh=mesh, zero=3)
    groups = build_parallel_groups(mesh, None, dist.group.WORLD)
    torch.manual_seed(0)
    ref = [torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU()), torch.nn.Linear(16, 4)]
    mods = copy.deepcopy(ref)
    zero = build_zero_optimizer(
        {i: parallelize_stage(m, plan, groups) for i, m in enumerate(mods)}, plan, sgd)
    order = [("F", 0, 0), ("F", 1, 0), ("F", 0, 1), ("F", 1, 1),
             ("BW", 1, 0), ("BW", 0, 0), ("BW", 1, 1), ("BW", 0, 1)]
    window = PrefetchWindow(zero, [s for _, s, _ in order])
    x, y = torch.randn(world, 2, 3, 8), torch.randn(world, 2, 3, 4)
    ref_opt = sgd([p for m in ref for p in m.parameters()])
    F.mse_loss(ref[1](ref[0](x)), y).backward()
    ref_opt.step()

    saved = {}
    for op, s, mb in order:
        with window(s):
            assert sum(sh.present for sh in zero.optimizer.shards) <= 2
            if (op, s) == ("F", 0):
                h = mods[0](x[rank, mb])
                saved[0, mb] = (h, h.detach().requires_grad_())
            elif (op, s) == ("F", 1):
                saved[1, mb] = F.mse_loss(mods[1](saved[0, mb][1]), y[rank, mb]) / (2 * world)
            elif s == 1:
                saved.pop((1, mb)).backward()
            else:
                h, h_in = saved.pop((0, mb))
                h.backward(h_in.grad)
    assert window.prefetches == 6 and window.position == 0  # every change of stage
    assert not any(sh.present for sh in zero.optimizer.shards)
    zero.reduce_gradients()
    zero.step()
    for i in (0, 1):
        zero.gather(i)
        for (name, p), q in zip(mods[i].named_parameters(), ref[i].parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), **TOL, msg=name)
        zero.release(i)


@pytest.mark.slow
def test_zero3_prefetch_window_over_two_stages(run_workers):
    run_workers(_prefetch_worker, 2)


def test_tied_weights_must_be_split_alike():
    from pipeplan.dsl.errors import PlanError
    from pipeplan.compiler.parallel.tp import tp_annotations

    model = GPT(vocab=32, dim=16, layers=1, heads=2, seq_len=8)  # tok_emb and lm_head tied
    plan = Plan(model=MODEL, mesh=MeshSpec(tp=2), tensor=TensorSpec(vocab=("lm_head",)))
    with pytest.raises(PlanError, match=r"tok_emb \(not split\), lm_head \(dim 0\)"):
        tp_annotations(plan, model)
    tp_annotations(dataclasses.replace(plan, tensor=TensorSpec(vocab=("tok_emb", "lm_head"))),
                   model)


def test_only_per_logit_ops_keep_logits_vocab_split():
    """Between a vocab-split head and the loss, the logits may pass through ops that act on
    each logit alone (pointwise with numbers, casts), never through one that reads the
    whole vocabulary or another tensor."""
    from pipeplan.compiler.parallel.tp import per_logit

    class Logits(torch.nn.Module):
        def forward(self, x, y):
            a = (torch.tanh(x / 8.0) * 8.0).float()
            return a - a.logsumexp(-1, keepdim=True), a * y, a.softmax(-1)

    nodes = {n.name: n for n in fx.symbolic_trace(Logits()).graph.nodes}
    chain = ["x", "truediv", "tanh", "mul", "float_1"]
    for value, node in zip(chain, chain[1:]):
        assert per_logit(nodes[node], nodes[value]), node
    for node in ("logsumexp", "sub", "mul_1", "softmax"):
        assert not per_logit(nodes[node], nodes["float_1"]), node


def _partial_grads_worker(rank, world):
    from pipeplan.backends.parallel import PartialGrads

    shared, own = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    registry = PartialGrads(dist.group.WORLD)
    registry.register([shared, own])  # stage a
    registry.register([shared])  # stage b holds the shared (tied) one too
    for step in range(2):
        shared.grad, own.grad = torch.full((2,), rank + 1.0), torch.full((2,), rank + 1.0)
        registry.stage_done([shared, own])  # stage a done: own is summed, shared waits
        assert own.grad.tolist() == [3.0, 3.0] and shared.grad.tolist() == [rank + 1.0] * 2
        registry.stage_done([shared])  # stage b done: shared summed once
        assert shared.grad.tolist() == [3.0, 3.0], step


@pytest.mark.slow
def test_partial_grads_of_a_weight_shared_by_two_stages_are_summed_once(run_workers):
    run_workers(_partial_grads_worker, 2)


def test_the_runtime_rewrites_the_compiled_tp_kinds_not_the_patterns_again():
    """Given the compiled plan's kinds (CompiledPlan.tp_rewrites), they alone decide what is
    split: a module the plan's patterns would match but the compiled kinds leave out stays
    whole (as `pipeplan check` showed it)."""
    from pipeplan.compiler.parallel.tp import TensorParallelRules
    patterns = TensorParallelRules.from_plan(TENSOR)
    compiled = TensorParallelRules.compiled({"layers.0.attn.q": "column"}, False)
    assert patterns.kind_of("layers.1.attn.q") == "column"
    assert compiled.kind_of("layers.0.attn.q") == "column"
    assert compiled.kind_of("layers.1.attn.q") is None
