"""Owned-only materialisation: each rank gives storage to exactly its stages' tensors, drawn
from (seed, module path) by the model's own per-module init, equal to the reference's."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from pipeplan.backends.model import build_model, own_stages
from pipeplan.backends.trainer import PipelineTrainer
from pipeplan.compiler import estimates_summary
from pipeplan.compiler.driver import compile_plan
from pipeplan.dsl.ast import DataSpec, MeshSpec, ModelSpec, PipelineSpec, Plan, TrainSpec
from pipeplan.dsl.errors import PlanError

GPT = "pipeplan.examples.models.gpt:GPT"
MOE = "pipeplan.examples.models.moe_gpt:MoEGPT"
LLAMA = str(Path(__file__).parents[1] / "compiler" / "models.py") + ":tiny_llama"


def plan_for(source=GPT, pp=2, dp=1, seed=11, args=None, capture="auto"):
    if args is None:
        args = {"vocab": 64, "dim": 32, "layers": 4, "heads": 4, "seq_len": 16}
    return Plan(model=ModelSpec(source, args=args, capture=capture),
                data=DataSpec(seq_len=16, vocab=64, seed=7), mesh=MeshSpec(pp=pp, dp=dp),
                pipeline=PipelineSpec(schedule="1f1b", microbatches=2 * pp),
                train=TrainSpec(steps=1, global_batch=4 * pp * dp, seed=seed))


def _check_ranks(plan, ref, pp_ranks):
    """Materialise pipeline ranks one after the other on one compiled plan: each gets exactly
    its estimate, the reference's tensors, and leaves the stages of the later ranks meta."""
    compiled = compile_plan(plan)
    params = dict(ref.named_parameters(remove_duplicate=False))
    buffers = dict(ref.named_buffers())
    for pp in pp_ranks:
        nbytes = own_stages(plan, compiled, pp)
        for dp in range(plan.mesh.dp):  # exactly the estimate of each rank at this pp
            assert nbytes == compiled.estimates.ranks[pp * plan.mesh.dp + dp].param_bytes
        held = 0
        for st in compiled.stages:
            for name, p in st.module.named_parameters(remove_duplicate=False):
                if st.rank == pp:
                    assert torch.equal(p, params[name]), name
                    held += 1
                elif st.rank in pp_ranks[pp_ranks.index(pp) + 1:]:
                    assert p.device.type == "meta", name  # never materialised here
            if st.rank == pp:
                for name, b in st.module.named_buffers():
                    assert torch.equal(b, buffers[name]), name
        assert held


@pytest.mark.parametrize("source,pp,dp", [(GPT, 2, 1), (GPT, 4, 1), (GPT, 2, 2), (MOE, 2, 1)])
def test_each_rank_holds_exactly_its_estimate_with_the_reference_weights(source, pp, dp):
    plan = plan_for(source, pp, dp)
    _check_ranks(plan, build_model(plan), list(range(pp)))


def test_hf_llama_rotary_buffers_and_own_init():
    """A transformers Llama: its _init_weights per module, the rotary inv_freq recomputed
    (non-persistent, lost by to_empty) and equal to what transformers computes itself."""
    from transformers import LlamaConfig, LlamaForCausalLM
    plan = plan_for(LLAMA, pp=2, args={"vocab": 64, "dim": 32, "layers": 2})
    ref = build_model(plan)
    _check_ranks(plan, ref, [1, 0])
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    theirs = LlamaForCausalLM(cfg)
    assert torch.equal(ref.model.rotary_emb.inv_freq, theirs.model.rotary_emb.inv_freq)
    assert torch.equal(ref.model.norm.weight, torch.ones(32))  # the norms' rule: ones
    std = float(torch.cat([p.flatten() for n, p in ref.named_parameters() if "proj" in n]).detach().std())
    assert abs(std - cfg.initializer_range) < 0.002  # HF's normal(0, initializer_range)


def test_init_is_a_function_of_seed_and_module_path():
    a, b = build_model(plan_for()), build_model(plan_for())
    c = build_model(plan_for(seed=12))
    for (n, x), y, z in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(x, y), n
        if x.std() > 0:
            assert not torch.equal(x, z), n
    # The tied head is the embedding, drawn once; layers differ from each other.
    assert a.lm_head.weight is a.tok_emb.weight
    assert not torch.equal(a.layers[0].attn.q.weight, a.layers[1].attn.q.weight)


def test_check_refuses_a_module_without_a_per_module_init(tmp_path):
    (tmp_path / "m.py").write_text(
        "import torch\nfrom torch import nn\n"
        "class Scale(nn.Module):\n"
        "    def __init__(self, d):\n        super().__init__()\n"
        "        self.g = nn.Parameter(torch.ones(d))\n"
        "    def forward(self, x):\n        return x * self.g\n"
        "class M(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n"
        "        self.emb = nn.Embedding(64, 8)\n        self.scale = Scale(8)\n"
        "        self.head = nn.Linear(8, 64)\n"
        "    def forward(self, input_ids):\n"
        "        return self.head(self.scale(self.emb(input_ids)))\n")
    plan = plan_for(str(tmp_path / "m.py") + ":M", pp=1, args={})
    plan = dataclasses.replace(plan, pipeline=PipelineSpec(microbatches=1))
    with pytest.raises(PlanError) as e:
        estimates_summary(plan)
    assert "module `scale` (Scale) owns parameters g" in str(e.value)
    assert "reset_parameters" in str(e.value)


def _initial(rank, world, plans):
    out = []
    for plan in plans:
        trainer = PipelineTrainer.for_plan(plan)
        out.append(trainer.named_parameters())
    return out


@pytest.mark.slow
def test_pipelined_ranks_start_from_the_reference_weights(spawn):
    """pp2 and pp4 and pp2 x dp2, through the runtime's own construction (TP/EP: not here)."""
    plans = [plan_for(pp=4), plan_for(pp=2, dp=2)]
    results = spawn(_initial, 4, plans, timeout=240)
    results2 = spawn(_initial, 2, [plan_for(pp=2)], timeout=120)
    for k, plan in enumerate(plans + [plan_for(pp=2)]):
        ranks = [r[k] for r in results] if k < 2 else [r[0] for r in results2]
        ref = dict(build_model(plan).named_parameters(remove_duplicate=False))
        seen = set()
        for held in ranks:
            for name, p in held.items():
                assert torch.equal(p, ref[name]), (k, name)
                seen.add(name)
        assert seen == set(ref)
