"""Bad input: each error points at the plan line and says how to fix it."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from pipeplan.compiler import compile_plan, load_model
from pipeplan.dsl import load_plan
from pipeplan.dsl.ast import SplitSpec
from pipeplan.dsl.errors import PlanError

REPO = Path(__file__).resolve().parents[2]

GPT = """model {{
  source = "{source}"
  args = {{ vocab = 64, dim = 32, layers = 4, heads = 4, seq_len = 16{extra} }}
  inputs = {{ input_ids = int64[batch, seq] }}
}}
data = synthetic(seed = 0, vocab = 64, seq_len = 16)
mesh {{ pp = 2 }}
pipeline {{
  schedule = 1f1b
  microbatches = 2
  split = {split}
}}
train {{ global_batch = 4 }}
"""


def _plan(tmp_path, source="models/gpt.py:GPT", extra="", split="auto(flops)"):
    import shutil
    from pathlib import Path
    repo = Path(__file__).resolve().parents[2]
    models = tmp_path / "models"
    if not models.exists():
        shutil.copytree(repo / "examples" / "models", models)
    path = tmp_path / "p.plan"
    path.write_text(GPT.format(source=source, extra=extra, split=split))
    return load_plan(str(path))


def _error(fn, *args):
    with pytest.raises(PlanError) as e:
        fn(*args)
    return str(e.value)


def test_missing_file(tmp_path):
    text = _error(load_model, _plan(tmp_path, source="models/nope.py:GPT"))
    assert "p.plan:2:" in text and "model file not found" in text and "^" in text


def test_unknown_class_did_you_mean(tmp_path):
    text = _error(load_model, _plan(tmp_path, source="models/gpt.py:GTP"))
    assert "p.plan:2:" in text and "no class 'GTP'" in text and "did you mean 'GPT'" in text


def test_wrong_constructor_args(tmp_path):
    text = _error(load_model, _plan(tmp_path, extra=", layerz = 2"))
    assert "p.plan:3:" in text and "layerz" in text and "did you mean 'layers'" in text


def test_constructor_failure_points_at_args(tmp_path):
    text = _error(load_model, _plan(tmp_path, extra=", hidden = -5"))
    assert "p.plan:3:" in text and "GPT(" in text and "failed" in text


def test_unknown_split_name_did_you_mean(tmp_path):
    text = _error(compile_plan, _plan(tmp_path, split='["layer.2"]'))
    assert "p.plan:11:" in text and "no module named 'layer.2'" in text
    assert "did you mean 'layers.2'" in text


def test_split_points_out_of_order(make_plan):
    plan = make_plan("examples/models/gpt.py:GPT", {"layers": 4, "seq_len": 16}, pp=3,
                     microbatches=3, global_batch=6,
                     split=SplitSpec(kind="points", points=("layers.3", "layers.1")))
    assert "runs before" in _error(compile_plan, plan)


def test_too_many_stages_for_blocks(make_plan):
    plan = make_plan("tests/compiler/models.py:SkipNet", {"layers": 1}, pp=8, microbatches=8,
                     global_batch=8)
    assert "too few" in _error(compile_plan, plan)


@pytest.mark.parametrize("kind", ["missing file", "unknown class", "wrong args",
                                  "uncapturable", "unknown split", "tp heads", "ep experts"])
def test_cli_compile_bad_input_exit_code_2_no_traceback(tmp_path, capsys, kind):
    from pipeplan.cli import main
    mixed = (REPO / "tests" / "compiler" / "models.py").as_posix() + ":Mixed"
    if kind == "tp heads":
        path = _tp_plan(tmp_path, tp=8).path
    elif kind == "ep experts":
        path = _write_moe_plan(tmp_path, ep=4, experts=6)  # the plan checks catch it first
    else:
        source, extra, split = {"missing file": ("models/nope.py:GPT", "", "auto(flops)"),
                                "unknown class": ("models/gpt.py:GTP", "", "auto(flops)"),
                                "wrong args": ("models/gpt.py:GPT", ", layerz = 1", "auto(flops)"),
                                "uncapturable": (mixed, "", "auto(flops)"),
                                "unknown split": ("models/gpt.py:GPT", "", '["layer.2"]')}[kind]
        path = _plan(tmp_path, source=source, extra=extra, split=split).path
    code = main(["compile", path, "-o", str(tmp_path / "build")])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert re.search(r"\.plan:\d+:\d+: error: ", err) and "^" in err, err
    assert not (tmp_path / "build").exists()

TP_PLAN = """model {{
  source = "models/gpt.py:GPT"
  args = {{ vocab = 64, dim = 64, layers = 2, heads = 4, seq_len = 16 }}
}}
data = synthetic(seed = 0, vocab = 64, seq_len = 16)
mesh {{ tp = {tp} }}
pipeline {{ microbatches = 1 }}
tensor {{
  column = [layers.*.attn.q, {column}]
  row = [{row}]
}}
train {{ global_batch = 2 }}
"""


COLUMN = "layers.*.attn.k, layers.*.attn.v, layers.*.mlp.up"
ROW = "layers.*.attn.proj, layers.*.mlp.down"


def _tp_plan(tmp_path, tp=8, column=COLUMN, row=ROW):
    _plan(tmp_path)  # copies the example models next to the plan
    path = tmp_path / "tp.plan"
    path.write_text(TP_PLAN.format(tp=tp, column=column, row=row))
    return load_plan(str(path))


def test_tp_not_dividing_heads(tmp_path):
    text = _error(compile_plan, _tp_plan(tmp_path, tp=8))
    assert "tp.plan:9:" in text and "does not divide the 4 heads of layers.0.attn.q" in text


def test_tp_pattern_matching_nothing(tmp_path):
    text = _error(compile_plan, _tp_plan(tmp_path, tp=2, column="layers.*.mlp.upp"))
    assert "tp.plan:9:" in text and "no module matches 'layers.*.mlp.upp'" in text


def test_tp_megatron_pairing_checked_on_the_graph(tmp_path):
    # v left replicated: the attention output proj reads is not all split
    text = _error(compile_plan, _tp_plan(tmp_path, tp=2,
                                         column="layers.*.attn.k, layers.*.mlp.up"))
    assert "tp.plan:10:" in text and "row-parallel layers.0.attn.proj reads" in text
    # up split but down not: gelu's split output would reach a full Linear
    text = _error(compile_plan, _tp_plan(tmp_path, tp=2, row="layers.*.attn.proj"))
    assert "tp.plan:9:" in text and "column-parallel layers.0.mlp.up feeds layers.0.mlp.down, " \
        "which is not row-parallel" in text


def test_tp_annotations_recorded(tmp_path):
    compiled = compile_plan(_tp_plan(tmp_path, tp=2))
    assert compiled.tp_rewrites["layers.1.attn.q"] == "column"
    assert compiled.tp_rewrites["layers.0.attn.proj"] == "row"


MOE_PLAN = """model {{
  source = "models/moe_gpt.py:MoEGPT"
  args = {{ vocab = 64, dim = 32, layers = 2, heads = 4, seq_len = 16, num_experts = 4 }}
}}
data = synthetic(seed = 0, vocab = 64, seq_len = 16)
mesh {{
  dp = 4
  ep = {ep}
}}
pipeline {{ microbatches = 1 }}
experts {{
  modules = [{modules}]
  num_experts = {experts}
}}
train {{ global_batch = 4 }}
"""


def _write_moe_plan(tmp_path, ep=2, modules="layers.*.moe", experts=4) -> str:
    _plan(tmp_path)
    path = tmp_path / "moe.plan"
    path.write_text(MOE_PLAN.format(ep=ep, modules=modules, experts=experts))
    return str(path)


def _moe_plan(tmp_path, **kw):
    return load_plan(_write_moe_plan(tmp_path, **kw))


def test_ep_not_dividing_experts(tmp_path, make_plan):
    from dataclasses import replace
    from pipeplan.dsl.ast import MeshSpec
    plan = _moe_plan(tmp_path)
    plan = replace(plan, mesh=MeshSpec(dp=3, ep=3))  # past the plan checks: the compiler's own
    text = _error(compile_plan, plan)
    assert "moe.plan:13:" in text and "ep = 3 does not divide num_experts = 4" in text


def test_expert_count_checked_against_model(tmp_path):
    from dataclasses import replace
    plan = _moe_plan(tmp_path)
    plan = replace(plan, experts=replace(plan.experts, num_experts=8))
    text = _error(compile_plan, plan)
    assert "layers.0.moe does not hold 8 experts" in text


def test_moe_pattern_matching_nothing(tmp_path):
    text = _error(compile_plan, _moe_plan(tmp_path, modules="layers.*.mo"))
    assert "moe.plan:12:" in text and "no module matches 'layers.*.mo'" in text


def test_expert_placement_contiguous_blocks(tmp_path):
    compiled = compile_plan(_moe_plan(tmp_path, ep=2))
    assert [e.module for e in compiled.experts] == ["layers.0.moe", "layers.1.moe"]
    assert all(e.shards == ((0, 1), (2, 3)) for e in compiled.experts)


def test_tp_not_dividing_kv_heads(make_plan):
    from pipeplan.dsl.ast import MeshSpec, TensorSpec
    # 8 query heads, 2 KV heads: tp = 4 splits the queries but not the keys/values
    plan = make_plan("tests/compiler/models.py:Llama",
                     {"vocab": 64, "dim": 64, "layers": 2, "heads": 8, "kv_heads": 2, "ffn": 128},
                     pp=1, mesh=MeshSpec(tp=4),
                     tensor=TensorSpec(column=("layers.*.attn.q", "layers.*.attn.k"),
                                       row=("layers.*.attn.o",)))
    text = _error(compile_plan, plan)
    assert "tp = 4 does not divide the 2 heads of layers.0.attn.k" in text  # the key/value heads


def test_tp_not_dividing_ffn_and_vocab(make_plan):
    from pipeplan.dsl.ast import MeshSpec, TensorSpec
    args = {"vocab": 66, "dim": 64, "layers": 1, "heads": 8, "kv_heads": 8, "ffn": 100}
    ffn = make_plan("tests/compiler/models.py:Llama", args, pp=1, mesh=MeshSpec(tp=8),
                    tensor=TensorSpec(column=("layers.*.up",)))
    assert "does not divide the 100 output features of layers.0.up" in _error(compile_plan, ffn)
    vocab = make_plan("tests/compiler/models.py:Llama", args, pp=1, mesh=MeshSpec(tp=4),
                      tensor=TensorSpec(vocab=("tok_emb",)))
    assert "does not divide the vocabulary of tok_emb (66)" in _error(compile_plan, vocab)


def test_synthetic_vocab_larger_than_model(make_plan):
    from dataclasses import replace
    from pipeplan.dsl.ast import DataSpec
    plan = make_plan("examples/models/gpt.py:GPT", {"vocab": 64, "layers": 2, "seq_len": 16})
    plan = replace(plan, data=DataSpec(seq_len=16, vocab=256))
    assert "model predicts 64 classes" in _error(compile_plan, plan)
