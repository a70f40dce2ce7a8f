"""Property: any valid split of the dense GPT chains back to the model's exact loss."""
from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeplan.compiler import compile_plan, load_model, reference_loss
from pipeplan.dsl.ast import SplitSpec

BLOCKS = ["pos_emb", "layers.0", "layers.1", "layers.2", "layers.3", "ln_f", "lm_head"]


@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(points=st.lists(st.sampled_from(BLOCKS), min_size=1, max_size=4, unique=True))
def test_any_split_chains_exactly(make_plan, chain, points):
    points = sorted(points, key=BLOCKS.index)
    plan = make_plan("examples/models/gpt.py:GPT",
                     {"vocab": 32, "dim": 16, "layers": 4, "heads": 2, "seq_len": 8},
                     pp=len(points) + 1, schedule="gpipe", microbatches=1, global_batch=2,
                     seq_len=8, split=SplitSpec(kind="points", points=tuple(points)))
    model = load_model(plan, "cpu")
    compiled = compile_plan(plan, model)
    g = torch.Generator().manual_seed(len(points))
    batch = {"input_ids": torch.randint(0, 32, (2, 8), generator=g),
             "targets": torch.randint(0, 32, (2, 8), generator=g)}
    assert torch.equal(chain(compiled, batch),
                       reference_loss("cross_entropy", model(batch["input_ids"]), batch["targets"]))
    # every parameter is held by some stage, under its own name
    held = {n for s in compiled.stages for n in s.param_names}
    assert held == {n for n, _ in model.named_parameters(remove_duplicate=False)}
