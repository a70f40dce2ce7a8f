"""The rewritten stages under the runtime's own StageRunner with split backward (B, then W).

B and W each walk the graph, so every collective inside a stage (all-to-all,
aux all-reduce, TP operators, ZeRO-3 gathers) runs in both, in the same order
on every peer: these tests run a zbv-like order F0 F1 B0 B1 W1 W0 and compare
every gradient with the single-process reference.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx

from pipeplan.backends.parallel import (build_parallel_groups, build_zero_optimizer, parallelize_stage)
from pipeplan.backends.runtime.stage import StageRunner
from pipeplan.backends.parallel.tp import tp_shard_dims, gather_full
from pipeplan.compiler.compiled import StageSpec, ValueRef, ValueSpec
from pipeplan.compiler.parallel.ep import place_experts
from pipeplan.dsl.ast import ExpertsSpec, MeshSpec, ModelSpec, Plan, TensorSpec
from pipeplan.examples.models.gpt import Block
from pipeplan.examples.models.moe_gpt import MoEBlock

TOL = dict(rtol=1e-5, atol=1e-5)
MODEL = ModelSpec(source="examples/models/moe_gpt.py:MoEGPT")
D, MB, B, T = 16, 2, 2, 4
ORDER = [("F", 0), ("F", 1), ("B", 0), ("B", 1), ("W", 1), ("W", 0)]


def _spec(names: tuple[str, ...]) -> StageSpec:
    return StageSpec(index=1, rank=0, inputs=tuple(ValueRef(n, 0) for n in names),
                     outputs=tuple(ValueSpec(n, (), "float32") for n in names), param_names=())


def _run_order(runner, inputs, out_grads, zero=None):
    input_grads = {}
    for op, mb in ORDER:
        if zero:
            zero.gather(1)
        if op == "F":
            runner.forward(mb, inputs[mb])
        elif op == "B":
            input_grads[mb] = runner.backward_input(mb, out_grads[mb])
        else:
            runner.backward_weight(mb)
        if zero:
            zero.release(1)
    return input_grads


def _moe_worker(rank, world, zero):
    mesh = MeshSpec(dp=world, ep=world)
    experts = ExpertsSpec(modules=("moe",), num_experts=4, top_k=2)
    plan = Plan(model=MODEL, mesh=mesh, experts=experts, zero=zero)
    groups = build_parallel_groups(mesh, None, dist.group.WORLD)
    torch.manual_seed(0)
    ref = MoEBlock(D, 2, 2 * D, 4, 2, 0.01, 0.001)
    block = copy.deepcopy(ref)
    stage = parallelize_stage(block, plan, groups, place_experts(plan, ref))
    zero_opt = build_zero_optimizer({1: stage}, plan, lambda ps: torch.optim.SGD(ps, lr=0.1)) \
        if zero else None
    x = torch.randn(world, MB, B, T, D)
    g = torch.randn(world, MB, B, T, D)

    xr = x.clone().requires_grad_()
    for i in range(MB):  # the reference: each rank's microbatch i (the model's aux per call)
        for r in range(world):
            y, aux = ref(xr[r, i], torch.zeros(()))
            ((y * g[r, i]).sum() + aux / world).backward()

    runner = StageRunner(_spec(("x", "aux")), block, is_last=False)
    inputs = [[x[rank, i], torch.zeros(())] for i in range(MB)]
    out_grads = [[g[rank, i], torch.tensor(1.0 / world)] for i in range(MB)]
    input_grads = _run_order(runner, inputs, out_grads, zero_opt)
    for i in range(MB):
        torch.testing.assert_close(input_grads[i]["x"], xr.grad[rank, i], **TOL)
    if zero_opt:
        zero_opt.reduce_gradients()
        # The optimizer's slices hold the reduced gradient: check it through a step of
        # SGD(lr=0.1): new = old - 0.1 * grad, against the reference's update.
        zero_opt.step()
        zero_opt.gather(1)
        expected = {n: p.detach() - 0.1 * p.grad for n, p in ref.named_parameters()}
        for name, p in block.named_parameters():
            want = expected[name]
            if name.startswith("moe.experts.w_"):
                want = want[stage.experts["moe.experts"].shard.first:stage.experts["moe.experts"].shard.stop]
            torch.testing.assert_close(p.detach(), want, **TOL, msg=lambda m, n=name: f"{n}: {m}")
        return
    ref_params = dict(ref.named_parameters())
    for name, p in block.named_parameters():
        grad = p.grad.clone()
        group = stage.grad_group(p)
        if group is not None:
            dist.all_reduce(grad, group=group)
        want = ref_params[name].grad
        if name.startswith("moe.experts.w_"):
            s = stage.experts["moe.experts"].shard
            want = want[s.first:s.stop]
        torch.testing.assert_close(grad, want, **TOL, msg=lambda m, n=name: f"{n}: {m}")


def _tp_worker(rank, world, sequence_parallel):
    mesh = MeshSpec(tp=world)
    tensor = TensorSpec(column=("attn.q", "attn.k", "attn.v", "mlp.up"),
                        row=("attn.proj", "mlp.down"), sequence_parallel=sequence_parallel)
    plan = Plan(model=MODEL, mesh=mesh, tensor=tensor)
    groups = build_parallel_groups(mesh, dist.group.WORLD, None)
    torch.manual_seed(0)
    ref = Block(D, 2, 2 * D)
    block = fx.symbolic_trace(copy.deepcopy(ref))  # the rewrite acts on a captured graph
    stage = parallelize_stage(block, plan, groups)
    x = torch.randn(MB, B, T, D)
    g = torch.randn(MB, B, T, D)
    xr = x.clone().requires_grad_()
    for i in range(MB):
        (ref(xr[i]) * g[i]).sum().backward()
    runner = StageRunner(_spec(("x",)), block, is_last=False)
    input_grads = _run_order(runner, [[x[i]] for i in range(MB)], [[g[i]] for i in range(MB)])
    for i in range(MB):
        torch.testing.assert_close(input_grads[i]["x"], xr.grad[i], **TOL)
    stage.sync_sequence_parallel()
    dims = tp_shard_dims(block)
    ref_params = dict(ref.named_parameters())
    for name, p in block.named_parameters():
        torch.testing.assert_close(gather_full(p.grad, dims.get(name), groups.tp),
                                   ref_params[name].grad, **TOL,
                                   msg=lambda m, n=name: f"sp={sequence_parallel} {n}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("zero", [0, 3])
def test_expert_parallel_stage_with_split_backward(run_workers, zero):
    run_workers(_moe_worker, 2, zero)


@pytest.mark.slow
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tensor_parallel_stage_with_split_backward(run_workers, sequence_parallel):
    run_workers(_tp_worker, 2, sequence_parallel)
