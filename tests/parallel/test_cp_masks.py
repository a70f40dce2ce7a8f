"""Attention masks under context parallel: the model's own mask code evaluated on the whole
sequence (compiler/parallel/cp_masks.py), ring attention's masked blocks, Ulysses' head block.

* Ring attention with a mask (backends/parallel/cp/ring.py, `block_mask`) on a real gloo
  ring equals torch's SDPA on the whole sequence with the same mask, outputs and gradients
  in float64: a sliding window narrower than a chunk (whole blocks masked and skipped, rows
  masked whole inside a block), a per-head additive float mask.
* `MaskLM` (tests/parallel/families.py: a sliding-window mask built from `arange` over the
  sequence) trains under pp1 x cp2, ring and Ulysses, like the unmodified model on whole
  sequences (tp_reference, no shared code); with the local mask (the model's code on one
  rank's slice) it could not: the test also checks the mask each rank used is [.., 16, 16].
* A mask computed from an activation is refused at the `context.method` line.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from pipeplan.compiler import compile_plan
from pipeplan.dsl import PlanError, parse_plan

TOL = dict(rtol=1e-9, atol=1e-12)
SEQ = 16


def _window(seq: int, width: int) -> torch.Tensor:
    i = torch.arange(seq)
    return (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < width)


def _ring_case(group, mask: torch.Tensor, seed: int) -> None:
    from pipeplan.backends.parallel.cp.ring import ring_attention, ring_columns

    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(2, 4, SEQ, 8, dtype=torch.float64, generator=g)
                     for _ in range(4))
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*whole, attn_mask=mask)
    ref.backward(dout)
    cols = ring_columns(SEQ, dist.get_world_size(group), dist.get_rank(group))
    mine = [t[:, :, cols].clone().requires_grad_() for t in (q, k, v)]
    out = ring_attention(*mine, group, mask=mask)
    out.backward(dout[:, :, cols])
    torch.testing.assert_close(out, ref[:, :, cols], **TOL)
    for got, want in zip(mine, whole):
        torch.testing.assert_close(got.grad, want.grad[:, :, cols], **TOL)


def _ulysses_case(group, mask: torch.Tensor, seed: int) -> None:
    from pipeplan.backends.parallel.cp.ulysses import UlyssesAttention

    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 4, SEQ, 8, dtype=torch.float64, generator=g) for _ in range(3))
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    part = slice(rank * SEQ // cp, (rank + 1) * SEQ // cp)  # Ulysses: contiguous slices
    att = UlyssesAttention(F.scaled_dot_product_attention, group)
    out = att(q[:, :, part], k[:, :, part], v[:, :, part], mask)
    torch.testing.assert_close(out, ref[:, :, part], **TOL)


def _attention_worker(rank, world):
    group = dist.group.WORLD
    # window 3 < chunk 4: blocks masked whole (skipped) and rows masked whole in a block
    _ring_case(group, _window(SEQ, 3)[None, None], seed=1)
    g = torch.Generator().manual_seed(9)
    per_head = torch.randn(2, 4, SEQ, SEQ, dtype=torch.float64, generator=g).masked_fill(
        ~_window(SEQ, 6), float("-inf"))  # an additive float mask, one per head
    _ring_case(group, per_head, seed=2)
    _ulysses_case(group, per_head, seed=3)
    _ulysses_case(group, _window(SEQ, 3)[None, None], seed=4)


def test_masked_ring_and_ulysses_attention_equal_sdpa_on_the_whole_sequence(run_workers):
    run_workers(_attention_worker, 2, timeout=120)


PLAN = """\
model {
  source = "pipeplan.tests.parallel.families:MaskLM"
  args = { mask = "MASK" }
  inputs = { input_ids = int64[batch, seq] }
  capture = fx
}
data = synthetic(seed = 7, vocab = 64, seq_len = 16)
mesh { pp = 1, cp = 2 }
context { method = METHOD }
pipeline { schedule = 1f1b, microbatches = 2 }
train { steps = 3, global_batch = 4, grad_clip = 0.5, optimizer = adamw(lr = 0.003), seed = 11 }
"""


def plan_text(method: str = "ring", mask: str = "window") -> str:
    return PLAN.replace("METHOD", method).replace("MASK", mask)


def test_a_mask_from_an_activation_is_refused_at_the_plan_line():
    with pytest.raises(PlanError) as err:
        compile_plan(parse_plan(plan_text("ulysses", "activation"), "cp.plan"))
    message = str(err.value)
    assert "cp.plan:9:" in message, message
    assert "the attention mask of `scaled_dot_product_attention` calls module `embed` " \
           "(node `embed`): the mask would depend on an activation" in message, message


def test_the_mask_is_the_models_own_code_on_the_whole_sequence():
    from pipeplan.compiler.parallel.cp_masks import WholeSequenceMask

    compiled = compile_plan(parse_plan(plan_text("ring"), "cp.plan"))
    masks = [m for s in compiled.stages for m in s.module.modules()
             if isinstance(m, WholeSequenceMask)]
    assert len(masks) == 1
    # the whole input handed over as if gathered: the model's mask over 16 positions
    masks[0].gather = lambda t, dim: torch.arange(SEQ).expand(2, SEQ)
    got = masks[0](torch.zeros(1), torch.zeros(2, SEQ // 2, dtype=torch.int64))
    assert torch.equal(got, _window(SEQ, 3)), got


def _trains_worker(rank, world, methods):
    from pipeplan.backends.parallel.cp.ring import RingAttention
    from pipeplan.backends.parallel.cp.ulysses import UlyssesAttention
    from pipeplan.compiler.parallel.cp import sdpa_arguments

    from .pipelined_vs_reference import assert_trains_like_reference

    seen = []

    def spy(trainer):  # the mask each attention call received is the whole sequence's
        for r in trainer.runners.values():
            for m in r.module.modules():
                if isinstance(m, (RingAttention, UlyssesAttention)):
                    m.register_forward_pre_hook(lambda mod, args, kwargs: seen.append(
                        tuple(sdpa_arguments(args, kwargs)["attn_mask"].shape)),
                        with_kwargs=True)

    for method in methods:
        plan = parse_plan(plan_text(method), "cp.plan")
        assert_trains_like_reference(plan, f"MaskLM, cp2 {method}", 3, spy)
    assert seen and all(s[-2:] == (SEQ, SEQ) for s in seen), seen


def test_a_models_own_window_mask_trains_under_cp_like_the_whole_sequence(run_workers):
    run_workers(_trains_worker, 2, ["ring", "ulysses"], timeout=300)


def test_positions_export_bakes_as_a_literal_length_are_tied_by_a_second_capture():
    """RopeLM exported without position_ids numbers its positions with `arange(8)` (the
    slice's length as a literal): the whole-length capture has `arange(16)` there, so it is
    marked and renumbered per rank (backends/parallel/cp/positions.py), not refused."""
    from pipeplan.compiler.parallel.cp import POSITIONS

    text = """\
model {
  source = "pipeplan.tests.parallel.cp_models:RopeLM"
  args = { vocab = 64, dim = 32, heads = 4, kv_heads = 2, layers = 2 }
  capture = export
}
data = synthetic(seed = 0, vocab = 64, seq_len = 16)
mesh { pp = 1, cp = 2 }
context { method = ulysses }
pipeline { schedule = 1f1b, microbatches = 2 }
train { global_batch = 4 }
"""
    compiled = compile_plan(parse_plan(text, "cp.plan"))
    marked = [n for s in compiled.stages for n in s.module.graph.nodes if n.meta.get(POSITIONS)]
    assert len(marked) == 1 and marked[0].args == (8,), marked


# ------------------------------------------ attention the model writes out, under Ulysses
EAGER = PLAN.replace("MaskLM", "EagerLM").replace('args = { mask = "MASK" }', "args = ARGS")


def eager_text(method: str, args: str = "{}") -> str:
    return EAGER.replace("METHOD", method).replace("ARGS", args)


def _eager_worker(rank, world, args):
    from pipeplan.compiler.parallel.cp_regions import UlyssesRegion

    from .pipelined_vs_reference import assert_trains_like_reference

    def regions(trainer):
        found = [m for r in trainer.runners.values() for m in r.module.modules()
                 if isinstance(m, UlyssesRegion)]
        assert len(found) == 1 and found[0].to_heads is not None, found

    for a in args:
        plan = parse_plan(eager_text("ulysses", a), "cp.plan")
        assert_trains_like_reference(plan, f"EagerLM {a}, cp2 Ulysses", 3, regions)


def test_eager_attention_with_soft_capping_and_a_window_trains_under_ulysses(run_workers):
    """The region between q, k, v and the output (matmul, tanh soft-capping, masked_fill
    with the window from positions, softmax, matmul) runs whole on each rank's heads; with
    GPT-OSS's sinks (a per-head weight concatenated to the logits) too: each rank takes its
    heads' sinks, their gradients summed over the cp group."""
    run_workers(_eager_worker, 2, ["{}", "{ sinks = true }"], timeout=300)


@pytest.mark.parametrize("method, args, said", [
    # ring attention runs only SDPA blocks: the written-out softmax is refused
    ("ring", "{}", "`softmax` (node `softmax`) takes a softmax over the sequence"),
    # a mixing op outside attention stays refused under Ulysses
    ("ulysses", "{ pool = true }", "`mean` (node `mean`) reduces over the sequence"),
])
def test_what_ulysses_regions_do_not_cover_is_refused(method, args, said):
    with pytest.raises(PlanError) as err:
        compile_plan(parse_plan(eager_text(method, args), "cp.plan"))
    message = str(err.value)
    assert "cp.plan:9:" in message and said in message, message
