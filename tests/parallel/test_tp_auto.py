"""`tensor { plan = auto }`: Megatron's column/row pairs found in the captured graph
(compiler/parallel/tp_auto.py), judged against the pairs Megatron-LM names for the example
GPT, and against models where a norm sits between two Linears or nothing pairs. (Training
equal to the single-process model: tests/parallel/test_tensor_parallel.py, "auto-pp2-tp2".)
"""
from __future__ import annotations

import os

import pytest

from pipeplan.compiler import compile_plan
from pipeplan.dsl.errors import PlanError
from pipeplan.dsl.load import parse_plan

GPT = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "models", "gpt.py")
PLAN = """model {{
  source = "{source}"
  args = {{ {args} }}
}}
data = synthetic(seed = 0, vocab = 64, seq_len = 16)
mesh {{ tp = 2 }}
tensor {{ plan = auto }}
train {{ global_batch = 4 }}
"""


def _compiled(source: str, args: str, tmp_path):
    return compile_plan(parse_plan(PLAN.format(source=source, args=args),
                                   str(tmp_path / "auto.plan")))


def test_the_example_gpt_is_split_as_megatron_splits_it(tmp_path):
    """q, k, v and the MLP's up projection column-parallel, the attention's output and the
    MLP's down projection row-parallel, in every layer; the token embedding and the LM head
    over the vocabulary, the position table (indexed by `arange`) whole: the split
    Megatron-LM makes (and tests/benchmarks/calibration/gpt_1t.plan writes out); `check`
    lists them."""
    from pipeplan.compiler.estimate.report import split_lines
    c = _compiled(os.path.abspath(GPT) + ":GPT",
                  "vocab = 64, dim = 32, layers = 3, heads = 4, seq_len = 64", tmp_path)
    want = {f"layers.{i}.{m}": kind for i in range(3) for m, kind in (
        ("attn.q", "column"), ("attn.k", "column"), ("attn.v", "column"),
        ("mlp.up", "column"), ("attn.proj", "row"), ("mlp.down", "row"))}
    assert c.tp_rewrites == {**want, "tok_emb": "vocab", "lm_head": "vocab"}
    assert split_lines(c) == ["tensor.plan = auto: 20 layers split",
                              "  column: layers.*.attn.k, layers.*.attn.q, layers.*.attn.v, "
                              "layers.*.mlp.up",
                              "  row: layers.*.attn.proj, layers.*.mlp.down",
                              "  vocab: lm_head, tok_emb"]


def test_a_norm_between_two_linears_is_no_pair(tmp_path):
    """`a -> LayerNorm -> b`: the norm combines a's features, which a column split would cut;
    only `up -> GELU -> down` is paired (and the vocabulary: embedding and head)."""
    c = _compiled("pipeplan.tests.parallel.tp_models:NormBetweenLM", "layers = 2", tmp_path)
    assert c.tp_rewrites == {"embed": "vocab", "head": "vocab",
                             **{f"layers.{i}.{m}": k for i in range(2)
                                for m, k in (("up", "column"), ("down", "row"))}}


def test_a_model_with_nothing_to_pair_is_refused_at_the_line(tmp_path):
    with pytest.raises(PlanError) as e:
        _compiled("pipeplan.tests.parallel.tp_models:NormBetweenLM",
                  "layers = 2, single = true", tmp_path)
    said = str(e.value)
    assert "auto.plan:7:" in said and "found no column/row pairs" in said and "^" in said
    assert "only the vocabulary could split: `vocab = [embed, head]`" in said


def test_attention_whose_queries_are_normalised_over_every_head_stays_whole(tmp_path):
    """OLMo 2 normalises q and k over all heads' features before attention: q and k are no
    column layers, so o_proj is no row layer, and without them v_proj has no pair either;
    the MLP's gate/up -> down is split. (Before, v_proj stayed column with o_proj whole, and
    `check` refused the plan it had made.)"""
    c = _compiled("pipeplan.tests.parallel.families:olmo2", "layers = 2", tmp_path)
    assert c.tp_rewrites == {"model.embed_tokens": "vocab", "lm_head": "vocab",
                             **{f"model.layers.{i}.mlp.{m}": k for i in range(2)
                                for m, k in (("gate_proj", "column"), ("up_proj", "column"),
                                             ("down_proj", "row"))}}


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_attention_whose_queries_are_normalised_within_each_head_is_split(family, tmp_path):
    """Qwen 3 and Gemma 3 normalise q and k over each head's own dims (q_norm / k_norm
    after the view to heads): the split dim is the heads, which that norm keeps apart, so
    q, k, v -> o is a pair (as the models' own tp plans say; before, `auto` left their
    attention whole as OLMo 2's). The norm's weight meets the rank's heads only: its
    gradient is a partial sum, all-reduced in backward -- one more per norm and microbatch
    in the estimate (traffic.py "partial_param"; test_estimates_exact holds it to what
    DTensor issues)."""
    c = _compiled(f"pipeplan.tests.parallel.families:{family}", "layers = 2", tmp_path)
    attn = {f"model.layers.{i}.self_attn.{m}": k for i in range(2) for m, k in (
        ("q_proj", "column"), ("k_proj", "column"), ("v_proj", "column"),
        ("o_proj", "row"))}
    assert attn.items() <= c.tp_rewrites.items(), c.tp_rewrites
    (calls,) = c.estimates.stage_collectives
    # per microbatch: in each of the 2 layers, q, k, v's input gradient and the MLP's, o's
    # and down's outputs, and the q_norm and k_norm weights' gradients; the vocabulary's:
    # the embedding's output, the loss's max, sum of exponentials and target logit, the
    # head's input gradient
    assert calls[("tp", "allreduce")][0] == c.plan.microbatches * (2 * (4 + 2) + 5), calls


def test_sequence_parallel_with_attention_outside_the_pairs_is_refused(tmp_path):
    """Sequence parallel holds 1/tp of the positions between the pairs; attention no column
    layer feeds would read them there (the example GPT with only its MLP split: the first
    forward crashed after `check` passed). Refused at the line; with q, k, v and proj split
    too it passes."""
    text = PLAN.format(source=os.path.abspath(GPT) + ":GPT",
                       args="vocab = 64, dim = 32, layers = 2, heads = 4, seq_len = 16")
    mlp = text.replace("tensor { plan = auto }", "tensor {\n  column = [layers.*.mlp.up]\n"
                       "  row = [layers.*.mlp.down]\n  sequence_parallel = true\n}")
    with pytest.raises(PlanError) as e:
        compile_plan(parse_plan(mlp, str(tmp_path / "mlp.plan")))
    said = str(e.value)
    assert "mlp.plan:10:" in said and "is not inside a tensor-parallel pair" in said
    both = mlp.replace("column = [layers.*.mlp.up]",
                       "column = [layers.*.mlp.up, layers.*.attn.q, layers.*.attn.k, "
                       "layers.*.attn.v]").replace("row = [layers.*.mlp.down]",
                                                   "row = [layers.*.mlp.down, layers.*.attn.proj]")
    assert compile_plan(parse_plan(both, str(tmp_path / "both.plan"))).tp_rewrites


def test_the_planner_never_proposes_sequence_parallel_the_compiler_refuses(tmp_path):
    """OLMo 2 by `tensor.plan = auto`: its attention stays whole, so sequence parallel is
    refused; the planner lists that reason for tp = 2 with SP and proposes tp = 2 without."""
    from pipeplan.compiler.estimate.device import device_model
    from pipeplan.dsl.load import load_plan
    from pipeplan.planner.search import search
    from pipeplan.planner.space import Constraints
    path = tmp_path / "olmo2.plan"
    path.write_text(PLAN.format(source="pipeplan.tests.parallel.families:olmo2",
                                args="layers = 2").replace(
        "train { global_batch = 4 }", "train { global_batch = 8 }\ndevice { name = h100 }"))
    plan = load_plan(str(path))
    res = search(plan, 2, device_model(plan), 1e12,
                 Constraints(fixed={"tp": 2, "pp": 1, "recompute": "none", "zero": 0},
                             schedules=("1f1b",)), top_k=3)
    assert res.top and all(not r.candidate.sp for r in res.top)
    assert [v for r, v in res.not_considered.items()
            if "not inside a tensor-parallel pair" in r] == [["tp=2 sp"]]


def test_attention_tp_cannot_keep_split_is_left_whole_and_listed(tmp_path):
    """Llama with 2 k/v heads at tp = 4: no rank would hold a whole k/v head, so DTensor
    would gather k and v (running attention whole on every rank while the estimates
    divided it). `auto` leaves the attention whole -- k and v, and q and o with them, a
    pair needing both sides -- splits the MLP, and `check` says which and why (at tp = 2
    everything splits)."""
    from pipeplan.compiler.estimate.report import split_lines

    text = PLAN.format(source="pipeplan.tests.parallel.families:llama", args="layers = 2")
    c = compile_plan(parse_plan(text.replace("tp = 2", "tp = 4"), str(tmp_path / "a.plan")))
    assert c.tp_rewrites == {"model.embed_tokens": "vocab", "lm_head": "vocab",
                             **{f"model.layers.{i}.mlp.{m}": k for i in range(2)
                                for m, k in (("gate_proj", "column"), ("up_proj", "column"),
                                             ("down_proj", "row"))}}
    assert sorted(c.tp_whole) == [f"model.layers.{i}.self_attn.{m}" for i in range(2)
                                  for m in ("k_proj", "v_proj")]
    lines = split_lines(c)
    assert [line.split(" (")[0] for line in lines if "left whole" in line] == [
        "  left whole: model.layers.*.self_attn.k_proj",
        "  left whole: model.layers.*.self_attn.v_proj"]
    assert "tp = 4 does not divide the 2 heads of model.layers.0.self_attn.k_proj" in lines[4]
    at2 = compile_plan(parse_plan(text, str(tmp_path / "b.plan")))
    assert len(at2.tp_rewrites) == 16 and at2.tp_whole == {}


def test_a_vocabulary_tp_cannot_split_stays_whole_and_is_listed(tmp_path):
    """The vocabulary is split only where every holder of the weight can be: a vocabulary
    tp does not divide (66 at tp 4) leaves the embedding and the head whole; BART's head
    adds a bias tensor to its logits (so it does not feed the loss as logits alone) and
    shares its weight with the embeddings, which stay whole with it. `check` says why."""
    text = PLAN.format(source=os.path.abspath(GPT) + ":GPT",
                       args="vocab = 66, dim = 32, layers = 2, heads = 4, seq_len = 16")
    c = compile_plan(parse_plan(text.replace("tp = 2", "tp = 4").replace("vocab = 64",
                                                                         "vocab = 66"),
                                str(tmp_path / "v.plan")))
    assert "vocab" not in c.tp_rewrites.values() and len(c.tp_rewrites) == 12
    assert c.tp_whole == {n: "tp = 4 does not divide its vocabulary (66)"
                          for n in ("lm_head", "tok_emb")}

    from pipeplan.tests.parallel.families import family_plan_text
    bart = compile_plan(parse_plan(family_plan_text("bart"), str(tmp_path / "bart.plan")))
    assert "vocab" not in bart.tp_rewrites.values()
    assert bart.tp_whole == {n: "a parameter of it is tied to lm_head, model.shared, not split so"
                             for n in ("model.encoder.embed_tokens",
                                       "model.decoder.embed_tokens")}, bart.tp_whole
    # ALBERT's MLM head holds its decoder's bias: the decoder, so the embedding, stay whole
    albert = compile_plan(parse_plan(family_plan_text("albert"), str(tmp_path / "al.plan")))
    assert albert.tp_whole == {
        "albert.embeddings.word_embeddings": "a parameter of it is tied to predictions.decoder, "
                                             "not split so",
        "predictions.decoder": "a parameter of it is tied to predictions, not split so"}
    # T5 shares the same table between its encoder, decoder and `shared` (which the graph
    # never applies): split in all of them
    t5 = compile_plan(parse_plan(family_plan_text("t5"), str(tmp_path / "t5.plan")))
    assert {n for n, k in t5.tp_rewrites.items() if k == "vocab"} == {
        "shared", "encoder.embed_tokens", "decoder.embed_tokens", "lm_head"}, t5.tp_rewrites


def test_a_convolution_between_two_linears_is_no_pair(tmp_path):
    """`a -> depthwise Conv1d -> b`: the convolution's weight holds every channel and tp
    splits no convolution; `auto` paired a with b and the run crashed in its first forward
    after `check` passed (Inkling: "expected input ... to have 2048 channels, but got 1024").
    `auto` pairs only up/down now; the pair written out is refused at its column line."""
    src = "pipeplan.tests.parallel.tp_models:NormBetweenLM"
    c = _compiled(src, "layers = 2, conv = true", tmp_path)
    assert c.tp_rewrites == {"embed": "vocab", "head": "vocab",
                             **{f"layers.{i}.{m}": k for i in range(2)
                                for m, k in (("up", "column"), ("down", "row"))}}
    text = PLAN.format(source=src, args="layers = 2, conv = true").replace(
        "tensor { plan = auto }", "tensor {\n  column = [layers.*.a]\n  row = [layers.*.b]\n}")
    with pytest.raises(PlanError) as e:
        compile_plan(parse_plan(text, str(tmp_path / "written.plan")))
    (d,) = e.value.diagnostics
    assert "layers.0.a's split output passes through a convolution" in d.message
    assert text.splitlines()[d.span.line - 1][d.span.col - 1:].startswith("layers.*.a")


def test_a_linear_both_reading_and_writing_a_split_is_no_pair(tmp_path):
    """Doge's dt_proj reads v's output and adds its own to the attention scores: as a row it
    would take v's split, as a column give o_proj one; it is neither, so v, and the
    attention with it, stays whole (before, `auto` made it a column and `check` refused
    the split `auto` had made: "v_proj feeds dt_proj, which is not row-parallel")."""
    c = _compiled("pipeplan.tests.parallel.families:doge", "layers = 2", tmp_path)
    assert not [n for n in c.tp_rewrites if "self_attn" in n], c.tp_rewrites
    assert "row" in c.tp_rewrites.values(), c.tp_rewrites
