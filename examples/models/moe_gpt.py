"""A small mixture-of-experts GPT: every block's MLP is a top-k routed MoE layer.

Each MoE layer offers pipeplan's MoE interface (docs/parallelism.md): its own
router code computes the top-k experts and weights, then ONE call
`self.experts(tokens, top_k_index, top_k_weights)` runs them. `Experts` keeps
the weights stacked with the global expert index on dim 0 (`w_up[e]`,
`w_down[e]`), so a checkpoint stores experts by global index and expert
parallelism shards dim 0. Its computation is dropless and dense: every expert
it holds runs on every token and the top-k weights (zero elsewhere) mix them,
so the math equals any exact token dispatch and stays traceable by torch.fx.
Each MoE layer returns its auxiliary loss (load balancing + router z-loss,
computed over the tokens it sees); the model returns (logits, aux).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .gpt import Attention, init_weights


ACTIVATIONS = {"gelu": F.gelu, "silu": F.silu}


class Experts(nn.Module):
    """Stacked MLP experts: forward(tokens [T, d], top_k_index [T, k], top_k_weights [T, k])."""

    def __init__(self, dim: int, hidden: int, num_experts: int, activation: str = "gelu"):
        super().__init__()
        self.activation = activation
        self.w_up = nn.Parameter(torch.randn(num_experts, dim, hidden) * dim ** -0.5)
        self.w_down = nn.Parameter(torch.randn(num_experts, hidden, dim) * hidden ** -0.5)

    def reset_parameters(self) -> None:
        """The experts' init (as in __init__): normal, std 1/sqrt(fan in)."""
        with torch.no_grad():
            self.w_up.normal_(0.0, self.w_up.shape[1] ** -0.5)
            self.w_down.normal_(0.0, self.w_down.shape[1] ** -0.5)

    def forward(self, tokens: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        experts = self.w_up.shape[0]
        gates = tokens.new_zeros(tokens.shape[0], experts).scatter(  # in the tokens' dtype
            -1, top_k_index, top_k_weights.to(tokens.dtype))  # (bf16 autocast: fp32 weights)
        h = ACTIVATIONS[self.activation](torch.einsum("td,edh->teh", tokens, self.w_up))
        return torch.einsum("te,ted->td", gates, torch.einsum("teh,ehd->ted", h, self.w_down))


class MoE(nn.Module):
    def __init__(self, dim: int, hidden: int, num_experts: int = 8, top_k: int = 2,
                 aux_loss: float = 0.01, z_loss: float = 0.001, activation: str = "gelu"):
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.aux_coef, self.z_coef = aux_loss, z_loss
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.experts = Experts(dim, hidden, num_experts, activation)

    def route(self, tokens: torch.Tensor):
        """(top-k weights renormalised [T, k], top-k experts [T, k], aux loss scalar)."""
        logits = self.router(tokens)
        probs = logits.softmax(dim=-1)
        top_p, top_i = probs.topk(self.top_k, dim=-1)
        top_w = top_p / top_p.sum(dim=-1, keepdim=True)
        # Switch-style load balancing: E * sum_e f_e * P_e, f_e = share of routed slots.
        chosen = torch.zeros_like(probs).scatter(-1, top_i, 1.0)
        f = chosen.mean(dim=0) / self.top_k
        p = probs.mean(dim=0)
        aux = self.aux_coef * self.num_experts * (f * p).sum()
        aux = aux + self.z_coef * torch.logsumexp(logits, dim=-1).pow(2).mean()
        return top_w, top_i, aux

    def forward(self, x: torch.Tensor):
        b, t, d = x.shape
        tokens = x.reshape(b * t, d)
        top_w, top_i, aux = self.route(tokens)
        out = self.experts(tokens, top_i, top_w)
        return out.reshape(b, t, d), aux


class MoEBlock(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int, num_experts: int, top_k: int,
                 aux_loss: float, z_loss: float, activation: str = "gelu"):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.moe = MoE(dim, hidden, num_experts, top_k, aux_loss, z_loss, activation)

    def forward(self, x: torch.Tensor, aux: torch.Tensor):
        x = x + self.attn(self.ln1(x))
        y, layer_aux = self.moe(self.ln2(x))
        return x + y, aux + layer_aux


class MoEGPT(nn.Module):
    def __init__(self, vocab: int = 256, dim: int = 64, layers: int = 4, heads: int = 4,
                 seq_len: int = 64, hidden: int | None = None, num_experts: int = 8,
                 top_k: int = 2, aux_loss: float = 0.01, z_loss: float = 0.001,
                 tie_embeddings: bool = True, activation: str = "gelu"):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, dim)
        self.pos_emb = nn.Embedding(seq_len, dim)
        self.layers = nn.ModuleList(
            MoEBlock(dim, heads, hidden or 2 * dim, num_experts, top_k, aux_loss, z_loss,
                     activation)
            for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        if tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.apply(init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        """The per-module rule pipeplan applies after each module's reset_parameters()."""
        init_weights(module)

    def forward(self, input_ids: torch.Tensor):
        t = input_ids.shape[1]
        pos = torch.arange(t, device=input_ids.device)
        x = self.tok_emb(input_ids) + self.pos_emb(pos)
        aux = x.new_zeros(())
        for layer in self.layers:
            x, aux = layer(x, aux)
        return self.lm_head(self.ln_f(x)), aux
