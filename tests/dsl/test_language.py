"""Every construct of the language reads into the typed Plan it means."""
from __future__ import annotations

import pytest

from pipeplan.dsl import PlanError, parse_plan
from pipeplan.dsl.ast import InputSpec, LayerRange, MemoryLimit, RecomputeRule

EVERYTHING = """\
# every section, every value form
model {
  source = "pkg.models:Net"
  args = { dim = 64, eps = 1e-5, name = "tiny", act = gelu, bias = false, extra = none, sizes = [1, 2.5, "x"] }
  inputs { input_ids = int64[batch, seq]  mask = bool[batch, 1, seq] }
  capture = export
  leaf_modules = [layers.*.attn, rotary]
  loss = model
}
data = tokens("data/train.bin", seq_len = 32, inputs = { mask = mask })
mesh { pp = 2, dp = 2; tp = 2, ep = 2 }
pipeline {
  schedule = zbh2
  microbatch_size = 1
  split = ["layers.2"]
  memory_limit = 1.5GiB  costs = [[2, 3, 1], [0.5, 1.5, 0.5]]
}
experts {
  modules = [layers.*.moe]
  num_experts = 8
  top_k = 1
  dropless = false
  capacity_factor = 1.25
  drop_policy = position
  aux_loss = 0.01
  z_loss = 1e-3
  dispatcher = allgather
  shared_experts = 1
}
tensor {
  column = [layers.*.attn.q, "layers.*.mlp.up"]
  row = layers.*.mlp.down
  vocab = [tok_emb]
  sequence_parallel = true
}
zero = 2
recompute {
  layers.*.mlp = full
  layers.*.attn = selective
  "0.x" = none
}
train {
  steps = 100
  global_batch = 32
  optimizer = sgd(lr = 0.1, momentum = 0.9, weight_decay = 1e-4)
  lr_schedule = cosine(warmup = 10, min_lr = 0.001)
  grad_clip = 1.0
  precision = bf16
  seed = 7
  checkpoint { every = 50, dir = "ckpt", keep = 3 }
  log_dir = "runs/x"
}
"""


@pytest.fixture(scope="module")
def plan():
    return parse_plan(EVERYTHING, "every.plan")


def test_model_section(plan):
    m = plan.model
    assert m.source == "pkg.models:Net"
    assert dict(m.args) == {"dim": 64, "eps": 1e-5, "name": "tiny", "act": "gelu", "bias": False,
                            "extra": None, "sizes": (1, 2.5, "x")}
    assert m.inputs == (InputSpec("input_ids", "int64", ("batch", "seq")),
                        InputSpec("mask", "bool", ("batch", 1, "seq")))
    assert (m.capture, m.leaf_modules, m.loss) == ("export", ("layers.*.attn", "rotary"), "model")


def test_data_mesh_pipeline(plan):
    assert (plan.data.kind, plan.data.path, plan.data.seq_len) == ("file", "data/train.bin", 32)
    assert plan.data.feeds(["input_ids", "mask"]) == (("input_ids", "tokens"), ("mask", "mask"))
    assert (plan.mesh.pp, plan.mesh.dp, plan.mesh.tp, plan.mesh.ep) == (2, 2, 2, 2)
    assert plan.mesh.world_size == 8
    p = plan.pipeline
    assert (p.schedule, p.microbatch_size, p.microbatches) == ("zbh2", 1, None)
    assert (p.split.kind, p.split.points) == ("points", ("layers.2",))
    assert p.memory_limit == MemoryLimit(1.5 * 2**30, in_bytes=True)
    assert p.costs == ((2.0, 3.0, 1.0), (0.5, 1.5, 0.5))
    # resolved from the size: 32 sequences / dp 2 / 1 per microbatch
    assert (plan.microbatches, plan.microbatch_size) == (16, 1)


def test_experts_tensor_zero_recompute(plan):
    e = plan.experts
    assert (e.modules, e.num_experts, e.top_k, e.dropless, e.capacity_factor) == (
        ("layers.*.moe",), 8, 1, False, 1.25)
    assert (e.drop_policy, e.aux_loss, e.z_loss, e.dispatcher, e.shared_experts) == (
        "position", 0.01, 1e-3, "allgather", 1)
    t = plan.tensor
    assert t.column == ("layers.*.attn.q", "layers.*.mlp.up")
    assert t.row == ("layers.*.mlp.down",) and t.vocab == ("tok_emb",) and t.sequence_parallel
    assert plan.zero == 2
    assert plan.recompute == (RecomputeRule("layers.*.mlp", "full"),
                              RecomputeRule("layers.*.attn", "selective"), RecomputeRule("0.x", "none"))


def test_train_section(plan):
    t = plan.train
    assert (t.steps, t.global_batch, t.grad_clip, t.precision, t.seed, t.log_dir) == (
        100, 32, 1.0, "bf16", 7, "runs/x")
    assert (t.optimizer.name, t.optimizer.lr, t.optimizer.momentum, t.optimizer.weight_decay) == (
        "sgd", 0.1, 0.9, 1e-4)
    assert (t.lr_schedule.kind, t.lr_schedule.warmup, t.lr_schedule.min_lr) == ("cosine", 10, 0.001)
    assert (t.checkpoint.every, t.checkpoint.dir, t.checkpoint.keep) == (50, "ckpt", 3)


def test_spans_cover_every_value_and_section(plan):
    s = plan.spans
    for key in ("model", "model.args.dim", "model.inputs.mask", "pipeline", "pipeline.schedule",
                "pipeline.split.0", "experts.num_experts", "tensor.column", "tensor.column.1",
                "recompute.1", "recompute.1.mode", "train.optimizer.lr", "train.checkpoint.dir",
                "data", "data.seq_len", "data.path", "zero", "mesh.ep"):
        assert key in s, key
    assert (s["pipeline.schedule"].line, s["pipeline.schedule"].col) == (13, 14)
    assert (s["tensor.column.1"].line, s["tensor.column.1"].col) == (31, 30)
    assert (s["pipeline"].line, s["pipeline"].col) == (12, 1)
    # span_of falls back to the enclosing section for keys the file leaves out
    assert plan.span_of("pipeline.virtual") == s["pipeline"]


@pytest.mark.parametrize("text,expected", [
    ("1f1b", "1f1b"), ("zbh1", "zbh1"), ('"gpipe"', "gpipe"), ("auto", "auto")])
def test_schedule_names_lex_as_names(text, expected):
    base = ('model { source = "m.py:M" }\npipeline { schedule = %s }\n'
            "train { global_batch = 8 }" % text)
    assert parse_plan(base).pipeline.schedule == expected


@pytest.mark.parametrize("text,limit", [
    ("40GiB", MemoryLimit(40 * 2**30, True)), ("512MiB", MemoryLimit(2**29, True)),
    ("2GB", MemoryLimit(2e9, True)), ("100B", MemoryLimit(100, True)), ("4", MemoryLimit(4.0)),
    ("2.5", MemoryLimit(2.5))])
def test_sizes_and_counts(text, limit):
    plan = parse_plan('model { source = "m.py:M" }\npipeline { memory_limit = %s }' % text)
    assert plan.pipeline.memory_limit == limit


def test_split_forms():
    head = 'model { source = "m.py:M" }\nmesh { pp = 2 }\ntrain { global_batch = 4 }\n'
    auto = parse_plan(head + "pipeline { split = auto(params) }").pipeline.split
    assert (auto.kind, auto.basis) == ("auto", "params")
    assert parse_plan(head + "pipeline { split = auto }").pipeline.split.basis == "flops"
    ranges = parse_plan(head + "pipeline { split = [blocks.h[0:3], blocks.h[3:5]] }").pipeline.split
    assert ranges.ranges == (LayerRange("blocks.h", 0, 3), LayerRange("blocks.h", 3, 5))
    points = parse_plan(head + "pipeline { split = [layers.3] }").pipeline.split
    assert points.points == ("layers.3",)


def test_microbatches_default_to_the_schedules_minimum():
    plan = parse_plan('model { source = "m.py:M" }\nmesh { pp = 4 }\n'
                      "pipeline { schedule = dualpipev  virtual = 2 }\ntrain { global_batch = 16 }")
    assert plan.microbatches == 8 and plan.microbatch_size == 2


def test_virtual_defaults_to_the_schedules_natural_stages_per_rank():
    head = 'model { source = "m.py:M" }\nmesh { pp = 2 }\ntrain { global_batch = 4 }\n'
    assert parse_plan(head + "pipeline { schedule = zbv }").pipeline.virtual == 2
    assert parse_plan(head + "pipeline { schedule = interleaved }").pipeline.virtual == 2
    assert parse_plan(head + "pipeline { schedule = interleaved  virtual = 3 }").pipeline.virtual == 3
    assert parse_plan(head + "pipeline { schedule = 1f1b }").pipeline.virtual == 1


def test_comments_and_separators_are_free():
    a = parse_plan('model { source = "m.py:M" } # c\nmesh { pp = 2; dp = 1, tp = 1 }  # trailing')
    b = parse_plan('model {\n  # above\n  source = "m.py:M"\n}\nmesh {\n  pp = 2\n}\n')
    assert a == b


def test_empty_plan_says_model_is_missing():
    with pytest.raises(PlanError, match="the plan needs 'model'"):
        parse_plan("")


def test_every_plan_snippet_in_the_reference_parses():
    """The language reference's plan examples are valid plan text (full checks where complete)."""
    from pathlib import Path

    from pipeplan.dsl.syntax import parse_document

    doc = (Path(__file__).resolve().parents[2] / "docs" / "plan-language.md").read_text()
    blocks = doc.split("```")[1::2]
    snippets = [b.lstrip("\n") for b in blocks if not b.startswith(("python", "\n$"))
                and "error:" not in b]
    assert len(snippets) >= 8
    for snippet in snippets:
        parse_document(snippet, "docs")
        if snippet.startswith("# examples/") or "source =" in snippet:
            parse_plan(snippet, "docs")
