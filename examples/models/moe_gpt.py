"""A small mixture-of-experts GPT: every block's MLP is a top-k routed MoE layer.

Expert weights are stacked with the global expert index on dim 0 (`w_up[e]`,
`w_down[e]`), so a checkpoint stores experts by global index and expert
parallelism shards dim 0. The reference computation is dropless: every expert
runs densely on every token and the router's top-k gates (zero elsewhere) mix
them, so the math equals any exact token dispatch and stays traceable by
torch.fx. Each MoE layer returns its auxiliary loss (load balancing + router
z-loss, computed over the tokens it sees); the model returns (logits, aux).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .gpt import Attention, init_weights


class MoE(nn.Module):
    def __init__(self, dim: int, hidden: int, num_experts: int = 8, top_k: int = 2,
                 aux_loss: float = 0.01, z_loss: float = 0.001):
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.aux_coef, self.z_coef = aux_loss, z_loss
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.w_up = nn.Parameter(torch.randn(num_experts, dim, hidden) * dim ** -0.5)
        self.w_down = nn.Parameter(torch.randn(num_experts, hidden, dim) * hidden ** -0.5)

    def reset_parameters(self) -> None:
        """The experts' init (as in __init__): normal, std 1/sqrt(fan in)."""
        with torch.no_grad():
            self.w_up.normal_(0.0, self.w_up.shape[1] ** -0.5)
            self.w_down.normal_(0.0, self.w_down.shape[1] ** -0.5)

    def route(self, tokens: torch.Tensor):
        """(gates [T, E] zero outside each token's top-k, aux loss scalar)."""
        logits = self.router(tokens)
        probs = logits.softmax(dim=-1)
        top_p, top_i = probs.topk(self.top_k, dim=-1)
        top_p = top_p / top_p.sum(dim=-1, keepdim=True)
        gates = torch.zeros_like(probs).scatter(-1, top_i, top_p)
        # Switch-style load balancing: E * sum_e f_e * P_e, f_e = share of routed slots.
        chosen = torch.zeros_like(probs).scatter(-1, top_i, 1.0)
        f = chosen.mean(dim=0) / self.top_k
        p = probs.mean(dim=0)
        aux = self.aux_coef * self.num_experts * (f * p).sum()
        aux = aux + self.z_coef * torch.logsumexp(logits, dim=-1).pow(2).mean()
        return gates, aux

    def experts(self, tokens: torch.Tensor) -> torch.Tensor:
        """Every expert on every token: [T, E, D]."""
        h = F.gelu(torch.einsum("td,edh->teh", tokens, self.w_up))
        return torch.einsum("teh,ehd->ted", h, self.w_down)

    def forward(self, x: torch.Tensor):
        b, t, d = x.shape
        tokens = x.reshape(b * t, d)
        gates, aux = self.route(tokens)
        out = torch.einsum("te,ted->td", gates, self.experts(tokens))
        return out.reshape(b, t, d), aux


class MoEBlock(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int, num_experts: int, top_k: int,
                 aux_loss: float, z_loss: float):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.moe = MoE(dim, hidden, num_experts, top_k, aux_loss, z_loss)

    def forward(self, x: torch.Tensor, aux: torch.Tensor):
        x = x + self.attn(self.ln1(x))
        y, layer_aux = self.moe(self.ln2(x))
        return x + y, aux + layer_aux


class MoEGPT(nn.Module):
    def __init__(self, vocab: int = 256, dim: int = 64, layers: int = 4, heads: int = 4,
                 seq_len: int = 64, hidden: int | None = None, num_experts: int = 8,
                 top_k: int = 2, aux_loss: float = 0.01, z_loss: float = 0.001,
                 tie_embeddings: bool = True):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, dim)
        self.pos_emb = nn.Embedding(seq_len, dim)
        self.layers = nn.ModuleList(
            MoEBlock(dim, heads, hidden or 2 * dim, num_experts, top_k, aux_loss, z_loss)
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
