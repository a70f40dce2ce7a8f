"""Tiny random configs of transformers families and small hand-written models for the
any-model tests (no downloads): each builds in well under a second."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .cp_models import CAUSAL_SDPA, _register_causal_sdpa
from .tp_models import RMSNorm

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, use_cache=False)


def jamba(layers: int = 2):
    """Jamba: a Mamba layer (causal conv1d and a selective scan over the sequence) then an
    attention layer with MoE, attention through CAUSAL_SDPA (no mask tensor), so nothing
    but the Mamba layer stands between it and context parallel."""
    from transformers import JambaConfig, JambaForCausalLM

    _register_causal_sdpa()
    cfg = JambaConfig(**SMALL, num_hidden_layers=layers, num_experts=2, num_experts_per_tok=1,
                      expert_layer_period=2, expert_layer_offset=1, attn_layer_period=2,
                      attn_layer_offset=1, mamba_d_state=4, mamba_d_conv=4, mamba_expand=2,
                      mamba_dt_rank=4, attn_implementation=CAUSAL_SDPA)
    return JambaForCausalLM(cfg)


class CausalConvLM(nn.Module):
    """A short causal convolution over the sequence (depthwise, kernel 3, as in Mamba or
    Hyena blocks) before causal SDPA attention: position t reads t-2..t."""

    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 4, kernel: int = 3):
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, dim)
        self.conv = nn.Conv1d(dim, dim, kernel, groups=dim, padding=kernel - 1)
        self.norm = RMSNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        t = x.shape[1]
        x = x + self.conv(x.transpose(1, 2))[..., :t].transpose(1, 2)
        b, _, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, t, 3, self.heads, d // self.heads) \
            .permute(2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.head(x + y.transpose(1, 2).reshape(b, t, d))


def gemma3(layers: int = 4):
    """Gemma 3 text: sliding-window and full attention layers; its forward loops over
    `set(config.layer_types)`, whose order follows Python's hash seed."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(**SMALL, num_hidden_layers=layers, head_dim=8, sliding_window=4,
                           attn_implementation="sdpa")
    return Gemma3ForCausalLM(cfg)


def qwen3_moe(layers: int = 2):
    """Qwen3-MoE with transformers' default experts kernel (grouped_mm), as its config sets it."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(**SMALL, moe_intermediate_size=16, num_hidden_layers=layers,
                         num_experts=4, num_experts_per_tok=2, head_dim=8,
                         attn_implementation="sdpa")
    return Qwen3MoeForCausalLM(cfg)


class WrappedLlama(nn.Module):
    """A user module holding transformers' LlamaForCausalLM, returning its logits: how most
    people wrap a Hugging Face model. The user module has no init rule of its own."""

    def __init__(self, layers: int = 4):
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        self.model = LlamaForCausalLM(LlamaConfig(**SMALL, num_hidden_layers=layers,
                                                  attn_implementation="sdpa"))

    def forward(self, input_ids):
        return self.model(input_ids=input_ids).logits


class WrappedMixtral(nn.Module):
    """The same around MixtralForCausalLM (its default experts kernel)."""

    def __init__(self, layers: int = 4):
        super().__init__()
        from transformers import MixtralConfig, MixtralForCausalLM

        self.model = MixtralForCausalLM(MixtralConfig(**SMALL, num_hidden_layers=layers,
                                                      num_local_experts=4,
                                                      num_experts_per_tok=2,
                                                      attn_implementation="sdpa"))

    def forward(self, input_ids):
        return self.model(input_ids=input_ids).logits


class SeqOpLM(nn.Module):
    """Causal SDPA attention after one op on the embeddings: "cumsum" (a running sum over
    the sequence), "mean" (pooling over it), "roll" (a shift along it) mix positions;
    "features" (a running sum over the features) does not."""

    def __init__(self, op: str = "features", vocab: int = 64, dim: int = 32, heads: int = 4):
        super().__init__()
        self.op, self.heads = op, heads
        self.embed = nn.Embedding(vocab, dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        if self.op == "cumsum":
            x = x.cumsum(dim=1)
        elif self.op == "mean":
            x = x - x.mean(dim=1, keepdim=True)
        elif self.op == "roll":
            x = x + torch.roll(x, 1, dims=1)
        else:
            x = x.cumsum(dim=-1)
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads) \
            .permute(2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.head(x + y.transpose(1, 2).reshape(b, t, d))


def phi3(layers: int = 2):
    """Phi-3: one fused `qkv_proj` whose output the forward slices into q, k and v (4 query
    heads, 2 key/value heads), and one `gate_up_proj` it chunks into gate and up."""
    from transformers import Phi3Config, Phi3ForCausalLM

    cfg = Phi3Config(**SMALL, num_hidden_layers=layers, pad_token_id=0,
                     attn_implementation="sdpa")
    return Phi3ForCausalLM(cfg)


def gpt_neox(layers: int = 2):
    """GPT-NeoX: one `query_key_value` whose output is viewed per head as [heads, 3 *
    head_size] and chunked into q, k and v (interleaved by head), partial rotary."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    small = {k: v for k, v in SMALL.items() if k != "num_key_value_heads"}
    cfg = GPTNeoXConfig(**small, num_hidden_layers=layers, rotary_pct=0.5,
                        attn_implementation="sdpa")
    return GPTNeoXForCausalLM(cfg)


def bloom(layers: int = 2):
    """BLOOM: ALiBi added by `baddbmm` over [batch * heads, seq, dim] (the heads folded into
    the batch), a fused query_key_value viewed per head, biased Linears."""
    from transformers import BloomConfig, BloomForCausalLM

    return BloomForCausalLM(BloomConfig(vocab_size=64, hidden_size=32, n_layer=layers,
                                        n_head=4, hidden_dropout=0.0, attention_dropout=0.0,
                                        use_cache=False))


def bert(layers: int = 2):
    """BERT's masked LM: its head's transform normalises a GELU of a Linear's output."""
    from transformers import BertConfig, BertForMaskedLM

    small = {k: v for k, v in SMALL.items() if k not in ("num_key_value_heads", "use_cache")}
    return BertForMaskedLM(BertConfig(**small, num_hidden_layers=layers,
                                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def t5(layers: int = 2):
    """T5: a learned relative-position bias as attention's mask (it takes a gradient)."""
    from transformers import T5Config, T5ForConditionalGeneration

    return T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64,
                                               num_layers=layers, num_heads=4, dropout_rate=0.0,
                                               decoder_start_token_id=0, pad_token_id=0))


def bart(layers: int = 2):
    """BART: an encoder-decoder whose loss is its own (`loss = model`)."""
    from transformers import BartConfig, BartForConditionalGeneration

    return BartForConditionalGeneration(BartConfig(
        vocab_size=64, d_model=32, encoder_layers=layers, decoder_layers=layers,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, pad_token_id=1, decoder_start_token_id=2))


def deepseek_v3(layers: int = 2):
    """DeepSeek-V3: multi-head latent attention, a dense first layer then MoE with a sigmoid
    router that casts to float32 on purpose (`hidden.type(torch.float32)`), RMSNorms that
    upcast; attention through CAUSAL_SDPA (no mask tensor) so context parallel can run it."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    _register_causal_sdpa()
    small = {k: v for k, v in SMALL.items() if k != "num_key_value_heads"}
    cfg = DeepseekV3Config(**small, num_key_value_heads=4, num_hidden_layers=layers,
                           moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
                           n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1,
                           q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4,
                           qk_nope_head_dim=4, v_head_dim=8, attn_implementation=CAUSAL_SDPA)
    return DeepseekV3ForCausalLM(cfg)


class Float32AttentionLM(nn.Module):
    """Causal SDPA computed in float32 on purpose (`q.float()` ..., `.to(x.dtype)` back), as
    models keep a router or a softmax in float32: in a float64 run a float32 island, whose
    rounding a split of the sequence (ring attention's blocks) changes."""

    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads) \
            .permute(2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
        return self.head(x + y.to(x.dtype).transpose(1, 2).reshape(b, t, d))


# ------------------------------------------ the family survey (tests/parallel/test_family_matrix.py)
# Each factory: transformers' own CausalLM class from a tiny random config (2 layers, width
# 32, 4 heads and 2 KV heads where the family has GQA, 4 experts top-2 for MoE), with the
# library's defaults for attention and experts kernels unless named.

def _hf(config_name: str, model_name: str, layers: int, **extra):
    import transformers

    cfg = getattr(transformers, config_name)(**SMALL, num_hidden_layers=layers, **extra)
    return getattr(transformers, model_name)(cfg)


def llama(layers: int = 2):
    return _hf("LlamaConfig", "LlamaForCausalLM", layers)


def apertus(layers: int = 2):
    """Apertus: its xIELU activation's alpha_p, alpha_n are constants its constructor
    computes (`log(expm1(tensor(0.8)))`), which no init rule writes."""
    return _hf("ApertusConfig", "ApertusForCausalLM", layers)


def hrm_text(layers: int = 2):
    """HRM: its early reasoning cycles run under `torch.no_grad()` (export keeps the region
    as a higher-order op, which the capture inlines with its inputs detached)."""
    return _hf("HrmTextConfig", "HrmTextForCausalLM", layers)


def opt(layers: int = 2):
    """OPT at its default dropout (0.1 after attention and MLP): random draws in training,
    keyed so that every layout draws the single-process masks (backends/runtime/draws.py)."""
    import transformers

    cfg = transformers.OPTConfig(vocab_size=64, hidden_size=32, ffn_dim=64,
                                 num_attention_heads=4, max_position_embeddings=64,
                                 num_hidden_layers=layers, word_embed_proj_dim=32,
                                 use_cache=False)
    return transformers.OPTForCausalLM(cfg)


def gptj(layers: int = 2):
    """GPT-J: parallel attention and MLP, rotary on 4 of 8 head dims from a sinusoid table
    indexed by positions the model makes itself (which also build its mask)."""
    import transformers

    cfg = transformers.GPTJConfig(vocab_size=64, n_embd=32, n_head=4, n_positions=64,
                                  n_layer=layers, rotary_dim=4, use_cache=False)
    return transformers.GPTJForCausalLM(cfg)


def exaone4(layers: int = 2):
    """EXAONE 4: norms after attention and MLP only, so the vocab-split embedding's output
    feeds the first layer's q, k and v projections directly (its tp plan splits both)."""
    return _hf("Exaone4Config", "Exaone4ForCausalLM", layers)


def olmo2(layers: int = 2):
    """OLMo 2: q and k normalised over all heads' features (q_norm, k_norm on the whole
    projection), norms after attention and MLP only."""
    return _hf("Olmo2Config", "Olmo2ForCausalLM", layers)


def cohere(layers: int = 2):
    """Cohere: parallel attention and MLP, LayerNorm without bias, logits scaled (0.5)
    between the head its tp plan splits and the loss."""
    return _hf("CohereConfig", "CohereForCausalLM", layers, logit_scale=0.5)


def olmoe(layers: int = 2):
    """OLMoE: 4 experts top-2 in transformers' experts module (3-d weights indexed by
    expert), q/k RMSNorm; its own tp plan leaves the experts whole. Kernel batched_mm (what
    pipeplan's float64 runs switch grouped_mm to: compiler/estimate/precision.py), so the
    float64 reference of tests/parallel/tp_reference.py runs it too."""
    model = _hf("OlmoeConfig", "OlmoeForCausalLM", layers, num_experts=4,
                num_experts_per_tok=2)
    model.set_experts_implementation("batched_mm")
    return model


def gpt2(layers: int = 2, dropout: float = 0.0):
    """GPT-2: Conv1D projections (weights stored [in, out], `addmm(b, x, W)` on the tokens
    flattened to rows), fused c_attn split into q/k/v after the view back, tied head."""
    import transformers

    cfg = transformers.GPT2Config(vocab_size=64, n_embd=32, n_head=4, n_positions=64,
                                  n_layer=layers, use_cache=False, resid_pdrop=dropout,
                                  embd_pdrop=dropout, attn_pdrop=dropout)
    return transformers.GPT2LMHeadModel(cfg)


def falcon(layers: int = 2, new_decoder_architecture: bool = False):
    """Falcon: FalconLinear (`x @ W.T + b`), parallel attention and MLP summed in place
    (`aten.add_`), multi-query attention (one k/v head) from a fused query_key_value,
    or (new_decoder_architecture) grouped k/v heads interleaved with their queries."""
    import transformers

    cfg = transformers.FalconConfig(vocab_size=64, hidden_size=32, num_attention_heads=4,
                                    num_hidden_layers=layers, use_cache=False,
                                    new_decoder_architecture=new_decoder_architecture,
                                    num_kv_heads=2 if new_decoder_architecture else None,
                                    multi_query=not new_decoder_architecture,
                                    parallel_attn=True)
    return transformers.FalconForCausalLM(cfg)


def falcon_grouped(layers: int = 2):
    """Falcon's new decoder architecture: 2 k/v heads, each grouped with its 2 queries in
    the fused query_key_value ([..., kv_heads, 2 + 2, head_dim]): tp 2 splits whole groups."""
    return falcon(layers, new_decoder_architecture=True)


def albert(layers: int = 2):
    """ALBERT: one layer's weights applied as every layer (a module the graph runs several
    times), factorised embeddings, the masked-LM head."""
    import transformers

    cfg = transformers.AlbertConfig(vocab_size=64, embedding_size=16, hidden_size=32,
                                    intermediate_size=64, num_attention_heads=4,
                                    num_hidden_layers=layers, max_position_embeddings=64,
                                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return transformers.AlbertForMaskedLM(cfg)


def mpt(layers: int = 2):
    """MPT: ALiBi (a bias per head added to the attention scores), fused Wqkv chunked."""
    import transformers

    cfg = transformers.MptConfig(vocab_size=64, d_model=32, n_heads=4, n_layers=layers,
                                 max_seq_len=64, expansion_ratio=2)
    return transformers.MptForCausalLM(cfg)


def gpt_bigcode(layers: int = 2):
    """GPTBigCode (StarCoder): multi-query attention, one k/v head, its fused c_attn output
    unsqueezed then split into [embed, head_dim, head_dim]."""
    import transformers

    cfg = transformers.GPTBigCodeConfig(vocab_size=64, n_embd=32, n_layer=layers, n_head=4,
                                        n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                                        attn_pdrop=0.0, use_cache=False, multi_query=True)
    return transformers.GPTBigCodeForCausalLM(cfg)


def phimoe(layers: int = 2):
    """PhiMoE: a stochastic router (sparsemixer: Gumbel sampling, `torch.no_grad()` masks, a
    custom autograd.Function for its gradient) that `check` refuses at a plan line."""
    return _hf("PhimoeConfig", "PhimoeForCausalLM", layers, num_local_experts=4,
               num_experts_per_tok=2, pad_token_id=0)


def mistral(layers: int = 2):
    """Mistral: sdpa attention with a sliding window of 4."""
    return _hf("MistralConfig", "MistralForCausalLM", layers, sliding_window=4)


def qwen3(layers: int = 2):
    """Qwen3: q/k RMSNorm per head, sdpa."""
    return _hf("Qwen3Config", "Qwen3ForCausalLM", layers, head_dim=8)


def gemma2(layers: int = 2):
    """Gemma 2: eager attention (its default) with logit soft-capping, sliding window 4."""
    return _hf("Gemma2Config", "Gemma2ForCausalLM", layers, head_dim=8, sliding_window=4)


def mixtral(layers: int = 2):
    """Mixtral: 4 experts top-2, the default experts kernel."""
    return _hf("MixtralConfig", "MixtralForCausalLM", layers, num_local_experts=4,
               num_experts_per_tok=2)


def granite_moe(layers: int = 2):
    return _hf("GraniteMoeConfig", "GraniteMoeForCausalLM", layers, num_local_experts=4,
               num_experts_per_tok=2)


def gpt_oss(layers: int = 2):
    """GPT-OSS: attention sinks (eager by default), alternating sliding/full layers, MoE."""
    return _hf("GptOssConfig", "GptOssForCausalLM", layers, num_local_experts=4,
               num_experts_per_tok=2, head_dim=8, sliding_window=4)



def llama4_text(layers: int = 2):
    """Llama 4 text: every layer MoE (4 experts top-1 plus a shared expert), chunked attention."""
    return _hf("Llama4TextConfig", "Llama4ForCausalLM", layers, intermediate_size_mlp=64,
               num_local_experts=4, num_experts_per_tok=1, head_dim=8,
               interleave_moe_layer_step=1)




def dbrx(layers: int = 2):
    """DBRX: 4 experts top-2, fused Wqkv."""
    from transformers import DbrxConfig, DbrxForCausalLM

    return DbrxForCausalLM(DbrxConfig(
        vocab_size=64, d_model=32, n_heads=4, n_layers=layers, max_seq_len=64, use_cache=False,
        attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
        ffn_config=dict(ffn_hidden_size=64, moe_num_experts=4, moe_top_k=2)))


# ---------------------------------- MoE families with mask-free attention (cp locality tests)
def doge(layers: int = 2):
    """Doge: v's output also feeds `dt_proj`, whose output is added to the attention scores
    (a Linear reading a column's split and writing into one a row reads)."""
    return _hf("DogeConfig", "DogeForCausalLM", layers)


def diffllama(layers: int = 2):
    """DiffLlama: its lambdas drawn in its constructor by `torch.normal(mean, std, size=...)`
    (a CPU tensor even on meta) and again by its `_init_weights`."""
    return _hf("DiffLlamaConfig", "DiffLlamaForCausalLM", layers)


def mixtral_causal(layers: int = 2):
    """Mixtral (default experts kernel) with attention through CAUSAL_SDPA (no mask tensor):
    only its experts stand between it and context parallel."""
    _register_causal_sdpa()
    return _hf("MixtralConfig", "MixtralForCausalLM", layers, num_local_experts=4,
               num_experts_per_tok=2, attn_implementation=CAUSAL_SDPA)


def qwen3_moe_causal(layers: int = 2):
    """Qwen3-MoE (default experts kernel) with attention through CAUSAL_SDPA."""
    _register_causal_sdpa()
    return _hf("Qwen3MoeConfig", "Qwen3MoeForCausalLM", layers, moe_intermediate_size=16,
               num_experts=4, num_experts_per_tok=2, head_dim=8, attn_implementation=CAUSAL_SDPA)


def llama4_text_causal(layers: int = 2):
    """Llama 4 text (complex RoPE, MoE every layer) with attention through CAUSAL_SDPA."""
    _register_causal_sdpa()
    return _hf("Llama4TextConfig", "Llama4ForCausalLM", layers, intermediate_size_mlp=64,
               num_local_experts=4, num_experts_per_tok=1, head_dim=8,
               interleave_moe_layer_step=1, attn_implementation=CAUSAL_SDPA)


class SortedMoELM(nn.Module):
    """Causal SDPA attention then an MoE whose dispatch sorts the (token, expert) slots by
    expert id (`argsort` over the flattened tokens), gathers each slot's token row and its
    expert's weights in sorted order, and adds the weighted rows back into their tokens
    (`index_add`): dropless, so per token. `capacity` > 0 keeps only the first `capacity`
    sorted slots -- tokens dropped by their rank among all others' slots, which depends on
    the other positions ("first"); `capacity` < 0 keeps slots ranked below -capacity
    within their expert (counts of the sorted keys: "group")."""

    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 4, experts: int = 4,
                 top_k: int = 2, capacity: int = 0):
        super().__init__()
        self.heads, self.top_k, self.capacity, self.experts = heads, top_k, capacity, experts
        self.embed = nn.Embedding(vocab, dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.router = nn.Linear(dim, experts, bias=False)
        self.w_in = nn.Parameter(torch.empty(experts, dim, 2 * dim))
        self.w_out = nn.Parameter(torch.empty(experts, 2 * dim, dim))
        self.head = nn.Linear(dim, vocab, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The experts' weights (the other parameters are their modules')."""
        nn.init.normal_(self.w_in, std=self.w_in.shape[1] ** -0.5)
        nn.init.normal_(self.w_out, std=self.w_out.shape[1] ** -0.5)

    def moe(self, x):
        b, t, d = x.shape
        tokens = x.reshape(b * t, d)
        weights, ids = self.router(tokens).softmax(dim=-1).topk(self.top_k, dim=-1)
        slots = ids.reshape(-1)
        order = torch.argsort(slots)
        rows = tokens[order // self.top_k]
        keys = slots[order]
        h = F.silu(torch.bmm(rows.unsqueeze(1), self.w_in[keys]))
        y = torch.bmm(h, self.w_out[keys]).squeeze(1) * weights.reshape(-1)[order].unsqueeze(-1)
        if self.capacity > 0:
            y = y * (torch.arange(y.shape[0], device=y.device) < self.capacity).unsqueeze(-1).to(y.dtype)
        elif self.capacity < 0:
            starts = F.one_hot(keys, self.experts).sum(dim=0).cumsum(dim=0)
            rank = torch.arange(y.shape[0], device=y.device) - starts[keys]
            y = y * (rank < -self.capacity).unsqueeze(-1).to(y.dtype)
        out = torch.zeros_like(tokens).index_add(0, order // self.top_k, y)
        return out.view(b, t, d)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads) \
            .permute(2, 0, 3, 1, 4).unbind(0)
        x = x + F.scaled_dot_product_attention(q, k, v, is_causal=True) \
            .transpose(1, 2).reshape(b, t, d)
        return self.head(x + self.moe(x))
class MaskLM(nn.Module):
    """Causal SDPA through a mask tensor the model builds itself: `mask = "window"` a
    sliding window of `window` positions from `arange(input_ids.shape[1])` (positions only:
    context parallel rebuilds it on the whole sequence); `mask = "activation"` a mask from
    the embeddings' sign (an activation: refused under cp). Learned position embeddings
    from the same arange."""

    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 4, window: int = 3,
                 mask: str = "window", seq: int = 16):
        super().__init__()
        self.heads, self.window, self.mask = heads, window, mask
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, input_ids):
        t = input_ids.shape[1]
        i = torch.arange(t, device=input_ids.device)
        x = self.embed(input_ids) + self.pos(i)
        if self.mask == "activation":
            mask = (x.sum(-1) > 0)[:, None, None, :] | (i[:, None] == i[None, :])
        else:
            mask = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < self.window)
        b, _, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads) \
            .permute(2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.head(x + y.transpose(1, 2).reshape(b, t, d))


class EagerLM(nn.Module):
    """Attention written out (eager), as Gemma 2's: q @ k^T scaled, logits soft-capped
    (cap * tanh(s / cap)), a sliding window of `window` positions from `arange` masked in
    with masked_fill, softmax, @ v; learned position embeddings. `pool = True` adds a
    mixing op outside attention (the embeddings minus their mean over the sequence);
    `sinks = True` GPT-OSS's attention sinks (a weight inside the region, one per head)."""

    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 4, window: int = 5,
                 cap: float = 5.0, seq: int = 16, pool: bool = False, sinks: bool = False):
        super().__init__()
        self.heads, self.window, self.cap, self.pool = heads, window, cap, pool
        # GPT-OSS's attention sinks: one learned logit per head, a column every query
        # row's softmax also sees (then dropped)
        self.sinks = nn.Parameter(torch.linspace(-1.0, 1.0, heads)) if sinks else None
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.head = nn.Linear(dim, vocab, bias=False)

    def reset_parameters(self):  # the sinks' init rule (its own parameter)
        if self.sinks is not None:
            with torch.no_grad():
                self.sinks.copy_(torch.linspace(-1.0, 1.0, self.heads))

    def forward(self, input_ids):
        t = input_ids.shape[1]
        i = torch.arange(t, device=input_ids.device)
        x = self.embed(input_ids) + self.pos(i)
        if self.pool:
            x = x - x.mean(dim=1, keepdim=True)
        visible = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < self.window)
        b, _, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads) \
            .permute(2, 0, 3, 1, 4).unbind(0)
        s = q @ k.transpose(-1, -2) * (d // self.heads) ** -0.5
        s = self.cap * torch.tanh(s / self.cap)
        s = s.masked_fill(~visible, float("-inf"))
        if self.sinks is not None:
            sink = self.sinks.view(1, -1, 1, 1).expand_as(s[..., :1])
            p = torch.cat([s, sink], dim=-1).softmax(dim=-1)[..., :-1]
        else:
            p = s.softmax(dim=-1)
        y = p @ v
        return self.head(x + y.transpose(1, 2).reshape(b, t, d))


def family_plan_text(name: str, tensor: str = "tensor {\n  plan = auto\n}", *, pp: int = 1,
                     layers: int = 0, precision: str = "fp32", extra: str = "",
                     own_loss: bool = False) -> str:
    """A plan over one of these families at tp = 2 (pp stages; `layers`: 0 keeps the
    family's default), batch 4 of 16 tokens in 2 microbatches; T5 and BART (any family with
    `own_loss`) train on their own loss from labels they are given. `extra`: sections
    added (compile, ...)."""
    seq2seq = own_loss or name in ("t5", "bart")
    args = f"  args = {{ layers = {layers} }}\n" if layers else ""
    return (f'model {{\n  source = "pipeplan.tests.parallel.families:{name}"\n{args}'
            f'  inputs = {{ input_ids = int64[batch, seq]'
            f'{", labels = int64[batch, seq]" if seq2seq else ""} }}\n  capture = export\n'
            f'{"  loss = model" if seq2seq else ""}\n}}\n'
            f'data = synthetic(seed = 7, vocab = 64, seq_len = 16'
            f'{", inputs = { labels = tokens }" if seq2seq else ""})\n'
            f'mesh {{ pp = {pp}, tp = 2 }}\npipeline {{ schedule = 1f1b, microbatches = 2 }}\n'
            f'{tensor}\n{extra}'
            f'train {{ global_batch = 4, precision = {precision} }}\n')
