"""Inputs by name: a model whose forward takes `tokens` and `positions` trains pipelined,
its batch fields fed by the data as the plan's data `inputs` says, with the losses of
the unpipelined model fed by hand."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[2]

MODEL = """\
import torch
from pipeplan.examples.models.gpt import GPT


class NamedInputsGPT(GPT):
    \"\"\"GPT whose forward takes the tokens and their positions under its own names.\"\"\"

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(tokens) + self.pos_emb(positions)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.ln_f(x))
"""

PLAN = """\
model {
  source = "named.py:NamedInputsGPT"
  args = { vocab = 32, dim = 16, layers = 2, heads = 2, seq_len = 8 }
  inputs = { tokens = int64[batch, seq], positions = int64[batch, seq] }
  capture = fx
}
data = synthetic(seed = 3, vocab = 32, seq_len = 8, inputs = { positions = positions })
mesh { pp = 2 }
pipeline { schedule = 1f1b  microbatches = 2  split = [layers[0:1], layers[1:2]] }
train { steps = 3  global_batch = 4  optimizer = sgd(lr = 0.1) }
"""


def _hand_fed_losses(plan, steps: int) -> list[float]:
    """The unmodified model, fed tokens = row[:-1] and positions = 0..seq-1 by hand."""
    from pipeplan.backends.runtime import data
    from pipeplan.backends.state.model import build_model

    model = build_model(plan)  # the plan's initial weights (per-module init from the seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        rows = data.global_batch(plan, step)
        tokens, targets = rows.input_ids, rows.targets
        positions = torch.arange(tokens.shape[1]).expand_as(tokens)
        total = 0.0
        for chunk in range(2):  # the two microbatches, each a mean over its tokens
            part = slice(2 * chunk, 2 * chunk + 2)
            logits = model(tokens[part], positions[part])
            loss = F.cross_entropy(logits.flatten(0, 1), targets[part].flatten()) / 2
            loss.backward()
            total += float(loss.detach())
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses


@pytest.mark.slow
def test_a_forward_taking_tokens_and_positions_trains_pipelined(tmp_path):
    from pipeplan.dsl import load_plan

    (tmp_path / "named.py").write_text(MODEL)
    plan_path = tmp_path / "named.plan"
    plan_path.write_text(PLAN)
    plan = load_plan(str(plan_path))
    want = _hand_fed_losses(plan, 3)
    metrics = tmp_path / "m.jsonl"
    r = subprocess.run([sys.executable, "-m", "pipeplan", "run", str(plan_path), "--metrics",
                        str(metrics)], capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    got = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)


def test_the_data_fields_each_input_reads(tmp_path):
    """tokens/positions/mask/targets as the plan binds them, in the declared dtype and shape."""
    from pipeplan.backends.runtime import data
    from pipeplan.dsl import parse_plan

    plan = parse_plan(PLAN.replace(
        "positions = int64[batch, seq] }",
        "positions = int32[batch, seq], keep = float32[batch, 1, seq], labels = int64[batch, seq] }")
        .replace("inputs = { positions = positions }",
                 "inputs = { positions = positions, keep = mask, labels = targets }"),
        str(tmp_path / "p.plan"))
    batch = data.global_batch(plan, 0).rows(1, 3)
    fields = batch.inputs
    assert list(fields) == ["tokens", "positions", "keep", "labels"]
    assert torch.equal(fields["tokens"], batch.input_ids)
    assert fields["positions"].dtype == torch.int32
    assert fields["positions"].tolist() == [list(range(8))] * 2
    assert fields["keep"].shape == (2, 1, 8) and bool((fields["keep"] == 1).all())
    assert torch.equal(fields["labels"], batch.targets)
    assert torch.equal(batch.field("targets"), batch.targets)
