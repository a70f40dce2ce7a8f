"""MoE and the other families under context parallel: locality rules that are exact, not
over-cautious (compiler/parallel/cp_rows.py, cp_rules.py).

A sorted MoE dispatch (argsort of the (token, expert) slots by expert, rows gathered in
sorted order, added back to their tokens) is per token and trains under cp2 ring in
float64 exactly as on whole sequences; the same model with a router that drops slots by
their sorted rank (a capacity cut, over all slots or within each expert) is refused at
`context.method`. Each new rule (the sort region, scatter, view_as_complex, repeated
rows) is shown on a tiny fx graph, with the mixing variant of the op still refused.
"""
from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from torch import nn

from pipeplan.compiler import compile_plan
from pipeplan.compiler.parallel.cp_locality import sequence_locality
from pipeplan.dsl import PlanError, parse_plan

PLAN = """\
model {
  source = "pipeplan.tests.parallel.families:SortedMoELM"
  args = { capacity = CAPACITY }
  inputs = { input_ids = int64[batch, seq] }
  capture = fx
}
data = synthetic(seed = 7, vocab = 64, seq_len = 16)
mesh { pp = 1, cp = 2 }
context { method = ring }
pipeline { schedule = 1f1b, microbatches = 2 }
train { steps = 3, global_batch = 4, grad_clip = 0.5, optimizer = adamw(lr = 0.003), seed = 11, precision = fp64 }
"""


def _sorted_moe_worker(rank, world):
    from .pipelined_vs_reference import assert_trains_like_reference

    plan = parse_plan(PLAN.replace("CAPACITY", "0"), "moe.plan")
    assert_trains_like_reference(plan, "sorted MoE dispatch, cp2 ring", 3)


def test_sorted_moe_dispatch_trains_under_cp_like_the_whole_sequence(run_workers):
    run_workers(_sorted_moe_worker, 2, timeout=300)


@pytest.mark.parametrize("capacity, said", [
    (4, "`mul` (node `mul_2`) combines sorted rows with a tensor laid out along them"),
    (-2, "reduces over the sequence"),
])
def test_routers_that_drop_slots_by_sorted_rank_are_refused(capacity, said):
    with pytest.raises(PlanError) as err:
        compile_plan(parse_plan(PLAN.replace("CAPACITY", str(capacity)), "moe.plan"))
    message = str(err.value)
    assert "moe.plan:9:" in message and said in message, message


# ------------------------------------------------------- the rules on tiny fx graphs
class _Values:
    """What the rules read of a meta run: each node's value (a real run here)."""

    def __init__(self, gm: fx.GraphModule, *args):
        self.values = {}
        values = self.values

        class Keep(fx.Interpreter):
            def run_node(self, n):
                values[n] = super().run_node(n)
                return values[n]

        Keep(gm).run(*args)

    def value(self, node):
        return self.values[node]


def verdict(fn, x: torch.Tensor, seq_dim: int = 1):
    """The first mixing/unknown finding of `fn(x)` with x's dim `seq_dim` the sequence."""
    gm = fx.symbolic_trace(fn)
    run = _Values(gm, x)
    end = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    place = next(n for n in gm.graph.nodes if n.op == "placeholder")
    for node, kind, detail in sequence_locality(gm, run, {place.target: frozenset({seq_dim})},
                                                end):
        if kind in ("mixing", "unknown"):
            return f"{kind}: {detail}"
    return "per-position"


class Fn(nn.Module):
    def __init__(self, body):
        super().__init__()
        self.body = body

    def forward(self, x):
        return self.body(x)


X = torch.randn(2, 6, 8, dtype=torch.float64)


def _dispatch(x, mode: str = "back"):
    """Sort the flattened tokens' slots by expert, permute rows, bring them back."""
    tokens = x.reshape(-1, 8)
    ids = tokens.argmax(dim=-1, keepdim=True).repeat(1, 2) % 3  # [T, 2] expert ids
    keys, order = torch.sort(ids.reshape(-1))
    rows = tokens[order // 2] * 2.0
    if mode == "rank":  # weight each slot by its place in the sorted order
        rows = rows * torch.arange(rows.shape[0], dtype=x.dtype).unsqueeze(-1)
    if mode == "counts":  # weight each slot by its expert's running count of slots
        counts = torch.histc(keys.to(x.dtype), bins=3, min=0, max=2)
        rows = rows * counts.cumsum(0)[keys].unsqueeze(-1)
    if mode == "sorted":  # never put back
        return rows
    if mode == "inverse":
        inv = torch.empty_like(order).index_put((order,), torch.arange(order.shape[0]))
        return rows[inv].view(-1, 2, 8).sum(dim=1).view(x.shape)
    return torch.zeros_like(tokens).index_add(0, order // 2, rows).view(x.shape)


@pytest.mark.parametrize("mode, expected", [
    ("back", "per-position"), ("inverse", "per-position"),
    ("rank", "mixing: combines sorted rows with a tensor laid out along them"),
    ("sorted", "mixing: comes out in the order"),
    ("counts", "mixing: uses the order `sort` sorts the positions in"),
])
def test_sort_is_per_position_only_when_its_order_is_undone(mode, expected):
    assert verdict(Fn(lambda x: _dispatch(x, mode)), X).startswith(expected)


def test_a_sort_along_the_sequence_of_a_2d_tensor_mixes():
    assert verdict(Fn(lambda x: torch.sort(x, dim=1)[0]), X) == \
        "mixing: sorts along the sequence"
    assert verdict(Fn(lambda x: torch.sort(x, dim=-1)[0]), X) == "per-position"


def test_scatter_along_features_is_per_position_along_the_sequence_mixes():
    def mask(dim):
        return Fn(lambda x: torch.zeros_like(x).scatter(
            dim, x.argmax(dim=dim, keepdim=True), 1.0) * x)

    assert verdict(mask(-1), X) == "per-position"  # a router's mask over experts
    assert verdict(mask(1), X).startswith("mixing: ")  # one row per feature picked


def test_complex_rope_is_per_position_pairing_positions_mixes():
    def rope(x):
        z = torch.view_as_complex(x.reshape(2, 6, 4, 2))
        return torch.view_as_real(z * torch.polar(torch.ones(4, dtype=x.dtype),
                                                  torch.arange(4.0, dtype=x.dtype)))

    assert verdict(Fn(rope), X) == "per-position"
    pairs = Fn(lambda x: torch.view_as_real(torch.view_as_complex(x) * 2))
    x = torch.randn(2, 8, 2, dtype=torch.float64)
    assert verdict(pairs, x, seq_dim=1) == "per-position"
    assert verdict(pairs, x, seq_dim=2).startswith(  # the sequence as the real/imag pair
        "mixing: pairs up neighbouring positions of the sequence")


def test_repeated_token_rows_summed_per_token_pass_summed_across_tokens_mix():
    def per_token(x):  # transformers' batched_mm: each token's row once per chosen expert
        rows = x.reshape(-1, 8).repeat_interleave(2, dim=0)
        return rows.view(-1, 2, 8).sum(dim=1).view(x.shape)

    def across(x):  # the same rows viewed [k, tokens] and summed over the tokens
        rows = x.reshape(-1, 8).repeat_interleave(2, dim=0)
        return rows.view(2, -1, 8).sum(dim=1)

    assert verdict(Fn(per_token), X) == "per-position"
    assert verdict(Fn(across), X).startswith("mixing: reduces over the sequence")
