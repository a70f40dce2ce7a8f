"""The example GPT as Megatron-LM ran it in Narayanan et al. 2021 (Table 1): the same blocks,
with 2021 Megatron's unfused attention core (QK^T, scaled causal softmax, dropout, PV as
separate kernels) and dropout 0.1 after attention and MLP."""
from __future__ import annotations

import math

import torch
from torch import nn

from pipeplan.examples.models import gpt

DROPOUT = 0.1


class Dropout(nn.Module):
    """torch's one-kernel dropout (what F.dropout runs on CUDA: output and mask at once);
    the plans trace it as a leaf so its meta run dispatches that kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.native_dropout(x, DROPOUT, self.training)[0]


class Attention(gpt.Attention):
    def __init__(self, dim: int, heads: int, seq_len: int):
        super().__init__(dim, heads)
        self.drop = Dropout()
        causal = torch.full((seq_len, seq_len), float("-inf")).triu(1)
        self.register_buffer("causal", causal, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.heads
        q = self.q(x).view(b, t, h, d // h).transpose(1, 2)
        k = self.k(x).view(b, t, h, d // h).transpose(1, 2)
        v = self.v(x).view(b, t, h, d // h).transpose(1, 2)
        # Megatron 2021's kernels, as near as eager torch comes: the scores' GEMM (the
        # 1/sqrt(d) scale applied to q), the causal mask added, softmax, dropout (torch's
        # one-kernel native_dropout, what F.dropout runs on CUDA), the GEMM with v
        scores = torch.matmul(q * (1.0 / math.sqrt(d // h)), k.transpose(-2, -1))
        probs = torch.softmax(scores + self.causal, dim=-1)
        probs = self.drop(probs)
        y = torch.matmul(probs, v)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(gpt.Block):
    def __init__(self, dim: int, heads: int, hidden: int, seq_len: int):
        super().__init__(dim, heads, hidden)
        self.attn = Attention(dim, heads, seq_len)
        self.drop1, self.drop2 = Dropout(), Dropout()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop1(self.attn(self.ln1(x)))
        return x + self.drop2(self.mlp(self.ln2(x)))


class GPT(gpt.GPT):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, seq_len: int):
        nn.Module.__init__(self)
        self.tok_emb = nn.Embedding(vocab, dim)
        self.pos_emb = nn.Embedding(seq_len, dim)
        self.layers = nn.ModuleList(Block(dim, heads, 4 * dim, seq_len) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.tok_emb.weight
