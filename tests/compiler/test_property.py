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


@settings(max_examples=200, deadline=None)
@given(costs=st.lists(st.integers(min_value=0, max_value=50), min_size=1, max_size=9),
       parts=st.integers(min_value=1, max_value=4))
def test_auto_partition_is_optimal(costs, parts):
    """The DP's largest group equals brute force's over every contiguous split."""
    from itertools import combinations

    import numpy as np

    from pipeplan.compiler.partition import _min_max_partition
    if parts > len(costs):
        return
    seg = np.array(costs, dtype=np.float64)
    cuts = _min_max_partition(seg, parts)
    assert len(cuts) == parts - 1 and cuts == sorted(set(cuts)) and all(0 < c < len(costs)
                                                                        for c in cuts)

    def largest(cut):
        edges = (0, *cut, len(costs))
        return max(sum(costs[a:b]) for a, b in zip(edges, edges[1:]))

    best = min(largest(c) for c in combinations(range(1, len(costs)), parts - 1))
    assert largest(cuts) == best
