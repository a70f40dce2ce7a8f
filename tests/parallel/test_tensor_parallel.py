"""Tensor parallel (and sequence parallel) GPT block / whole GPT equal the single-process model."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from pipeplan.backends.tensor_parallel import (
    TensorParallelRules, apply_tensor_parallel, gather_full, gather_full_state,
    sync_sequence_parallel_grads, tp_shard_dims, vocab_parallel_cross_entropy)
from pipeplan.errors import PipeplanError
from pipeplan.examples.models.gpt import GPT, Block

TOL = dict(rtol=1e-5, atol=1e-6)
GRAD_TOL = dict(rtol=1e-5, atol=1e-5)
# Plan module-path patterns: `*` matches exactly one path segment.
BLOCK_RULES = dict(column=("attn.q", "attn.k", "attn.v", "mlp.up"), row=("attn.proj", "mlp.down"))
GPT_RULES = dict(column=tuple(f"layers.*.{p}" for p in BLOCK_RULES["column"]),
                 row=tuple(f"layers.*.{p}" for p in BLOCK_RULES["row"]),
                 vocab=("tok_emb", "lm_head"))


def _assert_grads_match(model, ref, group, result, msg, tol=TOL):
    sync_sequence_parallel_grads(model, result.sequence_partial, group)
    dims = tp_shard_dims(model)
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        full = gather_full(p.grad, dims.get(name), group)
        torch.testing.assert_close(full, ref_params[name].grad, **tol, msg=lambda m, n=name: f"{msg}: {n}: {m}")


def _block_worker(rank, world, sequence_parallel):
    group = dist.group.WORLD
    torch.manual_seed(0)
    ref = Block(32, 4, 64)
    block = copy.deepcopy(ref)
    rules = TensorParallelRules(**BLOCK_RULES, sequence_parallel=sequence_parallel)
    result = apply_tensor_parallel(block, rules, group)
    assert result.rewrites["attn"] == "attention" and result.rewrites["mlp.up"] == "column"
    assert block.attn.heads == 4 // world
    assert block.mlp.up.weight.shape == (64 // world, 32)

    x_ref = torch.randn(2, 8, 32, requires_grad=True)
    g = torch.randn(2, 8, 32)
    (ref(x_ref) * g).sum().backward()
    x = x_ref.detach().clone().requires_grad_()
    y = block(x)
    (y * g).sum().backward()
    msg = f"block sp={sequence_parallel} rank {rank}"
    torch.testing.assert_close(y, ref(x_ref).detach(), **TOL, msg=msg)
    torch.testing.assert_close(x.grad, x_ref.grad, **TOL, msg=msg)
    if sequence_parallel:
        assert "ln1.weight" in result.sequence_partial and "mlp.down.bias" in result.sequence_partial
        assert "mlp.up.weight" not in result.sequence_partial
    _assert_grads_match(block, ref, group, result, msg)


def _gpt_worker(rank, world, sequence_parallel):
    """Three SGD-momentum steps of the whole tied-embedding GPT: losses and parameters equal.

    Not AdamW here: the key bias has a mathematically zero gradient (softmax
    ignores a shift shared by all keys), so its float32 gradient is rounding
    noise whose sign depends on the summation order, and AdamW's first step
    (about lr * sign(grad)) turns that noise into a 1e-2 difference.
    """
    group = dist.group.WORLD
    torch.manual_seed(0)
    ref = GPT(vocab=64, dim=32, layers=2, heads=4, seq_len=8)
    model = copy.deepcopy(ref)
    rules = TensorParallelRules(**GPT_RULES, sequence_parallel=sequence_parallel)
    result = apply_tensor_parallel(model, rules, group)
    assert model.lm_head.weight is model.tok_emb.weight  # still tied, now a vocab shard
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        ids = torch.randint(0, 64, (2, 8))
        targets = torch.randint(0, 64, (2, 8))
        losses = []
        for m, o in ((ref, opt_ref), (model, opt)):
            o.zero_grad()
            loss = F.cross_entropy(m(ids).flatten(0, 1), targets.flatten())
            loss.backward()
            losses.append(loss.detach())
        msg = f"gpt sp={sequence_parallel} step {step} rank {rank}"
        torch.testing.assert_close(losses[1], losses[0], **TOL, msg=msg)
        # Gradients are sums over tokens, summed in another order across ranks: allow
        # float32 reassociation noise on near-zero entries; parameters stay at TOL.
        _assert_grads_match(model, ref, group, result, msg, GRAD_TOL)
        opt_ref.step()
        opt.step()
        full = gather_full_state(model, group)
        for name, value in ref.state_dict().items():
            torch.testing.assert_close(full[name], value, **TOL, 
                                       msg=lambda m, n=name: f"{n} after step {step}: {m}")


def _vocab_ce_worker(rank, world):
    group = dist.group.WORLD
    torch.manual_seed(0)
    logits = torch.randn(6, 16, requires_grad=True)
    targets = torch.randint(0, 16, (6,))
    ref = F.cross_entropy(logits, targets, reduction="none")
    ref.sum().backward()
    per = 16 // world
    local = logits.detach()[:, rank * per:(rank + 1) * per].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, targets, rank * per, group)
    loss.sum().backward()
    torch.testing.assert_close(loss, ref.detach(), **TOL)
    torch.testing.assert_close(local.grad, logits.grad[:, rank * per:(rank + 1) * per], **TOL)


def _errors_worker(rank, world):
    group = dist.group.WORLD
    with pytest.raises(PipeplanError, match="does not divide the attention heads"):
        apply_tensor_parallel(Block(30, 3, 64), TensorParallelRules(**BLOCK_RULES), group)
    with pytest.raises(PipeplanError, match="does not divide output features"):
        apply_tensor_parallel(Block(32, 4, 65), TensorParallelRules(**BLOCK_RULES), group)
    with pytest.raises(PipeplanError, match="cannot make LayerNorm"):
        apply_tensor_parallel(Block(32, 4, 64), TensorParallelRules(column=("ln1",)), group)
    with pytest.raises(PipeplanError, match="shard by heads"):
        apply_tensor_parallel(Block(32, 4, 64), TensorParallelRules(column=("attn.q",)), group)


@pytest.mark.slow
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_block_equals_reference(run_workers, sequence_parallel):
    run_workers(_block_worker, 2, sequence_parallel)


@pytest.mark.slow
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_gpt_three_steps_equal_reference(run_workers, sequence_parallel):
    run_workers(_gpt_worker, 2, sequence_parallel)


@pytest.mark.slow
def test_block_tp4(run_workers):
    run_workers(_block_worker, 4, True)


@pytest.mark.slow
def test_vocab_parallel_cross_entropy(run_workers):
    run_workers(_vocab_ce_worker, 2)


@pytest.mark.slow
def test_bad_shapes_are_clear_errors(run_workers):
    run_workers(_errors_worker, 2)
