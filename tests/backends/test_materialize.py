"""Owned-only materialisation: each rank gives storage to exactly its stages' tensors, drawn
from (seed, module path) by the model's own per-module init, equal to the reference's."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from pipeplan.backends.state.model import build_model, own_stages
from pipeplan.backends.state.materialize import param_bytes
from pipeplan.backends.runtime.trainer import PipelineTrainer
from pipeplan.compiler import estimates_summary
from pipeplan.compiler.driver import compile_plan
from pipeplan.dsl.ast import (DataSpec, ExpertsSpec, MeshSpec, ModelSpec, PipelineSpec, Plan, TensorSpec, TrainSpec)
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


def _user_module(tmp_path, name: str, source: str):
    """`source` written to tmp_path/<name>.py and imported as its user would (no pipeplan
    code): the plan names that file."""
    import importlib.util

    (tmp_path / f"{name}.py").write_text(source)
    spec = importlib.util.spec_from_file_location(f"{name}_user", tmp_path / f"{name}.py")
    user = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(user)
    return user


def _as_built(cls, **args):
    """`cls(**args)` under a fixed seed, the caller's random state untouched: the user's own
    construction, the same whichever tests ran before (the std comparisons below are
    statistical: 128 elements at std 5 moved 15% in one run in a few dozen)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return cls(**args)


def _like_the_constructor(ref, own, least: int = 0) -> None:
    """The reference model's initial weights against the user's own construction `own`:
    constants equal; every drawn parameter of `least` elements or more at a std within 10%."""
    for name, p in own.named_parameters():
        got, p = ref.get_parameter(name).detach(), p.detach()
        if p.std() == 0:
            assert torch.equal(got, p), name  # LayerNorm's ones, zeros; the zero biases
        elif p.numel() >= least:
            assert float(got.std() / p.std()) == pytest.approx(1.0, abs=0.1), name


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


DRAWN = """\
import numpy as np
import torch
from torch import nn


class Drawn(nn.Module):
    \"\"\"Parameters its constructor draws with factories that ignore the meta device
    (`torch.normal(mean, std, size=...)`, as DiffLlama's lambdas; `torch.from_numpy`), and
    an init rule that draws them again (as transformers' `_init_weights` does).\"\"\"

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 8)
        self.gate = nn.Parameter(torch.normal(0.0, 0.1, size=(8,)))
        self.shift = nn.Parameter(torch.from_numpy(np.full(8, 0.5, dtype=np.float32)))
        self.head = nn.Linear(8, 64)

    def _init_weights(self, module):
        if module is self:
            nn.init.normal_(self.gate, 0.0, 0.1)
            nn.init.uniform_(self.shift)

    def forward(self, input_ids):
        return self.head(self.emb(input_ids) * self.gate + self.shift)
"""


def test_parameters_a_constructor_makes_off_meta_are_drawn_by_the_init_rule(tmp_path):
    """The compiler's model is built on meta, but some factories make CPU tensors there;
    such a parameter was kept with the constructor's draw in the stages a rank compiles,
    while the reference drew it by the init rule (DiffLlama at pp2: verify DIFFERENT, its
    lambdas 0.2-0.3 off from the start). Every parameter of the meta model is meta, and
    the rank's tensors are the reference's."""
    from pipeplan.compiler.capture.loading import load_model

    (tmp_path / "drawn.py").write_text(DRAWN)
    plan = plan_for(str(tmp_path / "drawn.py") + ":Drawn", pp=1, args={})
    plan = dataclasses.replace(plan, pipeline=PipelineSpec(microbatches=1))
    assert {p.device.type for p in load_model(plan, "meta").parameters()} == {"meta"}
    _check_ranks(plan, build_model(plan), [0])


AROUND = """
import torch
from torch import nn
from torch.nn import init


class Router(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(4, 8))

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.router, self.lin = Router(), nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x) + self.router(x).sum(-1, keepdim=True)


class Around(nn.Module):
    \"\"\"Qwen3-Next's pattern: the router's weight is drawn by the rule applied to the block
    around it (no rule of its own); that call also writes the block's Linear.\"\"\"

    def __init__(self):
        super().__init__()
        self.emb, self.block, self.head = nn.Embedding(64, 8), Block(), nn.Linear(8, 64)

    def _init_weights(self, module):
        if isinstance(module, Block):
            init.constant_(module.router.weight, 3.0)
            init.constant_(module.lin.weight, 7.0)

    def forward(self, input_ids):
        return self.head(self.block(self.emb(input_ids)))
"""


def test_a_parameter_drawn_by_the_rule_of_a_module_around_it_is_drawn_so(tmp_path):
    """A parameter its own module's rule leaves unwritten is drawn by the rule applied to
    the modules around it (Qwen3-Next's router, drawn by `_init_weights(sparse_moe_block)`;
    check refused the model before), writing nothing else: the Linear beside it keeps its
    own rule's draw. The rank's tensors are the reference's."""
    (tmp_path / "around.py").write_text(AROUND)
    plan = plan_for(str(tmp_path / "around.py") + ":Around", pp=1, args={})
    plan = dataclasses.replace(plan, pipeline=PipelineSpec(microbatches=1))
    estimates_summary(plan)  # check: every parameter covered
    ref = build_model(plan)
    assert torch.equal(ref.block.router.weight, torch.full((4, 8), 3.0))
    assert not torch.equal(ref.block.lin.weight, torch.full((8, 8), 7.0))
    _check_ranks(plan, ref, [0])

SCALED = """\
import numpy as np
import torch
from torch import nn


class Scale(nn.Module):
    \"\"\"No rule of its own, none around it: its parameters keep what the constructor made.\"\"\"

    def __init__(self, d, make):
        super().__init__()
        self.g = nn.Parameter(eval(make))  # the test's expressions, in the constructor
        # xIELU's (Apertus): a constant computed from a constant
        self.alpha = nn.Parameter(torch.log(torch.expm1(torch.tensor(0.8))).unsqueeze(0))

    def forward(self, x):
        return x * self.g + self.alpha


class M(nn.Module):
    def __init__(self, make="torch.ones(d)"):
        super().__init__()
        self.emb = nn.Embedding(64, 8)
        self.scale = Scale(8, make)
        self.head = nn.Linear(8, 64)

    def forward(self, input_ids):
        return self.head(self.scale(self.emb(input_ids)))
"""


def _scaled(tmp_path, make):
    (tmp_path / "m.py").write_text(SCALED)
    plan = plan_for(str(tmp_path / "m.py") + ":M", pp=2, args={"make": make})
    return dataclasses.replace(plan, pipeline=PipelineSpec(microbatches=2))


@pytest.mark.parametrize("make", ["torch.ones(d)", "torch.full((d,), 0.5) * 2 + torch.arange(d)",
                                  "torch.empty(d).fill_(0.25)"])
def test_a_parameter_no_rule_writes_keeps_its_constructors_constant(tmp_path, make):
    """nanoGPT's LayerNorm (`nn.Parameter(torch.ones(n))`, no rule) and Apertus's xIELU
    (`log(expm1(tensor(0.8)))`) were refused at check: their constructors make constants of
    the code, which the ranks and the reference now keep. Compared with the user's own
    constructor run on CPU (no pipeplan code): the same values; the ranks' tensors are the
    reference's."""
    import importlib.util

    plan = _scaled(tmp_path, make)
    estimates_summary(plan)  # check: accepted
    spec = importlib.util.spec_from_file_location("m_user", tmp_path / "m.py")
    user = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(user)
    own = user.M(make)
    ref = build_model(plan)
    for name in ("scale.g", "scale.alpha"):
        assert torch.equal(ref.get_parameter(name), own.get_parameter(name)), name
    _check_ranks(plan, ref, [0, 1])


def test_apertus_xielu_keeps_the_constants_transformers_gives_it():
    """Apertus was refused at check (its xIELU's alpha_p, alpha_n: no rule sets them); its
    skeleton now keeps the constructor's values, the ones transformers' own CPU construction
    gives them, and every other parameter is drawn by the rule as before."""
    from pipeplan.compiler.capture.constructor import constructor_constants
    from pipeplan.compiler.capture.loading import load_skeleton
    from pipeplan.tests.parallel import families

    plan = plan_for("pipeplan.tests.parallel.families:apertus", pp=2, args={},
                    capture="export")
    estimates_summary(plan)  # check: accepted
    ref, own = build_model(plan), families.apertus()
    kept = constructor_constants(load_skeleton(plan))
    assert kept and {n.rpartition(".")[2] for n in kept} == {"alpha_p", "alpha_n"}
    for name in kept:
        assert torch.equal(ref.get_parameter(name), own.get_parameter(name)), name
    _check_ranks(plan, ref, [0, 1])


NANOGPT = """\
import math
import torch
from torch import nn
from torch.nn import functional as F


class LayerNorm(nn.Module):  # nanoGPT's: ones and zeros, no rule
    def __init__(self, ndim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim))

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln = LayerNorm(d)
        self.c_fc, self.c_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.c_proj(F.gelu(self.c_fc(self.ln(x))))


class GPT(nn.Module):
    \"\"\"nanoGPT's init: `apply(_init_weights)` draws every Linear and Embedding at std 0.02,
    then the constructor draws each c_proj.weight again at 0.02 / sqrt(2 x layers).\"\"\"

    def __init__(self, layers=2, d=64):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(64, d), nn.Embedding(16, d)
        self.h = nn.ModuleList([Block(d) for _ in range(layers)])
        self.ln_f, self.lm_head = LayerNorm(d), nn.Linear(d, 64, bias=False)
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():
            if pn.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * layers))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, input_ids):
        x = self.wte(input_ids) + self.wpe(torch.arange(input_ids.shape[1]))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))
"""


def test_nanogpt_starts_from_its_constructors_distribution(tmp_path):
    """nanoGPT was refused at check (its LayerNorm has no rule), and its constructor's second
    draw of each c_proj.weight (std 0.02 / sqrt(2 x layers), after `apply(_init_weights)`)
    was lost: the rule alone drew it at 0.02. The writes the constructor makes after the
    rule's are now replayed after it. Against the user's own constructor on CPU: every
    parameter's std within 10% (4k-16k samples each), the constants equal; the ranks'
    tensors are the reference's."""
    plan = plan_for(str(tmp_path / "nanogpt.py") + ":GPT", pp=2, args={})
    user = _user_module(tmp_path, "nanogpt", NANOGPT)
    estimates_summary(plan)  # check: accepted
    ref, own = build_model(plan), _as_built(user.GPT)
    _like_the_constructor(ref, own)
    assert float(ref.h[0].c_proj.weight.detach().std()) == pytest.approx(0.01, rel=0.1)  # not 0.02
    _check_ranks(plan, ref, [0, 1])


PARTS = """\
import torch
from torch import nn


class M(nn.Module):
    def __init__(self, vocab=64, dim=64, attention=False):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mid = nn.MultiheadAttention(dim, 4, batch_first=True) if attention else \\
            nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab)
        if not attention:
            with torch.no_grad():
                self.head.weight[0].zero_()  # one row, after Linear's own init
                self.mid.weight[:, :2].normal_(0, 5.0)  # two columns drawn again

    def forward(self, input_ids):
        x = self.embed(input_ids)
        if isinstance(self.mid, nn.MultiheadAttention):
            t = x.shape[1]
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
            return self.head(x + self.mid(x, x, x, attn_mask=mask, need_weights=False)[0])
        return self.head(torch.tanh(self.mid(x)))
"""


def _parts(tmp_path, attention: bool):
    """PARTS' model at pp2 and, separately, as its user builds it (no pipeplan code)."""
    user = _user_module(tmp_path, "parts", PARTS)
    plan = plan_for(str(tmp_path / "parts.py") + ":M", pp=2, args={"attention": attention},
                    capture="export")
    return plan, _as_built(user.M, attention=attention)


def test_a_constructor_write_into_part_of_a_parameter_is_replayed_on_that_part(tmp_path):
    """The constructor zeroes one row of the head and draws two columns of `mid` again after
    their rule (Linear's init) ran: replayed after the rule, each write was applied to the
    whole parameter -- the head started all zeros, every column of `mid` at std 5: another
    model than the user's, and verify, whose reference starts from the same draws, EQUAL.
    Now each lands on the part it wrote. Against the user's own constructor: one zero row,
    the columns' stds within 15%; the ranks' tensors are the reference's."""
    plan, own = _parts(tmp_path, attention=False)
    estimates_summary(plan)
    ref = build_model(plan)
    head = ref.head.weight.detach()
    assert torch.equal(head[0], torch.zeros(64)) and bool((head[1:] != 0).all())
    mid, user = ref.mid.weight.detach(), own.mid.weight.detach()
    for cols in (slice(0, 2), slice(2, None)):
        assert float(mid[:, cols].std() / user[:, cols].std()) == pytest.approx(1.0, abs=0.15)
    _check_ranks(plan, ref, [0, 1])


def test_multihead_attention_starts_from_its_constructors_distribution(tmp_path):
    """torch's MultiheadAttention draws `in_proj_weight` (xavier) and zeroes its biases in a
    private `_reset_parameters()` no per-module rule calls: check refused every model using
    it. Its constructor's writes draw those parameters whole from nothing, so they are
    replayed on each parameter (constructor.draws_whole). Against the user's constructor:
    the stds within 10% (4k-12k elements each), the attention's biases zero; the ranks' tensors are the reference's."""
    plan, own = _parts(tmp_path, attention=True)
    estimates_summary(plan)  # accepted
    ref = build_model(plan)
    _like_the_constructor(ref, own, least=4096)
    bias = ref.head.bias.detach()  # the head's 64 biases: uniform within Linear's bound
    assert float(bias.abs().max()) <= 64 ** -0.5 and float(bias.std()) > 0
    _check_ranks(plan, ref, [0, 1])


COPIES = """\
import copy
import torch
from torch import nn


class M(nn.Module):
    def __init__(self, vocab=64, dim=64, how="deepcopy"):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        if how == "encoder":
            self.layers = nn.TransformerEncoder(nn.TransformerEncoderLayer(
                dim, 2, 128, dropout=0.0, batch_first=True), 2, enable_nested_tensor=False)
        else:
            block = nn.Sequential(nn.Linear(dim, dim), nn.LayerNorm(dim))
            layers = [block] + [copy.deepcopy(block) for _ in range(2)]
            if how == "drawn again":
                for layer in layers[1:]:
                    layer[0].reset_parameters()
            elif how == "weight drawn again":
                layers[2][0].weight.data.normal_(0.0, 0.02)
            self.layers = nn.Sequential(*layers)
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids):
        return self.head(self.layers(self.embed(input_ids)))
"""


def _copies(tmp_path, how):
    user = _user_module(tmp_path, "copies", COPIES)
    plan = plan_for(str(tmp_path / "copies.py") + ":M", pp=2, args={"how": how},
                    capture="export")
    return plan, _as_built(user.M, how=how)


@pytest.mark.parametrize("how, first, copy", [
    ("deepcopy", "layers.0.", "layers.1."), ("deepcopy", "layers.0.", "layers.2."),
    ("encoder", "layers.layers.0.", "layers.layers.1."), ("drawn again", "layers.0.", None)])
def test_deep_copies_start_equal_as_the_constructor_made_them(tmp_path, how, first, copy):
    """`copy.deepcopy` of a drawn block makes layers that start equal in the user's model
    (nn.TransformerEncoder clones the layer it is given); each module was drawn on its own,
    so the copied Linear blocks started independent after check passed, and the encoder was
    refused. A module whose drawn parameters are all copies now takes its source's draw (its
    seed, its rule, the source's write history): against the user's own constructor, the
    copies equal their source exactly as the user's do, every std within 10%; the ranks'
    tensors are the reference's (each pipeline rank draws its layers alone). Copies the
    constructor draws again stay independent."""
    plan, own = _copies(tmp_path, how)
    estimates_summary(plan)  # accepted
    ref = build_model(plan)
    _like_the_constructor(ref, own, least=4096)
    for name, p in own.named_parameters():
        if copy is not None and name.startswith(copy):  # equal to its source, as the user's
            source = first + name[len(copy):]
            assert torch.equal(own.get_parameter(source), p), name
            assert torch.equal(ref.get_parameter(source), ref.get_parameter(name)), name
    if copy is None:  # drawn again: independent, as the user's
        assert not torch.equal(ref.layers[0][0].weight, ref.layers[1][0].weight)
    _check_ranks(plan, ref, [0, 1])


def test_a_copy_beside_a_parameter_drawn_on_its_own_is_refused(tmp_path):
    """The third block's weight is drawn again after the copy, its bias is still the first
    block's: no one draw gives both (the module's draw under its source's seed would copy
    the weight too). Refused at check naming the bias."""
    plan, _ = _copies(tmp_path, "weight drawn again")
    with pytest.raises(PlanError) as e:
        estimates_summary(plan)
    assert "made 1 parameters (layers.2.0.bias) as copies of drawn ones (layers.0.0.bias" \
        in str(e.value), str(e.value)


@pytest.mark.parametrize("make, why", [
    ("torch.randn(d)", "drawn"), ("torch.empty(d)", "uninitialised"),
    ("torch.ones(d) + torch.rand(1)", "drawn"),
    ("torch.from_numpy(np.random.default_rng().random(d))", "numpy's generator")])
def test_check_refuses_a_parameter_no_rule_writes_whose_value_is_not_a_constant(
        tmp_path, make, why):
    """A parameter no rule writes, its constructor's value drawn ({why}): refused by name at
    check, before any process starts."""
    with pytest.raises(PlanError) as e:
        estimates_summary(_scaled(tmp_path, make))
    assert "module `scale` (Scale) owns parameters g, alpha" in str(e.value)
    assert "does not set g" not in str(e.value)  # no rule at all, said so
    assert "reset_parameters" in str(e.value) and "drawn, uninitialised" in str(e.value)


def _tp_plan():
    """pp2 x tp2: column/row pairs and the vocab-parallel embedding (tied to the head)."""
    plan = plan_for(pp=2)
    return dataclasses.replace(
        plan, mesh=MeshSpec(pp=2, tp=2),
        tensor=TensorSpec(column=("layers.*.attn.q", "layers.*.attn.k", "layers.*.attn.v",
                                  "layers.*.mlp.up"),
                          row=("layers.*.attn.proj", "layers.*.mlp.down")))


def _ep_plan():
    """pp2 x dp2 x ep2: each dp rank of a stage holds half of every MoE layer's experts."""
    plan = plan_for(MOE, pp=2, dp=2, args={"vocab": 64, "dim": 32, "layers": 2, "heads": 4,
                                            "seq_len": 16, "num_experts": 4, "top_k": 2})
    return dataclasses.replace(
        plan, mesh=MeshSpec(pp=2, dp=2, ep=2),
        experts=ExpertsSpec(modules=("layers.*.moe",), num_experts=4, top_k=2))


def _zero3_plan():
    """pp2 x dp2 under ZeRO-3: each rank holds its flat shard of its stages, never more."""
    return dataclasses.replace(plan_for(pp=2, dp=2), zero=3)


def _zero3_tp_plan():
    """dp2 x tp2 under ZeRO-3: each rank's flat shard of its TP slices."""
    plan = _tp_plan()
    return dataclasses.replace(plan, mesh=MeshSpec(pp=1, dp=2, tp=2), zero=3,
                               pipeline=PipelineSpec(schedule="1f1b", microbatches=2))


SHARDED = {"tp": _tp_plan, "ep": _ep_plan, "z3": _zero3_plan, "z3tp": _zero3_tp_plan}


def _initial(rank, world, names):
    """Each rank's trainer as `pipeplan run` builds it: its materialised bytes, its own
    (sharded) tensors by shape, and its parameters gathered to full shape."""
    out = []
    for name in names:
        plan = SHARDED[name]() if name in SHARDED else plan_for(pp=int(name[2]), dp=world // int(name[2]))
        trainer = PipelineTrainer.for_plan(plan)
        local = {n: tuple(p.shape) for n, p in trainer.parameters_by_name().items()}
        resident = param_bytes(trainer.runners[s].module for s in trainer.runners)
        out.append((trainer.param_bytes, local, trainer.named_parameters(), resident))
    return out


@pytest.mark.slow
def test_pipelined_ranks_start_from_the_reference_weights_holding_only_their_shards(spawn):
    """pp4, pp2 x dp2, pp2 x tp2, pp2 x dp2 x ep2, pp2 x dp2 ZeRO-3 and dp2 x tp2 ZeRO-3
    through the runtime's own construction: every rank materialises exactly the compiler's
    estimate of its parameter bytes (TP slices, EP experts, ZeRO-3 flat shards only, never
    the full stage), and its tensors, gathered back to full shape (over TP, EP and the
    ZeRO-3 shards), equal the single-process reference's initial weights."""
    names = ["pp4", "pp2", "tp", "ep", "z3", "z3tp"]
    results = spawn(_initial, 4, names, timeout=280)
    for k, name in enumerate(names):
        plan = SHARDED[name]() if name in SHARDED else plan_for(pp=int(name[2]), dp=4 // int(name[2]))
        compiled = compile_plan(plan)
        ref = dict(build_model(plan).named_parameters(remove_duplicate=False))
        seen, sharded = set(), 0
        for rank, (nbytes, local, full, resident) in enumerate(r[k] for r in results):
            assert nbytes == compiled.estimates.ranks[rank].param_bytes, (name, rank)
            if plan.zero == 3:  # outside gather, no parameter of the stages has storage
                assert resident == 0, (name, rank, resident)
            for n, p in full.items():
                assert torch.equal(p, ref[n]), (name, rank, n)
                seen.add(n)
                sharded += local[n] != tuple(ref[n].shape)
        assert seen == set(ref), name
        assert bool(sharded) == (name in ("tp", "ep", "z3tp")), name  # TP/EP: slices only


def test_initial_values_hold_one_module_at_a_time():
    """Drawing a whole model's values module by module never holds more than the module
    being initialised (and the tied embedding until its last holder, the head, ran), and
    gives every module's storage back: the skeleton ends all-meta."""
    from pipeplan.backends.state.materialize import initial_values
    from pipeplan.compiler.capture.loading import load_skeleton

    plan = plan_for(args={"vocab": 64, "dim": 32, "layers": 4, "heads": 4, "seq_len": 16})
    skeleton = load_skeleton(plan)
    ref = dict(build_model(plan).named_parameters(remove_duplicate=False))
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in skeleton.modules())
    tied = skeleton.tok_emb.weight.numel()
    total = sum(p.numel() for p in skeleton.parameters())
    peak, got = 0, {}
    for names, value in initial_values(skeleton, plan.train.seed, list(ref)):
        held = sum(p.numel() for p in skeleton.parameters() if p.device.type != "meta")
        peak = max(peak, held)
        got.update((n, value) for n in names)
    assert peak <= largest + tied < total / 2
    assert all(p.device.type == "meta" for p in skeleton.parameters())
    assert set(got) == set(ref) and all(torch.equal(got[n], ref[n]) for n in ref)


def test_a_parameter_swapped_by_the_constructor_inherits_no_other_record():
    """MoEGPT(...).double() swaps every parameter's storage at the end of its constructor; a
    record keyed by a storage the swap freed passed to whichever parameter's new storage took
    its address (pp2 dp2 ep2 verify of the SiLU MoE example: DIFFERENT, one run in two, an
    extra draw replayed on `pos_emb`). The records hold their storages: a swapped parameter
    has none, in every build."""
    from pipeplan.compiler.capture.constructor import constructor_constants, constructor_writes
    from pipeplan.compiler.capture.loading import load_skeleton

    plan = plan_for("pipeplan.tests.parallel.moe_models:silu_moe_gpt", pp=2, args={})
    for _ in range(8):
        skeleton = load_skeleton(plan)
        assert constructor_writes(skeleton) == {} and constructor_constants(skeleton) == {}


READS = """\
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, dim, rate, scale):
        super().__init__()
        self.fc, self.rate = nn.Linear(dim, dim), rate
        self.register_buffer("scale", torch.full((dim,), scale))

    def forward(self, x):
        return x + torch.tanh(self.fc(x)) * self.scale * (1.0 - self.rate)


class M(nn.Module):
    def __init__(self, vocab=64, dim=64, layers=4, parameter=False):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        rates = torch.linspace(0, 0.1, layers).tolist()  # stochastic depth's idiom (timm)
        scale = torch.tensor(float(dim)).rsqrt().item()
        self.layers = nn.Sequential(*(Block(dim, r, scale) for r in rates))
        self.head = nn.Linear(dim, vocab)
        if parameter:  # a value of a parameter: none has one before pipeplan draws it
            self.first = self.head.weight.abs().max().item()

    def forward(self, input_ids):
        return self.head(self.layers(self.embed(input_ids)))
"""


def test_a_constructor_reading_values_it_computed_is_built_as_the_user_builds_it(tmp_path):
    """`torch.linspace(0, rate, depth).tolist()` and `.item()` in a constructor: no meta
    tensor has a value, so check failed at the model's args ("Tensor.item() cannot be
    called on meta tensors", hint: check the constructor arguments) on a model that builds
    and trains on CPU. Built again with only its parameters on meta (as the runtime builds
    it): check passes, the compiled model holds the user's rates and the stages meta
    tensors; the reference starts as the user's constructor, and the ranks from it."""
    from pipeplan.compiler import load_model
    user = _user_module(tmp_path, "reads", READS)
    plan = plan_for(str(tmp_path / "reads.py") + ":M", pp=2,
                    args={"vocab": 64, "dim": 64, "layers": 4})
    estimates_summary(plan)  # accepted
    own = _as_built(user.M)
    meta = load_model(plan, "meta")
    assert [b.rate for b in meta.layers] == [b.rate for b in own.layers]
    assert all(t.is_meta for t in (*meta.parameters(), *meta.buffers()))
    ref = build_model(plan)
    _like_the_constructor(ref, own, least=4096)
    for name, b in own.named_buffers():
        assert torch.equal(ref.get_buffer(name), b), name
    _check_ranks(plan, ref, [0, 1])


def test_a_constructor_reading_a_parameters_value_is_refused_saying_so(tmp_path):
    """The same model reading a value of its own parameter while it is built: no build
    without drawing every parameter gives one. Refused at the model's args, the hint saying
    that (it said: check the constructor arguments against the model's __init__)."""
    _user_module(tmp_path, "reads", READS)
    plan = plan_for(str(tmp_path / "reads.py") + ":M", pp=2,
                    args={"vocab": 64, "dim": 64, "layers": 4, "parameter": True})
    with pytest.raises(PlanError) as e:
        estimates_summary(plan)
    (d,) = e.value.diagnostics
    assert "cannot be called on meta tensors" in d.message, d.message
    assert d.hint.startswith("the constructor reads the value of one of its parameters"), d.hint
