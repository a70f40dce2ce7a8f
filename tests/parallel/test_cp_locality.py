"""Sequence locality before context parallel: an op that mixes positions outside attention
is refused at the plan's `context.method` line, naming the op and its module, never run
split (compiler/parallel/cp_locality.py).

Jamba's Mamba layer (a causal conv1d and a selective scan over the sequence) with cp2: the
whole-sequence model and the split one compute different functions, so the plan is
refused at its conv1d. The same for a hand-written causal convolution (fx and export
captures), a cumulative sum, pooling and a shift over the sequence; the same models with a
kernel-1 convolution or a cumulative sum over the features pass the check (their ops are
per-position), and the kernel-1 one trains under cp2 ring exactly as on whole sequences.
"""
from __future__ import annotations

import pytest

from pipeplan.compiler import compile_plan
from pipeplan.dsl import PlanError, parse_plan

PLAN = """\
model {
  source = "pipeplan.tests.parallel.families:MODEL"
  args = ARGS
  inputs = { input_ids = int64[batch, seq] }
  capture = CAPTURE
}
data = synthetic(seed = 7, vocab = 64, seq_len = 16)
mesh { pp = 1, cp = 2 }
context { method = METHOD }
pipeline { schedule = 1f1b, microbatches = 2 }
train { steps = 2, global_batch = 4, grad_clip = 0.5, optimizer = adamw(lr = 0.003), seed = 11 }
"""


def plan_text(model: str, args: str = "{}", capture: str = "fx", method: str = "ring") -> str:
    return (PLAN.replace("MODEL", model).replace("ARGS", args).replace("CAPTURE", capture)
            .replace("METHOD", method))


def refusal(text: str) -> str:
    with pytest.raises(PlanError) as err:
        compile_plan(parse_plan(text, "cp.plan"))
    message = str(err.value)
    assert "cp.plan:9:" in message, message  # the context.method line, before any process
    return message


@pytest.mark.slow  # exporting Jamba: ~30 s on 2 shared cores
def test_jamba_mamba_layer_is_refused_at_its_conv1d():
    text = plan_text("jamba", capture="export", method="ulysses")
    message = refusal(text)
    assert "`conv1d`" in message and "module `model.layers.0.mamba`" in message, message
    assert "convolves over the sequence (kernel (4,))" in message, message


def test_the_models_own_loss_shifting_its_labels_is_refused_with_pipeplans_loss_as_hint():
    """transformers' Llama given labels (`loss = model`) pads and slices them along the
    sequence: refused at the context line naming the labels, the hint `loss = cross_entropy`
    (whose targets the data shifts), which check then accepts."""
    text = plan_text("llama", "{ layers = 2 }", "export").replace(
        "inputs = { input_ids = int64[batch, seq] }",
        "inputs = { input_ids = int64[batch, seq], labels = int64[batch, seq] }  loss = model"
    ).replace("seq_len = 16)", "seq_len = 16, inputs = { labels = tokens })")
    message = refusal(text)
    assert "computes on `labels` alone" in message and "loss = cross_entropy" in message, \
        message
    compile_plan(parse_plan(plan_text("llama", "{ layers = 2 }", "export"), "cp.plan"))


@pytest.mark.parametrize("capture, node", [("fx", "conv"), ("export", "conv1d")])
def test_causal_convolution_over_the_sequence_is_refused(capture, node):
    message = refusal(plan_text("CausalConvLM", capture=capture))
    assert f"(node `{node}`) in module `conv` convolves over the sequence (kernel (3,))" \
        in message, message


@pytest.mark.parametrize("op, said", [
    ("cumsum", "`cumsum` (node `cumsum`) accumulates along the sequence"),
    ("mean", "`mean` (node `mean`) reduces over the sequence (dim 1)"),
    ("roll", "`roll` (node `roll`) shifts the sequence"),
])
def test_mixing_ops_are_refused(op, said):
    assert said in refusal(plan_text("SeqOpLM", f'{{ op = "{op}" }}')), op


@pytest.mark.parametrize("model, args", [("CausalConvLM", "{ kernel = 1 }"),
                                         ("SeqOpLM", '{ op = "features" }')])
def test_per_position_ops_pass(model, args):
    compiled = compile_plan(parse_plan(plan_text(model, args), "cp.plan"))
    assert compiled.stages


def _kernel1_worker(rank, world):
    from .pipelined_vs_reference import assert_trains_like_reference

    plan = parse_plan(plan_text("CausalConvLM", "{ kernel = 1 }").replace(
        "steps = 2", "steps = 3"), "cp.plan")
    assert_trains_like_reference(plan, "kernel-1 conv, cp2 ring", 3)


@pytest.mark.slow
def test_kernel1_convolution_trains_under_cp_like_the_whole_sequence(run_workers):
    run_workers(_kernel1_worker, 2, timeout=300)


# ------------------------------------------------- positions the model makes itself
GPT = """\
model {
  source = "pipeplan.examples.models.gpt:GPT"
  args = { vocab = 64, dim = 32, layers = 2, heads = 4, seq_len = 16 }
  inputs = { input_ids = int64[batch, seq] }
  capture = fx
}
data = synthetic(seed = 7, vocab = 64, seq_len = 16)
mesh { pp = 1, cp = 2 }
context { method = METHOD }
pipeline { schedule = 1f1b, microbatches = 2 }
train { steps = 3, global_batch = 4, grad_clip = 0.5, optimizer = adamw(lr = 0.003), seed = 11 }
"""


def test_runs_of_positions():
    import torch

    from pipeplan.backends.parallel.cp.positions import runs
    from pipeplan.backends.parallel.cp.ring import ring_columns

    assert runs(torch.arange(8, 16)) == [(8, 16)]
    assert runs(ring_columns(16, 2, 0)) == [(0, 4), (12, 16)]  # chunks r and 2cp-1-r


def test_example_gpt_arange_is_tied_to_the_sequence_not_refused():
    from pipeplan.compiler.parallel.cp import POSITIONS

    compiled = compile_plan(parse_plan(GPT.replace("METHOD", "ring"), "gpt.plan"))
    marked = [n for s in compiled.stages for n in s.module.graph.nodes if n.meta.get(POSITIONS)]
    assert len(marked) == 1 and "arange" in str(marked[0].target), marked


def _gpt_worker(rank, world, methods):
    from .pipelined_vs_reference import assert_trains_like_reference

    for method in methods:
        plan = parse_plan(GPT.replace("METHOD", method), "gpt.plan")
        assert_trains_like_reference(plan, f"example GPT, cp2 {method}", 3)


@pytest.mark.slow
def test_example_gpt_with_its_own_positions_trains_under_cp_like_the_whole_sequence(
        run_workers):
    """The GPT's learned position embedding reads `arange(t)`: renumbered per rank (the
    ring's load-balanced chunks included), both methods equal the whole-sequence model."""
    run_workers(_gpt_worker, 2, ["ulysses", "ring"], timeout=400)


# ------------------------------------------- a constant cut to the local length (BERT)
TABLE = PLAN.replace("parallel.families:MODEL", "parallel.cp_models:MODEL")


def table_plan(model: str = "TableLM", args: str = "{}", capture: str = "export",
               method: str = "ring", steps: int = 2) -> str:
    return (TABLE.replace("MODEL", model).replace("ARGS", args).replace("CAPTURE", capture)
            .replace("METHOD", method).replace("steps = 2", f"steps = {steps}"))


@pytest.mark.parametrize("start", [0, 3])
def test_a_position_table_cut_to_the_length_is_taken_at_the_ranks_positions(start):
    """`position_ids[:, start:start + t]` of a buffer: export bakes t = S/cp, which the
    whole-length twin shows as S; the slice is marked to be taken at start + the rank's
    positions along dim 1, as the positions an arange makes."""
    from pipeplan.compiler.parallel.cp import POSITION_SLICE

    compiled = compile_plan(parse_plan(table_plan(args=f"{{ start = {start} }}"), "cp.plan"))
    marked = [n.meta[POSITION_SLICE] for s in compiled.stages for n in s.module.graph.nodes
              if POSITION_SLICE in n.meta]
    assert marked == [(1, start)], marked


def _table_cut(holder):
    """A graph cutting `holder.table` to its first 8 rows along dim 1 (aten's slice, as
    export gives it), marked as compiler/parallel/cp_masks.mark_positions marks it."""
    import torch
    import torch.fx as fx

    from pipeplan.compiler.parallel.cp import POSITION_SLICE

    g = fx.Graph()
    cut = g.call_function(torch.ops.aten.slice.Tensor, (g.get_attr("table"), 1, 0, 8))
    cut.meta[POSITION_SLICE] = (1, 0)
    g.output((cut,))
    return fx.GraphModule(holder, g)


@pytest.mark.parametrize("rank", [0, 1])
def test_renumbered_rows_of_a_constant_are_the_ranks_positions(rank):
    """The runtime's rewrite of a marked slice: the constant's rows at the rank's columns
    (ring attention's chunks r and 2cp-1-r), the same as indexing the whole table."""
    import torch

    from pipeplan.backends.parallel.cp.positions import renumber_positions
    from pipeplan.backends.parallel.cp.ring import ring_columns

    holder = torch.nn.Module()
    holder.register_buffer("table", torch.arange(64).view(1, 64) * 10)
    gm, columns = _table_cut(holder), ring_columns(16, 2, rank)
    assert renumber_positions(gm, columns) == 1
    assert torch.equal(gm()[0], holder.table[:, columns]), gm()[0]


def test_a_cut_the_compiler_does_not_renumber_is_refused():
    """The table's last t ids (`[:, -t:]`: rows 56.. at S/cp, 48.. at S): not rows of the
    whole sequence's cut, so nothing renumbers them, and the add that meets the sequence is
    refused (every rank would read the same rows), never run."""
    message = refusal(table_plan(args='{ start = "last" }'))
    assert "rows along it that no input gives" in message, message
    assert "every cp rank would use the first positions' rows" in message, message


def _table_worker(rank, world, cases):
    from .pipelined_vs_reference import assert_trains_like_reference

    for model, capture, method in cases:
        plan = parse_plan(table_plan(model, capture=capture, method=method, steps=3), "cp.plan")
        assert_trains_like_reference(plan, f"{model} ({capture}), cp2 {method}", 3)


@pytest.mark.slow
def test_position_tables_cut_to_the_length_train_under_cp_like_the_whole_sequence(run_workers):
    """Bidirectional attention (ring: every K/V block visible) with positions read from a
    buffer cut to the length: the hand-written encoder under both methods, and
    transformers' BERT (export: position and token type ids from buffers) under ring.
    Before, every rank read rows 0..S/cp-1: BERT cp2 verified DIFFERENT (loss 9e-3 off)."""
    run_workers(_table_worker, 2, [("TableLM", "export", "ring"),
                                   ("TableLM", "export", "ulysses"), ("bert", "export", "ring")],
                timeout=600)
