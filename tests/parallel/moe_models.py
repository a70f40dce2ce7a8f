"""Tiny float64 MoE models for the expert-parallel tests (2 layers, hidden 32, 4 experts).

transformers' Mixtral, Qwen2-MoE (with its shared expert) and OLMoE from tiny
configs, and pipeplan's example MoE GPT with SiLU experts: built in float64 so
equivalence is judged at rtol 1e-9 / atol 1e-12. transformers' experts run their
`batched_mm` kernel: the default `grouped_mm` has no float64 CPU kernel.
"""
from __future__ import annotations

import torch

from pipeplan.examples.models.moe_gpt import MoEGPT


def mixtral(layers: int = 2):
    from transformers import MixtralConfig, MixtralForCausalLM
    return MixtralForCausalLM(MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=64, use_cache=False,
        attn_implementation="sdpa", experts_implementation="batched_mm")).double()


def qwen2_moe(layers: int = 2):
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM
    return Qwen2MoeForCausalLM(Qwen2MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=32, moe_intermediate_size=16,
        shared_expert_intermediate_size=32, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
        use_cache=False, experts_implementation="batched_mm")).double()


def olmoe(layers: int = 2):
    from transformers import OlmoeConfig, OlmoeForCausalLM
    return OlmoeForCausalLM(OlmoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=4, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=64, use_cache=False, bos_token_id=0, eos_token_id=0,
        pad_token_id=0, experts_implementation="batched_mm")).double()


def silu_moe_gpt(layers: int = 2):
    """pipeplan's example MoE with SiLU experts (the old hard-coded GELU would differ)."""
    return MoEGPT(vocab=64, dim=32, layers=layers, heads=4, seq_len=8, num_experts=4, top_k=2,
                  activation="silu").double()


def moe_gpt(layers: int = 2):
    return MoEGPT(vocab=64, dim=32, layers=layers, heads=4, seq_len=8, num_experts=4,
                  top_k=2).double()


MODELS = {"mixtral": mixtral, "qwen2_moe": qwen2_moe, "olmoe": olmoe, "moe_gpt": moe_gpt,
          "silu_moe_gpt": silu_moe_gpt}
# the MoE layers' pattern per model
MOE_LAYERS = {"mixtral": "model.layers.*.mlp", "qwen2_moe": "model.layers.*.mlp",
              "olmoe": "model.layers.*.mlp", "moe_gpt": "layers.*.moe",
              "silu_moe_gpt": "layers.*.moe"}


def experts_of(name: str, layer: int = 0) -> torch.nn.Module:
    torch.manual_seed(0)
    model = MODELS[name]()
    path = MOE_LAYERS[name].replace("*", str(layer))
    return model.get_submodule(path).experts


def _router_logits(model):
    """The model returning its load-balancing loss (`output_router_logits=True`): used as
    the model's own loss with `loss = model` and labels; refused with cross_entropy
    (docs/parallelism.md, "Aux losses")."""
    model.config.output_router_logits = True
    return model


def mixtral_router_logits(layers: int = 2):
    return _router_logits(mixtral(layers))


def qwen2_moe_router_logits(layers: int = 2):
    return _router_logits(qwen2_moe(layers))


def olmoe_router_logits(layers: int = 2):
    return _router_logits(olmoe(layers))
