"""Test models for tensor parallelism whose maths pipeplan's old substitute attention lacked.

`WindowLM`: attention with a NON-causal mask (each token sees the tokens within
`window` positions on both sides), computed by hand (scores, masked_fill,
softmax) in one block and through SDPA with a boolean `attn_mask` in the
other; RMSNorm, a SwiGLU MLP, a per-head learned temperature, and an LM head
tied to the embedding. Traceable by fx.

`RoutedLM`: ops DTensor may refuse on split values (in-place writes, an op of a library
of its own), for the dry run of tp stages at check time.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:  # the per-module init pipeplan applies
        nn.init.ones_(self.weight)

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class WindowAttention(nn.Module):
    def __init__(self, dim: int, heads: int, window: int, use_sdpa: bool,
                 literal_fill: bool = False, learned_bias: bool = False):
        super().__init__()
        self.heads, self.window, self.use_sdpa = heads, window, use_sdpa
        self.literal_fill = literal_fill  # masked scores from torch.tensor(min), as GPT-Neo
        # a learned bias per head and relative position, added to the scores (T5's); only
        # where SDPA takes it as its mask (the other path would leave it unread)
        self.rel = nn.Embedding(2 * 64 - 1, heads) if learned_bias and use_sdpa else None
        # the attribute names the old substitute attention keyed on (heads, q, k, v, proj)
        self.q = nn.Linear(dim, dim, bias=False)
        self.k = nn.Linear(dim, dim, bias=False)
        self.v = nn.Linear(dim, dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        h = self.heads
        q = self.q(x).view(b, t, h, d // h).transpose(1, 2)
        k = self.k(x).view(b, t, h, d // h).transpose(1, 2)
        v = self.v(x).view(b, t, h, d // h).transpose(1, 2)
        pos = torch.arange(t, device=x.device)
        mask = (pos[:, None] - pos[None, :]).abs() <= self.window  # sees both sides
        if self.use_sdpa and self.rel is not None:  # the bias as SDPA's float mask
            bias = self.rel(pos[:, None] - pos[None, :] + 63).permute(2, 0, 1)[None]
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=bias.masked_fill(~mask, float("-inf")))
        elif self.use_sdpa:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            scores = (q @ k.transpose(-2, -1)) / (d // h) ** 0.5
            if self.literal_fill:  # export: lift_fresh_copy of a constant tensor
                fill = torch.tensor(torch.finfo(scores.dtype).min, dtype=scores.dtype)
                y = torch.where(mask, scores, fill).softmax(-1) @ v
            else:
                y = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, window: int, use_sdpa: bool,
                 literal_fill: bool = False, learned_bias: bool = False):
        super().__init__()
        self.norm1, self.norm2 = RMSNorm(dim), RMSNorm(dim)
        self.attn = WindowAttention(dim, heads, window, use_sdpa, literal_fill, learned_bias)
        self.mlp = SwiGLU(dim, 2 * dim)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class WindowLM(nn.Module):
    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 4, layers: int = 2,
                 window: int = 2, softcap: float = 0.0, literal_fill: bool = False,
                 learned_bias: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.softcap = softcap  # > 0: logits soft-capped (Gemma 2's), then scaled (Cohere's)
        self.literal_fill = literal_fill
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, heads, window, use_sdpa=i % 2 == 1,
                                          literal_fill=literal_fill, learned_bias=learned_bias)
                                    for i in range(layers))
        self.norm = RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, input_ids):
        if self.literal_fill:  # the ids shifted right in place, as T5 makes decoder ids
            shifted = input_ids.new_zeros(input_ids.shape)
            shifted[..., 1:] = input_ids[..., :-1].clone()
            shifted[..., 0] = 1
            input_ids = shifted
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        logits = self.head(self.norm(x))
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap * 0.5
        return logits


class MegatronLayer(nn.Module):
    """The transformer layer Korthikanti et al. 2022 count activations of (§4.1): LayerNorm,
    Q/K/V and output projections, attention computed by hand (QK^T, softmax, dropout,
    times V: no fused kernel), dropout after the projection and after the MLP (h -> 4h
    GELU -> h), residuals."""

    def __init__(self, dim: int, heads: int, p: float = 0.1):
        super().__init__()
        self.heads, self.p = heads, p
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.q, self.k, self.v = (nn.Linear(dim, dim) for _ in range(3))
        self.proj = nn.Linear(dim, dim)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, s, d = x.shape
        a = self.heads
        y = self.ln1(x)
        q, k, v = (f(y).view(b, s, a, d // a).transpose(1, 2) for f in (self.q, self.k, self.v))
        scores = (q @ k.transpose(-2, -1)) * (d // a) ** -0.5
        probs = F.dropout(scores.softmax(-1), self.p, self.training)
        y = (probs @ v).transpose(1, 2).reshape(b, s, d)
        x = x + F.dropout(self.proj(y), self.p, self.training)
        return x + F.dropout(self.down(F.gelu(self.up(self.ln2(x)))), self.p, self.training)


class MegatronGPT(nn.Module):
    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 4, layers: int = 1,
                 p: float = 0.1):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(MegatronLayer(dim, heads, p) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


class NormBetweenLM(nn.Module):
    """Blocks of two Linear chains: `up -> GELU -> down` (Megatron's pair) and `a -> LayerNorm
    -> b` (a norm over a's features between them: no pair), each added to the residual; or,
    `single`, one Linear a block (nothing to pair); `conv`: a depthwise causal convolution
    over the sequence in place of the norm (Inkling's short convolution of k and v: its
    weight holds every channel)."""

    def __init__(self, vocab: int = 64, dim: int = 32, layers: int = 2, single: bool = False,
                 conv: bool = False):
        super().__init__()
        self.single, self.conv = single, conv
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(nn.ModuleDict(dict(
            up=nn.Linear(dim, 2 * dim), down=nn.Linear(2 * dim, dim), a=nn.Linear(dim, dim),
            norm=nn.Conv1d(dim, dim, 3, groups=dim, padding=2) if conv else nn.LayerNorm(dim),
            b=nn.Linear(dim, dim))) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        for layer in self.layers:
            if self.single:
                x = x + layer["a"](x)
                continue
            x = x + layer["down"](F.gelu(layer["up"](x)))
            if self.conv:
                t = x.shape[1]
                mixed = layer["norm"](layer["a"](x).transpose(1, 2))[..., :t].transpose(1, 2)
                x = x + layer["b"](mixed)
                continue
            x = x + layer["b"](layer["norm"](layer["a"](x)))
        return self.head(x)


class RoutedLM(nn.Module):
    """An MLP (up / down: a tensor-parallel pair), then a top-k router on its residual written
    in place, as Llama 4's: the router's top-k values scattered into zeros
    (`zeros_like(logits).scatter_(...)`), their sum gating the rows, which are then added to
    in place (`out.add_(rows)`). Under sequence parallel the router reads sequence shards.
    `kept = True` also takes a view of the scores before the write and reads it after (the
    write then cannot run out of place); `written = True` writes into the MLP's hidden
    values in place along their features, a view of them taken before read after;
    `custom = True` runs the hidden values through an op of a library of its own
    (`pipeplan_tests::doubled`: no sharding strategy anywhere)."""

    def __init__(self, vocab: int = 64, dim: int = 32, hidden: int = 64, experts: int = 4,
                 top: int = 2, kept: bool = False, written: bool = False,
                 custom: bool = False):
        super().__init__()
        self.top, self.kept, self.written, self.custom = top, kept, written, custom
        self.embed = nn.Embedding(vocab, dim)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)
        self.router = nn.Linear(dim, experts, bias=False)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        b, t, d = x.shape
        hidden = F.silu(self.up(x))
        if self.written:
            first = hidden[..., :1]
            hidden.scatter_(-1, torch.zeros_like(first, dtype=torch.long), first * 0.5)
            hidden = hidden + first
        h = x + self.down(_doubled(hidden) if self.custom else hidden)
        rows = h.reshape(-1, d)
        logits = self.router(rows)
        value, index = torch.topk(logits, self.top, dim=1)
        scores = torch.zeros_like(logits)
        before = scores[:, :1] if self.kept else None
        scores.scatter_(1, index, value)
        out = rows * torch.sigmoid(scores.sum(dim=1, keepdim=True))
        out.add_(rows)
        if before is not None:
            out = out + before
        return self.head(out.view(b, t, d))


@torch.library.custom_op("pipeplan_tests::doubled", mutates_args=())
def _doubled(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@_doubled.register_fake
def _doubled_fake(x):
    return torch.empty_like(x)


_doubled.register_autograd(lambda ctx, grad: grad * 2)
