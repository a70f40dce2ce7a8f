"""Small test-only models with the traits the compiler must handle."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SkipNet(nn.Module):
    """An embedding whose output is added back after the last layer: with 4 stages the
    skip crosses three stage boundaries and must be forwarded through stages 1 and 2."""

    def __init__(self, vocab: int = 32, dim: int = 16, layers: int = 4):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids):
        x0 = self.emb(input_ids)
        x = x0
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x + x0)


class Uniform(nn.Module):
    """`layers` identical blocks between a tiny input and output projection; the head
    can be made `head_scale` times wider to weigh more."""

    def __init__(self, dim: int = 32, layers: int = 16, vocab: int = 8, head_scale: int = 1):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))
        self.head = nn.Linear(dim, vocab * head_scale)
        self.vocab = vocab

    def forward(self, input_ids):
        x = self.emb(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class Branchy(nn.Module):
    """Data-dependent control flow: symbolic_trace cannot capture it."""

    def __init__(self, dim: int = 8, vocab: int = 16):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.gate = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids):
        x = self.emb(input_ids)
        if x.sum() > 0:
            x = self.gate(x)
        return self.head(x)


class Regressor(nn.Module):
    """A float-input model for the mse loss."""

    def __init__(self, dim: int = 8, layers: int = 2):
        super().__init__()
        self.layers = nn.Sequential(*(nn.Linear(dim, dim) for _ in range(layers)))

    def forward(self, x):
        return self.layers(x)


def tiny_llama(vocab: int = 64, dim: int = 32, layers: int = 4, heads: int = 4, kv_heads: int = 2,
               tie: bool = False, use_cache: bool = False):
    """A transformers Llama from a tiny config (decorated forward, mask code: fx cannot trace)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=dim, intermediate_size=2 * dim,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, max_position_embeddings=64, use_cache=use_cache,
                      tie_word_embeddings=tie, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg)


def tiny_mixtral(vocab: int = 64, dim: int = 32, layers: int = 2, experts: int = 4, top_k: int = 2):
    from transformers import MixtralConfig, MixtralForCausalLM
    cfg = MixtralConfig(vocab_size=vocab, hidden_size=dim, intermediate_size=2 * dim,
                        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                        num_local_experts=experts, num_experts_per_tok=top_k,
                        max_position_embeddings=64, use_cache=False, attn_implementation="sdpa")
    return MixtralForCausalLM(cfg)


class Mixed(nn.Module):
    """Part traceable, part not: the branchy inner block breaks fx, the rest is plain."""

    def __init__(self, dim: int = 8, vocab: int = 16):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.block = Branchy(dim, vocab)
        self.head = nn.Linear(vocab, vocab)

    def forward(self, input_ids):
        return self.head(self.block(input_ids))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def reset_parameters(self):
        nn.init.ones_(self.weight)

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class LlamaAttention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.q = nn.Linear(dim, dim, bias=False)
        self.k = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.v = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        q = self.q(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o(y.transpose(1, 2).reshape(b, t, d))


class LlamaBlock(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, ffn: int):
        super().__init__()
        self.attn_norm = RMSNorm(dim)
        self.attn = LlamaAttention(dim, heads, kv_heads)
        self.mlp_norm = RMSNorm(dim)
        self.gate = nn.Linear(dim, ffn, bias=False)
        self.up = nn.Linear(dim, ffn, bias=False)
        self.down = nn.Linear(ffn, dim, bias=False)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    """Llama-shaped (RMSNorm, GQA attention, SwiGLU, untied head), fx-traceable; defaults are
    the 70B shape: 80 layers, hidden 8192, 64 heads, 8 KV heads, FFN 28672, vocab 128256."""

    def __init__(self, vocab: int = 128256, dim: int = 8192, layers: int = 80, heads: int = 64,
                 kv_heads: int = 8, ffn: int = 28672):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(LlamaBlock(dim, heads, kv_heads, ffn) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, input_ids):
        x = self.tok_emb(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


class Widen(nn.Module):
    """No parameters: doubles the width (the same graph in every layer, other shapes)."""

    def forward(self, x):
        return torch.cat([x, torch.tanh(x) * x], dim=-1)


class Widening(nn.Module):
    """A stack of parameter-free layers that look alike and save different bytes (each
    layer's input is twice as wide as the last's)."""

    def __init__(self, vocab: int = 64, dim: int = 4, layers: int = 4):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Widen() for _ in range(layers))
        self.lm_head = nn.Linear(dim * 2 ** layers, vocab)

    def forward(self, input_ids):
        x = self.tok_emb(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(x)


class Pair(nn.Module):
    """Returns a tuple; traced as a leaf its output is one fx value until indexed."""

    def __init__(self, dim: int):
        super().__init__()
        self.scale = nn.Parameter(torch.full((dim,), 2.0))

    def forward(self, x):
        return x * self.scale, x + 1


class LateIndex(nn.Module):
    """Indexes a leaf module's tuple output two stages later."""

    def __init__(self, vocab: int = 16, dim: int = 8):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.pair = Pair(dim)
        self.l1 = nn.Linear(dim, dim)
        self.l2 = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids):
        out = self.pair(self.emb(input_ids))
        h = self.l1(out[0])
        return self.head(self.l2(h) + out[1])


class NonzeroRouter(nn.Module):
    """Routes tokens with nonzero(): its output shape depends on the data."""

    def __init__(self, dim: int = 8):
        super().__init__()
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        idx = (x.sum(-1) > 0).nonzero()
        out = x.clone()
        out[idx[:, 0], idx[:, 1]] = self.proj(x[idx[:, 0], idx[:, 1]])
        return out


class DataDependentLeaf(nn.Module):
    def __init__(self, vocab: int = 16, dim: int = 8):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.router = NonzeroRouter(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids):
        return self.head(self.router(self.emb(input_ids)))


class LoopMoE(nn.Module):
    """The eager MoE pattern: a Python loop over experts that skips empty ones. fx cannot
    trace `if ...numel() == 0` (data-dependent control flow); as a leaf it runs as is."""

    def __init__(self, dim: int = 8, num_experts: int = 4, top_k: int = 2):
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.experts = nn.ModuleList(nn.Linear(dim, dim) for _ in range(num_experts))

    def forward(self, x):
        tokens = x.reshape(-1, x.shape[-1])
        probs = self.router(tokens).softmax(-1)
        top_p, top_i = probs.topk(self.top_k, dim=-1)
        out = torch.zeros_like(tokens)
        for e, expert in enumerate(self.experts):
            rows, slot = (top_i == e).nonzero(as_tuple=True)
            if rows.numel() == 0:
                continue
            out = out.index_add(0, rows, top_p[rows, slot, None] * expert(tokens[rows]))
        return out.reshape(x.shape)


class LoopMoENet(nn.Module):
    def __init__(self, vocab: int = 16, dim: int = 8, layers: int = 2, num_experts: int = 4,
                 top_k: int = 2):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(LoopMoE(dim, num_experts, top_k) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids):
        x = self.emb(input_ids)
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


def tiny_qwen2_moe(layers: int = 4):
    """Qwen2-MoE: routed experts plus a gated shared expert."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM
    return Qwen2MoeForCausalLM(Qwen2MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
        use_cache=False))


def tiny_olmoe(layers: int = 4):
    from transformers import OlmoeConfig, OlmoeForCausalLM
    return OlmoeForCausalLM(OlmoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=4, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=64, use_cache=False, bos_token_id=0, eos_token_id=0,
        pad_token_id=0))


def tiny_gpt2(layers: int = 4):
    """GPT-2 keeps its dropout: the stage graphs replay it in the same order."""
    from transformers import GPT2Config, GPT2LMHeadModel
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=layers, n_head=4,
                                      n_positions=64, use_cache=False, bos_token_id=0,
                                      eos_token_id=0))


def hf_llama_70b(layers: int = 80):
    """transformers' Llama with Llama-3-70B's shape (build it on the meta device)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=layers,
        num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=8192,
        rope_theta=500000.0, use_cache=False, bos_token_id=0, eos_token_id=0))


class _StraightThrough(torch.autograd.Function):
    """Rounds forward; passes the gradient through unchanged (a straight-through estimator):
    autograd's gradient of round() is zero, this Function's is the identity."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class _Square(torch.autograd.Function):
    """x * x, with its derivative written out (as BLOOM's GeLUFunction writes its own)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 2.0 * x * grad


class FunctionLM(nn.Module):
    """An embedding through a custom autograd.Function, then a head: `fn` is "round" (a
    straight-through estimator, its embedding scaled to quarter steps) or "square"."""

    def __init__(self, vocab: int = 8, dim: int = 8, fn: str = "round"):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, vocab)
        self.fn = fn

    def forward(self, input_ids):
        x = self.embed(input_ids)
        if self.fn == "round":
            return self.head(_StraightThrough.apply(x * 4) / 4)
        return self.head(_Square.apply(x))


class NoGradIndexer(nn.Module):
    """DeepSeek-V3.2's indexer in miniature: under `torch.no_grad()` a scorer (its only
    reader) picks each position's top-2 earlier positions; the layer then attends to those
    with gradients, through two Linear blocks (a pipeline of 2 splits between them)."""

    def __init__(self, vocab: int = 16, dim: int = 8, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(_Picked(dim) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class _Picked(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.scorer, self.value = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x):
        t = x.shape[1]
        with torch.no_grad():
            s = self.scorer(x) @ x.transpose(1, 2)
            s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
            idx = s.topk(2, dim=-1).indices  # [b, t, 2]
        picked = torch.gather(self.value(x).unsqueeze(1).expand(-1, t, -1, -1), 2,
                              idx.unsqueeze(-1).expand(-1, -1, -1, x.shape[-1]))
        return x + picked.mean(2)


class Centered(nn.Module):
    """Each block's Linear output centred over the sequence (x - mean over positions, as a
    BatchNorm's mean over its batch): the block's bias cancels, its exact gradient is zero,
    and the computed one is float64 rounding noise."""

    def __init__(self, vocab: int = 16, dim: int = 8, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        for layer in self.layers:
            h = layer(x)
            x = x + torch.tanh(h - h.mean(1, keepdim=True))
        return self.head(x)


class Normed(nn.Module):
    """A BatchNorm1d over the features after each block's Linear: its forward writes the
    running statistics (and a counter), state the trained model keeps."""

    def __init__(self, vocab: int = 16, dim: int = 8, layers: int = 4):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))
        self.norms = nn.ModuleList(nn.BatchNorm1d(dim) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        for layer, norm in zip(self.layers, self.norms):
            x = x + torch.tanh(norm(layer(x).transpose(1, 2)).transpose(1, 2))
        return self.head(x)


class ComplexRotary(nn.Module):
    """torchtitan's (and Meta's reference) Llama rotary in miniature: a complex64 table
    `freqs_cis` (torch.polar) as a buffer, queries and keys rotated through
    view_as_complex / view_as_real; the table's slice crosses the stages of a pipeline."""

    def __init__(self, vocab: int = 16, dim: int = 8, layers: int = 2, seq: int = 8):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        angles = torch.outer(torch.arange(2 * seq).float(),
                             1.0 / 10000 ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles),
                             persistent=False)
        self.layers = nn.ModuleList(nn.Linear(dim, 2 * dim) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        freqs = self.freqs_cis[: input_ids.shape[1]]
        for layer in self.layers:
            q, k = layer(x).chunk(2, dim=-1)
            q, k = (torch.view_as_real(torch.view_as_complex(t.reshape(*t.shape[:-1], -1, 2))
                                       * freqs).flatten(2).type_as(x) for t in (q, k))
            x = x + torch.softmax(q @ k.transpose(1, 2), dim=-1) @ x
        return self.head(x)
