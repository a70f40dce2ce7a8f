"""One test per error class: the reported file:line:col and message.

Each case edits a small valid plan (BASE or MOE in conftest) and names where
the error must point: `needle` is text of the edited plan, and `|` inside it
marks the exact column (else the needle's first character).
"""
from __future__ import annotations

import dataclasses

import pytest

from pipeplan.cli import main
from pipeplan.dsl import PlanError, check_plan, parse_plan

# (id, plan, old, new, needle, message)
SYNTAX = [
    ("unexpected-token", "base", "microbatches = 8", "microbatches = = 8", "= |= 8",
     "unexpected '='"),
    ("unexpected-character", "base", "pp = 4", "pp = 4 @", "@", "unexpected character '@'"),
    ("unterminated-string", "base", '"models/gpt.py:GPT"', '"models/gpt.py:GPT', '"models',
     "unexpected character '\"'"),
    ("invalid-escape", "base", '"models/gpt.py:GPT"', '"models\\q.py:GPT"', '"models',
     "invalid escape in string"),
    ("number-too-large", "base", "lr = 0.003", "lr = 1e999", "1e999", "number 1e999 is too large"),
    ("positional-after-keyword", "base", "adamw(lr = 0.003)", "adamw(lr = 0.003, 0.1)", "0.1)",
     "positional argument after a keyword argument"),
]

SCHEMA = [
    ("unknown-key", "base", "microbatches = 8", "microbatch = 8", "microbatch ",
     "unknown key 'microbatch' in pipeline"),
    ("unknown-section", "base", "mesh { pp = 4 }", "mesh { pp = 4 }\nmeshes { }", "meshes",
     "unknown key 'meshes' in the plan"),
    ("duplicate-key", "base", "steps = 30", "steps = 30\n  steps = 40", "steps = 40",
     "duplicate key 'steps' in train"),
    ("duplicate-section", "base", "mesh { pp = 4 }", "mesh { pp = 4 }\nmesh { dp = 1 }",
     "mesh { dp", "duplicate key 'mesh' in the plan"),
    ("type-string-for-int", "base", "steps = 30", 'steps = "30"', '"30"',
     'train.steps must be an integer, got the string "30"'),
    ("type-name-for-bool", "base", "mesh { pp = 4 }", "mesh { pp = 4 }\ntensor { sequence_parallel = yes }",
     "yes", "tensor.sequence_parallel must be true or false, got a name 'yes'"),
    ("below-minimum", "base", "pp = 4", "pp = 0", "pp = |0", "mesh.pp must be at least 1, got 0"),
    ("above-maximum", "base", "mesh { pp = 4 }", "mesh { pp = 4 }\nzero = 4", "zero = |4",
     "zero must be at most 3, got 4"),
    ("unknown-schedule", "base", "schedule = 1f1b", "schedule = onef1b", "onef1b",
     "unknown schedule 'onef1b'"),
    ("missing-required-key", "base", '  source = "models/gpt.py:GPT"\n', "", "model",
     "model needs 'source'"),
    ("missing-model", "base", BASE_MODEL := (
        'model {\n  source = "models/gpt.py:GPT"\n'
        '  args = { vocab = 256, dim = 64, layers = 8, heads = 4, seq_len = 64 }\n}\n'), "",
     "data", "the plan needs 'model'"),
    ("model-source-format", "base", '"models/gpt.py:GPT"', '"models/gpt.py"', '"models',
     "model source 'models/gpt.py' is not file.py:Class or package.module:Class"),
    ("unknown-function", "base", "adamw(lr = 0.003)", "adam(lr = 0.003)", "adam(",
     "unknown optimizer 'adam'"),
    ("unknown-argument", "base", "adamw(lr = 0.003)", "adamw(lr = 0.003, momentum = 0.9)",
     "momentum", "unknown argument 'momentum' in adamw()"),
    ("too-many-positional", "base", "synthetic(seed = 0", "synthetic(7, seed = 0", "7,",
     "synthetic() takes only named arguments"),
    ("split-mixed-forms", "base", "split = [layers[0:2], layers[2:4], layers[4:6], layers[6:8]]",
     'split = ["layers.2", layers[2:4]]', "layers[2:4]",
     "pipeline.split mixes module names and layer ranges"),
    ("split-glob-point", "base", "split = [layers[0:2], layers[2:4], layers[4:6], layers[6:8]]",
     'split = ["layers.2", layers.*, "layers.6"]', "layers.*",
     "split point 'layers.*' must name one module, not a glob"),
    ("input-dtype", "base", "seq_len = 64 }\n}", "seq_len = 64 }\n  inputs { ids = int65[batch, seq] }\n}",
     "int65", "unknown dtype 'int65'"),
    ("input-dimension", "base", "seq_len = 64 }\n}",
     "seq_len = 64 }\n  inputs { ids = int64[batch, sequence] }\n}", "int64",
     "unknown dimension 'sequence' in input ids"),
    ("token-file-extension", "base", "synthetic(seed = 0, vocab = 256, seq_len = 64)",
     'tokens("data/train.txt", seq_len = 64)', '"data', "token file 'data/train.txt' is not .bin or .npy"),
    ("betas-shape", "base", "adamw(lr = 0.003)", "adamw(lr = 0.003, betas = [0.9])", "[0.9]",
     "train.optimizer.betas must be a list of two numbers"),
    ("model-arg-type", "base", "dim = 64,", "dim = { x = 1 },", "{ x", "model.args.dim must be a number"),
    ("recompute-mode", "base", "mesh { pp = 4 }", "mesh { pp = 4 }\nrecompute { layers.*.mlp = sometimes }",
     "sometimes", "unknown recompute mode 'sometimes'"),
    ("bad-pattern", "base", "mesh { pp = 4 }", 'mesh { pp = 4 }\nexperts { modules = ["layers..moe"] num_experts = 4 }',
     '"layers..moe"', "'layers..moe' is not a module pattern"),
    ("data-not-a-call", "base", "data = synthetic(seed = 0, vocab = 256, seq_len = 64)", "data = 5",
     "data = |5", "data must be one of synthetic(...), tokens(...)"),
    ("section-not-a-block", "base", "mesh { pp = 4 }", "mesh = 4", "mesh = |4", "mesh must be a block"),
    ("checkpoint-missing-dir", "base", "steps = 30", "steps = 30\n  checkpoint { every = 10 }",
     "checkpoint", "checkpoint needs 'dir'"),
    ("costs-negative", "base", "microbatches = 8", "microbatches = 8\n  costs = [[1, 1, 1], [1, -1, 1]]",
     "-1", "pipeline.costs: stage 1 has a negative cost -1"),
    ("costs-not-a-triple", "base", "microbatches = 8", "microbatches = 8\n  costs = [[1, 1, 1], [1, 1]]",
     "[1, 1]]", "pipeline.costs: stage 1 must be [F, B, W] (three numbers)"),
    ("costs-not-a-list", "base", "microbatches = 8", "microbatches = 8\n  costs = 2",
     "costs = |2", "pipeline.costs must be a list of [F, B, W] per stage"),
    ("costs-all-zero", "base", "microbatches = 8", "microbatches = 8\n  costs = [[0, 0, 0]]",
     "[0, 0, 0]", "pipeline.costs: stage 0 costs nothing"),
]

SEMANTIC = [
    ("costs-with-profile", "base", "microbatches = 8", 'microbatches = 8\n  profile = "costs.json"\n'
     "  costs = [[2, 2, 2], [1, 1, 1], [1, 1, 1], [2, 2, 2]]", "costs = |[",
     "set pipeline.costs or pipeline.profile, not both"),
    ("costs-stage-count", "base", "microbatches = 8", "microbatches = 8\n  costs = [[2, 2, 2], [1, 1, 1]]",
     "costs = |[", "pipeline.costs lists 2 stages but the pipeline has 4 (pp = 4 x virtual = 1)"),
    ("dualpipev-2p", "base", "schedule = 1f1b\n  microbatches = 8\n  split = "
     "[layers[0:2], layers[2:4], layers[4:6], layers[6:8]]",
     "schedule = dualpipev\n  microbatches = 4\n  virtual = 2", "microbatches = |4",
     "dualpipev with pp = 4 needs at least 8 microbatches, got 4"),
    ("global-batch-divisible", "base", "global_batch = 16", "global_batch = 12", "global_batch = |12",
     "global_batch = 12 is not divisible by dp * microbatches = 1 * 8"),
    ("count-and-size", "base", "microbatches = 8", "microbatches = 8\n  microbatch_size = 2",
     "microbatch_size = |2", "set pipeline.microbatches or pipeline.microbatch_size, not both"),
    ("zbv-needs-virtual-2", "base", "schedule = 1f1b\n  microbatches = 8\n  split = "
     "[layers[0:2], layers[2:4], layers[4:6], layers[6:8]]",
     "schedule = zbv\n  microbatches = 8\n  virtual = 1", "virtual = |1",
     "zbv needs virtual = 2, got 1"),
    ("auto-takes-virtual-up-to-2", "base", "schedule = 1f1b", "schedule = auto\n  virtual = 3",
     "virtual = |3", "auto takes virtual <= 2, got 3"),
    ("1f1b-with-virtual", "base", "microbatches = 8", "microbatches = 8\n  virtual = 2",
     "virtual = |2", "1f1b needs virtual = 1, got 2"),
    ("interleaved-needs-virtual", "base", "schedule = 1f1b", "schedule = interleaved\n  virtual = 1",
     "virtual = |1", "interleaved needs virtual >= 2, got 1"),
    ("split-point-count", "base", "[layers[0:2], layers[2:4], layers[4:6], layers[6:8]]",
     '["layers.2"]', '["layers', "1 split points make 2 stages, but pp * virtual = 4"),
    ("split-point-twice", "base", "[layers[0:2], layers[2:4], layers[4:6], layers[6:8]]",
     '["layers.2", "layers.2", "layers.4"]', '"layers.2", "layers.4"',
     "split point 'layers.2' is given twice"),
    ("ranges-gap-drops-layers", "base", "layers[2:4]", "layers[3:4]", "layers[3:4]",
     "range layers[3:4] skips the previous one: layers 2..2 would be dropped"),
    ("ranges-overlap", "base", "layers[4:6]", "layers[3:6]", "layers[3:6]",
     "range layers[3:6] overlaps the previous one: layers 3..3 would run twice"),
    ("ranges-short-of-model", "base", "layers[6:8]", "layers[6:7]", "layers[6:7]",
     "the ranges cover 7 layers but model.args.layers = 8"),
    ("ranges-count", "base", "layers[4:6], layers[6:8]", "layers[4:8]", "[layers[0",
     "3 layer ranges for pp * virtual = 4 stages"),
    ("range-empty", "base", "layers[6:8]", "layers[6:6]", "layers[6:6]", "range layers[6:6] is empty"),
    ("memory-limit-below-one", "base", "microbatches = 8", "microbatches = 8\n  memory_limit = 0.5",
     "0.5", "memory_limit = 0.5 microbatches cannot hold one microbatch"),
    ("tensor-without-tp", "base", "mesh { pp = 4 }", "mesh { pp = 4 }\ntensor { column = [layers.*.attn.q] }",
     "[layers.*", "tensor.column does nothing with mesh.tp = 1"),
    ("sequence-parallel-without-tp", "base", "mesh { pp = 4 }",
     "mesh { pp = 4 }\ntensor { sequence_parallel = true }", "true",
     "sequence_parallel does nothing with mesh.tp = 1"),
    ("column-and-row", "base", "mesh { pp = 4 }",
     "mesh { pp = 4  tp = 2 }\ntensor { column = [a.b] row = [c.d, a.b] }", "a.b] }",
     "'a.b' is both column- and row-parallel"),
    ("zero-without-dp", "base", "mesh { pp = 4 }", "mesh { pp = 4 }\nzero = 1", "zero = |1",
     "zero = 1 does nothing with mesh.dp = 1"),
    ("warmup-not-shorter-than-steps", "base", "adamw(lr = 0.003)",
     "adamw(lr = 0.003)\n  lr_schedule = cosine(warmup = 30)", "30)",
     "warm-up of 30 steps is not shorter than steps = 30"),
    ("min-lr-above-lr", "base", "adamw(lr = 0.003)",
     "adamw(lr = 0.003)\n  lr_schedule = cosine(min_lr = 0.01)", "0.01",
     "min_lr = 0.01 is above lr = 0.003"),
    ("checkpoint-never-written", "base", "steps = 30",
     'steps = 30\n  checkpoint { every = 100  dir = "ckpt" }', "100",
     "checkpoint every 100 steps, but training runs 30: none would be written"),
    ("data-vocab-above-model", "base", "vocab = 256, seq_len", "vocab = 512, seq_len", "512",
     "synthetic tokens go up to 511 but model.args.vocab = 256"),
    ("data-longer-than-model", "base", "vocab = 256, seq_len = 64)", "vocab = 256, seq_len = 128)",
     "128", "data.seq_len = 128 is longer than model.args.seq_len = 64"),
    ("ep-divides-dp", "moe", "ep = 2", "ep = 4", "ep = |4", "ep = 4 divides neither dp = 2"),
    # ep = 4 fits dp x tp = 4 (EP across TP); ep = 8 fits neither dp nor dp x tp
    ("ep-not-across-tp", "moe", "dp = 2  ep = 2", "dp = 2  tp = 2  ep = 8", "ep = |8",
     "ep = 8 divides neither dp = 2 nor dp x tp = 4"),
    ("ep-without-experts", "moe", "experts {\n  modules = [layers.*.moe]\n  num_experts = 4\n"
     "  top_k = 2\n}\n", "", "ep = |2", "ep = 2 but the plan has no experts section"),
    ("ep-divides-experts", "moe", "dp = 2  ep = 2", "dp = 8  ep = 8",
     "num_experts = |4\n", "ep = 8 does not divide num_experts = 4"),
    ("top-k-above-experts", "moe", "top_k = 2\n}", "top_k = 8\n}", "top_k = |8",
     "top_k = 8 is more than num_experts = 4"),
    ("capacity-with-dropless", "moe", "top_k = 2\n}", "top_k = 2\n  capacity_factor = 1.25\n}",
     "1.25", "capacity_factor does nothing with dropless = true"),
    ("dropping-needs-capacity", "moe", "top_k = 2\n}", "top_k = 2\n  dropless = false\n}", "false",
     "dropless = false needs a capacity_factor"),
    ("drop-policy-with-dropless", "moe", "top_k = 2\n}", "top_k = 2\n  drop_policy = position\n}",
     "position", "drop_policy does nothing with dropless = true"),
    ("experts-disagree-with-model", "moe", "top_k = 2\n}", "top_k = 1\n}", "top_k = |1",
     "experts.top_k = 1 but model.args.top_k = 2"),
]


def _edit(plans, case):
    name, which, old, new, needle, message = case
    text = plans[which]
    assert old in text, f"case {name}: {old!r} not in the plan"
    return text.replace(old, new, 1), needle, message


@pytest.fixture
def plans(base, moe):
    return {"base": base, "moe": moe}


@pytest.mark.parametrize("case", SYNTAX + SCHEMA + SEMANTIC, ids=lambda c: c[0])
def test_error_points_at_the_line(case, plans, errors_of, pos):
    text, needle, message = _edit(plans, case)
    found = errors_of(text, path="t.plan")
    line, col = pos(text, needle.replace("|", ""))
    col += max(needle.find("|"), 0)
    assert ("t.plan", line, col, message) in [(f, ln, c, m[: len(message)]) for f, ln, c, m in found], found


@pytest.mark.parametrize("case", SYNTAX + SCHEMA + SEMANTIC, ids=lambda c: c[0])
def test_check_command_exits_2_with_the_location(case, plans, tmp_path, capsys):
    text, _, message = _edit(plans, case)
    path = tmp_path / "broken.plan"
    path.write_text(text)
    assert main(["check", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}:" in err and ": error: " + message in err and "Traceback" not in err


def test_every_error_has_a_hint_where_a_fix_is_known(base, errors_of):
    with pytest.raises(PlanError) as info:
        parse_plan(base.replace("microbatches = 8", "microbatch = 8"), "t.plan")
    (d,) = info.value.diagnostics
    assert d.hint == "did you mean 'microbatches'?"


def test_too_few_microbatches_explains_the_hang(base):
    text = base.replace("schedule = 1f1b\n  microbatches = 8", "schedule = dualpipev\n  microbatches = 4")
    with pytest.raises(PlanError) as info:
        parse_plan(text.replace("split = [layers[0:2], layers[2:4], layers[4:6], layers[6:8]]",
                                "split = auto"), "t.plan")
    (d,) = info.value.diagnostics
    assert d.message == "dualpipev with pp = 4 needs at least 8 microbatches, got 4"
    assert "blocking forever on a receive no rank will send" in d.hint and "microbatches >= 8" in d.hint


def test_fewer_microbatches_than_ranks_is_fine_for_1f1b(base):
    """pipeplan's 1F1B clamps its warm-up, so m < pp cannot hang (torchtitan #775): accepted."""
    plan = parse_plan(base.replace("microbatches = 8", "microbatches = 2"), "t.plan")
    assert (plan.microbatches, plan.microbatch_size) == (2, 8)


def test_unexpected_end_of_file_points_past_the_last_line(base, errors_of):
    text = base[: base.rindex("}")]
    (found,) = errors_of(text, path="t.plan")
    last = text.splitlines()[-1]
    assert found == ("t.plan", len(text.splitlines()), len(last) + 1, "unexpected end of file")


def test_rendered_error_has_location_line_caret_and_hint(base):
    text = base.replace("microbatches = 8", "microbatch = 8")
    with pytest.raises(PlanError) as info:
        parse_plan(text, "t.plan")
    assert str(info.value) == (
        "t.plan:9:3: error: unknown key 'microbatch' in pipeline\n"
        "      microbatch = 8\n"
        "      ^^^^^^^^^^\n"
        "  hint: did you mean 'microbatches'?")


def test_independent_errors_are_all_reported_in_file_order(base, errors_of):
    text = (base.replace("pp = 4", "pp = 4  ep = 3")
            .replace("schedule = 1f1b", "schedule = 1f1c")
            .replace("steps = 30", "steps = -1"))
    found = errors_of(text, path="t.plan")
    assert [m.split(" ")[0:2] for _, _, _, m in found] == [
        ["ep", "="], ["ep", "="], ["unknown", "schedule"], ["train.steps", "must"]]
    assert [ln for _, ln, _, _ in found] == sorted(ln for _, ln, _, _ in found)


def test_a_failed_key_does_not_cause_knock_on_errors(base, errors_of):
    # microbatches is unreadable: no "global batch not divisible" or "too few" error follows
    found = errors_of(base.replace("microbatches = 8", 'microbatches = "8"'), path="t.plan")
    assert [m for *_, m in found] == ['pipeline.microbatches must be an integer, got the string "8"']


def test_world_size_must_match_the_launcher(base, errors_of, pos):
    found = errors_of(base, path="t.plan", world_size=8)
    assert found == [("t.plan", *pos(base, "mesh"),
                      "the plan needs pp*dp*tp = 4*1*1 = 4 ranks but the launcher started 8")]
    assert parse_plan(base, world_size=4).mesh.world_size == 4


def test_check_plan_rejects_options_a_file_cannot_even_write(base):
    plan = parse_plan(base)
    train = plan.train
    constant_with_floor = dataclasses.replace(
        plan, train=dataclasses.replace(train, lr_schedule=dataclasses.replace(
            train.lr_schedule, min_lr=0.1)))
    with pytest.raises(PlanError, match="min_lr does nothing with a constant schedule"):
        check_plan(constant_with_floor)
    adam_momentum = dataclasses.replace(
        plan, train=dataclasses.replace(train, optimizer=dataclasses.replace(
            train.optimizer, momentum=0.9)))
    with pytest.raises(PlanError, match="momentum does nothing with adamw"):
        check_plan(adam_momentum)
    check_plan(plan, world_size=4)


def test_absurd_nesting_is_an_error_not_a_crash(errors_of):
    text = 'model { source = "m.py:M"  args = { x = ' + "[" * 5000 + "]" * 5000 + " } }"
    assert errors_of(text, path="t.plan") == [("t.plan", 1, 1, "the plan is nested too deeply")]


def test_a_missing_plan_file_exits_2(tmp_path, capsys):
    missing = tmp_path / "nope.plan"
    assert main(["check", str(missing)]) == 2
    assert f"{missing}:1:1: error: cannot read plan file: No such file or directory" in \
        capsys.readouterr().err
