"""Ring attention (backends/ring_attention.py) on real gloo rings equals torch's
F.scaled_dot_product_attention on the whole sequence, in float64: outputs and dq, dk, dv
of every rank's positions, causal (load-balanced layout) or not, grouped-query K/V and a
custom scale, over rings of 4 and of 2 ranks."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

TOL = dict(rtol=1e-9, atol=1e-12)
SEQ = 16


def test_ring_columns_load_balance():
    from pipeplan.backends.ring_attention import ring_columns

    # 8 chunks of 2 positions; rank r holds chunks r and 7 - r
    assert ring_columns(SEQ, 4, 0).tolist() == [0, 1, 14, 15]
    assert ring_columns(SEQ, 4, 2).tolist() == [4, 5, 10, 11]
    every = torch.cat([ring_columns(SEQ, 4, r) for r in range(4)])
    assert sorted(every.tolist()) == list(range(SEQ))


def _case(group, causal: bool, heads: int, kv_heads: int, scale, seed: int) -> None:
    from pipeplan.backends.ring_attention import ring_attention, ring_columns

    g = torch.Generator().manual_seed(seed)  # the same whole tensors on every rank
    q = torch.randn(2, heads, SEQ, 8, dtype=torch.float64, generator=g)
    k = torch.randn(2, kv_heads, SEQ, 8, dtype=torch.float64, generator=g)
    v = torch.randn(2, kv_heads, SEQ, 8, dtype=torch.float64, generator=g)
    dout = torch.randn(2, heads, SEQ, 8, dtype=torch.float64, generator=g)
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*whole, is_causal=causal, scale=scale,
                                         enable_gqa=kv_heads != heads)
    ref.backward(dout)

    cols = ring_columns(SEQ, dist.get_world_size(group), dist.get_rank(group))
    mine = [t[:, :, cols].clone().requires_grad_() for t in (q, k, v)]
    out = ring_attention(*mine, group, is_causal=causal, scale=scale)
    out.backward(dout[:, :, cols])
    label = f"cp={dist.get_world_size(group)} causal={causal} heads={heads}/{kv_heads}"
    torch.testing.assert_close(out, ref[:, :, cols], **TOL, msg=lambda m: f"{label}: out {m}")
    for name, got, want in zip("qkv", mine, whole):
        torch.testing.assert_close(got.grad, want.grad[:, :, cols], **TOL,
                                   msg=lambda m, name=name: f"{label}: d{name} {m}")


def _worker(rank, world):
    ring4 = dist.group.WORLD
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    ring2 = pairs[rank // 2]
    _case(ring4, causal=True, heads=4, kv_heads=2, scale=0.3, seed=1)
    _case(ring4, causal=False, heads=2, kv_heads=2, scale=None, seed=2)
    _case(ring2, causal=True, heads=4, kv_heads=1, scale=None, seed=3 + rank // 2)


def test_ring_attention_equals_sdpa_on_the_whole_sequence(run_workers):
    run_workers(_worker, 4, timeout=120)


def test_ring_attention_refuses_other_devices():
    from pipeplan.backends.ring_attention import ring_attention
    from pipeplan.errors import PipeplanError

    q = torch.zeros(1, 1, 4, 2, device="meta")
    with pytest.raises(PipeplanError, match="use context { method = ulysses } there"):
        ring_attention(q, q, q, None, True)
