"""A Llama-shaped test model for context parallelism, traceable by fx.

`RopeLM`: RMSNorm, rotary position embedding on q and k from `position_ids`, grouped-
query attention (4 heads, 2 KV heads) through `scaled_dot_product_attention(...,
is_causal=True, enable_gqa=True)`, a SwiGLU MLP. `dropout` is SDPA's dropout_p (0 by default). `position_ids` may be omitted (the
reference calls `model(input_ids)`): then the positions are 0..S-1 of the whole
sequence, computed here.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .tp_models import RMSNorm, SwiGLU


def rotate(x, cos, sin):
    a, b = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-b, a), dim=-1) * sin


class GQAttention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, dropout: float = 0.0):
        super().__init__()
        self.heads, self.kv_heads, self.hd, self.dropout = heads, kv_heads, dim // heads, dropout
        self.q = nn.Linear(dim, dim, bias=False)
        self.k = nn.Linear(dim, kv_heads * self.hd, bias=False)
        self.v = nn.Linear(dim, kv_heads * self.hd, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)
        inv = 1.0 / (10000 ** (torch.arange(0, self.hd, 2).float() / self.hd))
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, x, position_ids):
        b, t, d = x.shape
        q = self.q(x).view(b, t, self.heads, self.hd).transpose(1, 2)
        k = self.k(x).view(b, t, self.kv_heads, self.hd).transpose(1, 2)
        v = self.v(x).view(b, t, self.kv_heads, self.hd).transpose(1, 2)
        freqs = position_ids[:, None, :, None].to(x.dtype) * self.inv_freq.to(x.dtype)
        angles = torch.cat((freqs, freqs), dim=-1)
        cos, sin = angles.cos(), angles.sin()
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout, is_causal=True,
                                           enable_gqa=True)
        return self.o(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, dropout: float = 0.0):
        super().__init__()
        self.norm1, self.norm2 = RMSNorm(dim), RMSNorm(dim)
        self.attn = GQAttention(dim, heads, kv_heads, dropout)
        self.mlp = SwiGLU(dim, 2 * dim)

    def forward(self, x, position_ids):
        x = x + self.attn(self.norm1(x), position_ids)
        return x + self.mlp(self.norm2(x))


class RopeLM(nn.Module):
    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 4, kv_heads: int = 2,
                 layers: int = 4, dropout: float = 0.0):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, heads, kv_heads, dropout) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, input_ids, position_ids=None):
        if position_ids is None:
            t = input_ids.shape[1]
            position_ids = torch.arange(t, device=input_ids.device).expand_as(input_ids)
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x, position_ids)
        return self.head(self.norm(x))


class MemoryLM(nn.Module):
    """Attention from the sequence to a learned memory of `slots` keys/values (not
    self-attention: q and k differ in length)."""

    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 4, slots: int = 4):
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, dim)
        self.q = nn.Linear(dim, dim, bias=False)
        self.memory = nn.Parameter(torch.randn(2, heads, slots, dim // heads))
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        b, t, d = x.shape
        q = self.q(x).view(b, t, self.heads, d // self.heads).transpose(1, 2)
        k, v = (m.expand(b, -1, -1, -1) for m in self.memory)
        y = F.scaled_dot_product_attention(q, k, v)
        return self.head(x + y.transpose(1, 2).reshape(b, t, d))


CAUSAL_SDPA = "pipeplan_causal_sdpa"


def _register_causal_sdpa() -> None:
    """transformers' own SDPA attention, registered under a name whose mask function builds
    no mask tensor (as flash_attention_2's does for unpadded batches), so the attention
    runs with is_causal = True: the form Ulysses can run on whole sequences."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(CAUSAL_SDPA, sdpa_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(CAUSAL_SDPA, lambda *args, **kwargs: None)


def causal_llama(vocab: int = 64, dim: int = 32, layers: int = 4, heads: int = 4,
                 kv_heads: int = 2):
    """transformers' LlamaForCausalLM from a tiny config (RoPE, GQA) with CAUSAL_SDPA."""
    from transformers import LlamaConfig, LlamaForCausalLM

    _register_causal_sdpa()
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=dim, intermediate_size=2 * dim,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, max_position_embeddings=64, use_cache=False,
                      attn_implementation=CAUSAL_SDPA)
    return LlamaForCausalLM(cfg)


class TableLM(nn.Module):
    """An encoder in BERT's form: learned positions read from a buffer of position ids cut
    to the input's length from `start` (`position_ids[:, start:start + t]`; `start =
    "last"`: the buffer's last t ids, `[:, -t:]`, whose start moves with t), bidirectional
    SDPA (no mask, not causal), then a head per token."""

    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 4, layers: int = 2,
                 max_len: int = 64, start=0):
        super().__init__()
        self.heads, self.start = heads, start
        self.embed = nn.Embedding(vocab, dim)
        self.positions = nn.Embedding(max_len, dim)
        self.register_buffer("position_ids", torch.arange(max_len)[None], persistent=False)
        self.qkv = nn.ModuleList(nn.Linear(dim, 3 * dim) for _ in range(layers))
        self.out = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids):
        b, t = input_ids.shape
        ids = self.position_ids[:, -t:] if self.start == "last" \
            else self.position_ids[:, self.start:self.start + t]
        x = self.embed(input_ids) + self.positions(ids)
        for qkv, out in zip(self.qkv, self.out):
            q, k, v = qkv(x).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v)
            x = x + out(y.transpose(1, 2).reshape(b, t, -1))
        return self.head(x)


def bert(layers: int = 2):
    """transformers' BertForMaskedLM from a tiny config (no dropout): bidirectional SDPA,
    its position ids and token type ids read from buffers cut to the input's length."""
    from transformers import BertConfig, BertForMaskedLM

    return BertForMaskedLM(BertConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_hidden_layers=layers, max_position_embeddings=64, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0))
