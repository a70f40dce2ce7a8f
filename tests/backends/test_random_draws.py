"""A model that draws random numbers (dropout) trains as the single-process run does, under
any layout: each stage's forward of a microbatch draws from the generator seeded by (seed,
step, chunk, k), k the random ops of the stages before it (backends/runtime/draws.py); the
reference reseeds where those stages begin.

Before the keyed draws every rank drew from its own generator in its schedule's order, and
`pipeplan verify` said DIFFERENT for every model with active dropout (transformers' OPT at
its default dropout 0.1, pp2 1F1B: loss 3.2e-3 off at step 1), with `check` accepting it.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from pipeplan.dsl import PlanError, parse_plan

BASE = """\
model {
  source = "pipeplan.tests.parallel.tp_models:MegatronGPT"
  args = { layers = 2 }
  inputs = { input_ids = int64[batch, seq] }
}
data = synthetic(seed = 7, vocab = 64, seq_len = 16)
pipeline { schedule = 1f1b, microbatches = 2 }
train { steps = 2, global_batch = 4, grad_clip = 0.5, optimizer = adamw(lr = 0.003, weight_decay = 0.1), seed = 11 }
"""
PLAN = BASE + """\
mesh { pp = 2, tp = 2 }
tensor {
  column = ["layers.*.q", "layers.*.k", "layers.*.v", "layers.*.up"]
  row = ["layers.*.proj", "layers.*.down"]
  sequence_parallel = true
}
recompute { layers.1 = full }
"""


def _plan(text: str = PLAN, **over):
    return parse_plan(text, "dropout.plan", [f"{k}={v}" for k, v in over.items()])


def test_chained_stages_draw_what_the_whole_model_draws():
    """Stage 0 then stage 1, each with its microbatch's generator seeded at its offset, give
    the single-process forward's loss (reseeded where each stage begins), exactly; another
    chunk draws other masks."""
    from pipeplan.backends.runtime import draws
    from pipeplan.backends.state.model import model_loss
    from pipeplan.compiler import compile_plan
    from pipeplan.tests.parallel.tp_models import MegatronGPT

    plan = _plan(BASE + "mesh { pp = 2 }\n", **{"train.precision": "fp64"})
    torch.manual_seed(0)
    model = MegatronGPT(layers=2).double().train()
    compiled = compile_plan(plan, model=model)
    offsets = draws.draw_offsets(compiled.plan, compiled.stages)
    assert offsets[0] == 0 and offsets[1] == 3  # three dropouts a layer, one layer a stage
    ids, targets = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    values = {"input_ids": ids, "targets": targets}
    cpu = torch.device("cpu")

    def chained(chunk):
        for st, off in zip(compiled.stages, offsets):
            st.module.train()
            with draws.microbatch(off, 11, 5, chunk, cpu):
                out = st.module(*[values[r.name] for r in st.inputs])
            out = out if isinstance(out, (tuple, list)) else (out,)
            values.update({v.name: x for v, x in zip(st.outputs, out)})
        return out[0]

    before = torch.get_rng_state()
    got = chained(3)
    assert torch.equal(torch.get_rng_state(), before)  # the stages' draws are put back
    with torch.random.fork_rng(devices=[]), draws.ReferenceDraws((11, 5, 3), frozenset({0, 3})):
        whole = model_loss(plan, model(ids), targets)
    assert torch.equal(got, whole)
    assert not torch.equal(chained(4), whole)  # the draws happen, and follow the chunk
    starts = draws.reference_starts(plan, model, lambda: model(ids))
    assert starts == frozenset({0, 3})


def test_check_refuses_random_draws_that_cannot_be_the_references():
    from pipeplan.compiler import compile_plan

    with pytest.raises(PlanError) as e:
        compile_plan(_plan(BASE + "mesh { pp = 2 }\ncompile { mode = inductor }\n"))
    text = str(e.value)
    assert "dropout.plan:10:18:" in text and "mode = inductor" in text, text
    assert "draws random numbers" in text
    # dropout with p = 0 draws nothing (torch returns its input): accepted
    compile_plan(_plan(BASE.replace("layers = 2", "layers = 2, p = 0.0")
                       + "mesh { pp = 2 }\ncompile { mode = inductor }\n"))
    with pytest.raises(PlanError) as e:  # tp's compiled graphs draw on each rank's part
        compile_plan(_plan(PLAN + "compile { mode = graphs }\n"))
    assert "dropout.plan:16:18:" in str(e.value) and "each rank's part" in str(e.value)


class SdpaDropoutLM(torch.nn.Module):
    """GPT-2's order of draws: dropout on the embeddings, then attention with dropout_p."""

    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.embed = torch.nn.Embedding(vocab, dim)
        self.q, self.k, self.v, self.proj = (torch.nn.Linear(dim, dim) for _ in range(4))
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, input_ids):
        x = torch.nn.functional.dropout(self.embed(input_ids), 0.1, self.training)
        b, s, d = x.shape
        q, k, v = (f(x).view(b, s, self.heads, -1).transpose(1, 2) for f in (self.q, self.k,
                                                                             self.v))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.1,
                                                             is_causal=True)
        return self.head(x + self.proj(y.transpose(1, 2).reshape(b, s, d)))


def test_attention_dropout_under_tp_is_refused_after_an_earlier_draw():
    """The attention check read the first random op only, so an embedding dropout before
    it (GPT-2) let tp2 through: verify said DIFFERENT (loss 9e-4 off at step 1)."""
    from pipeplan.compiler import compile_plan

    text = BASE.replace("tp_models:MegatronGPT", "test_random_draws:SdpaDropoutLM").replace(
        "pipeplan.tests.parallel", "pipeplan.tests.backends").replace(
        "  args = { layers = 2 }\n", "") + """\
mesh { tp = 2 }
tensor {
  column = ["q", "k", "v"]
  row = ["proj"]
}
"""
    with pytest.raises(PlanError) as e:
        compile_plan(_plan(text))
    assert "dropout.plan:8:13:" in str(e.value) and "dropout_p > 0" in str(e.value), str(e.value)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_dropout_model_pp2_tp2_sp_recompute_verifies_equal():
    """pp2 x tp2 with sequence parallel and a full recompute of one layer, every layer with
    three dropouts (one on head-split attention probabilities): EQUAL in float64."""
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "dropout.plan")
        with open(path, "w") as f:
            f.write(PLAN)
        run = subprocess.run([sys.executable, "-m", "pipeplan", "verify", path, "--steps", "2"],
                             capture_output=True, text=True, timeout=880)
    said = run.stdout + run.stderr
    assert run.returncode == 0 and "EQUAL to single-process training" in said, said[-3000:]
