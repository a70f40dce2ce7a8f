"""A Hugging Face model named by its folder (`model { source = "FOLDER" }`), trained on
text, with the held-out loss measured through the pipeline (`train.eval`).

The folder is transformers' own: a tiny LlamaForCausalLM drawn under another seed
and written by `save_pretrained`; the text and its tokenizer are written by the
test (tests/compiler/text_corpus.py). References share no code with pipeplan:
transformers' `from_pretrained` in float64, torch's cross entropy, and the
held-out windows read straight from the token file.

* One 2-process pp2 run (fp64): the held-out loss before training equals
  `from_pretrained`'s on the same windows; step 1's loss equals
  `from_pretrained`'s on step 1's windows; the held-out loss after step 1 equals
  a single-process evaluation of the run's own parameters after it.
* Without `weights`, the folder's config builds the model (random init) and
  `args` override config fields; a folder without config.json is refused at the
  source line.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pipeplan.cli import main

from ..compiler.text_corpus import build_tokenizer, documents, write_text
from .conftest import spawn

TOL = dict(rel=1e-9, abs=1e-12)
SEQ, BATCH, EVAL_BATCHES = 16, 4, 2
PLAN = """\
model {{ source = "llama"{weights}{args} }}
data = text(["c.txt"], tokenizer = "tok/pretrained", seq_len = 16, holdout = 0.1)
mesh {{ pp = 2 }}
pipeline {{ schedule = 1f1b  microbatches = 2 }}
train {{
  steps = 2
  global_batch = 4
  precision = fp64
  optimizer = adamw(lr = 0.01)
  eval {{ every = 1  batches = 2 }}
}}
"""


def llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       use_cache=False, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    from transformers import LlamaForCausalLM

    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(123)  # not pipeplan's per-module seeds: loading must show
    LlamaForCausalLM(llama_config()).save_pretrained(root / "llama")
    docs = documents(80)
    write_text(root / "c.txt", docs)
    build_tokenizer(root / "tok", docs)
    return root


def write_plan(root: Path, weights: bool = True, args: str = "", name: str = "p.plan") -> Path:
    path = root / name
    path.write_text(PLAN.format(weights='  weights = "llama"' if weights else "",
                                args=f"  args = {{ {args} }}" if args else ""))
    return path


def _run(rank, world, plan_path):
    from pipeplan.backends.runtime.trainer import PipelineTrainer
    from pipeplan.dsl.load import load_plan

    trainer = PipelineTrainer.for_plan(load_plan(str(plan_path)).with_resolved_paths())
    before = trainer.evaluate(EVAL_BATCHES)
    loss = trainer.step(0).loss
    after = trainer.evaluate(EVAL_BATCHES)
    return {"before": before, "loss": loss, "after": after,
            "params": {k: v.detach().cpu() for k, v in trainer.named_parameters().items()}}


def held_out_windows(plan) -> torch.Tensor:
    """The first EVAL_BATCHES x BATCH held-out windows, read from the token file itself."""
    from pipeplan.compiler.data import check_data

    cache = check_data(plan)
    meta = json.loads(Path(cache.path).with_suffix(".json").read_text())
    ids = np.load(cache.path)[meta["split"]:]
    windows = ids[:len(ids) // (SEQ + 1) * (SEQ + 1)].reshape(-1, SEQ + 1)
    assert len(windows) >= EVAL_BATCHES * BATCH
    return torch.from_numpy(windows[:EVAL_BATCHES * BATCH].astype(np.int64))


def mean_loss(model, windows: torch.Tensor) -> float:
    """The mean over batches of BATCH windows of the batch's mean cross entropy."""
    losses = []
    with torch.no_grad():
        for rows in windows.split(BATCH):
            logits = model(rows[:, :-1]).logits
            losses.append(float(F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten())))
    return sum(losses) / len(losses)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_folder_trains_pp2_from_its_weights_and_evaluates_as_one_process(folder):
    from transformers import LlamaForCausalLM

    from pipeplan.backends.runtime import data
    from pipeplan.dsl.load import load_plan

    path = write_plan(folder)
    assert main(["check", str(path), "--no-model"]) == 0  # tokenises before launch
    plan = load_plan(str(path))
    held = held_out_windows(plan)
    results = spawn(_run, 2, path, timeout=240)
    ref = LlamaForCausalLM.from_pretrained(folder / "llama", dtype=torch.float64)
    assert results[0]["before"] == pytest.approx(mean_loss(ref, held), **TOL)
    batch = data.global_batch(plan, 0)
    with torch.no_grad():
        logits = ref(batch.input_ids).logits
    step1 = float(F.cross_entropy(logits.flatten(0, 1), batch.targets.flatten()))
    assert results[0]["loss"] == pytest.approx(step1, **TOL)
    for key in ("before", "loss", "after"):
        assert results[1][key] == results[0][key]
    trained = LlamaForCausalLM(llama_config()).double()
    params = {**results[0]["params"], **results[1]["params"]}
    trained.load_state_dict(params, strict=True)
    assert not torch.equal(params["model.embed_tokens.weight"],
                           ref.model.embed_tokens.weight)  # a step was taken
    assert results[0]["after"] == pytest.approx(mean_loss(trained, held), **TOL)
    assert results[0]["after"] < results[0]["before"]


def test_without_weights_the_config_builds_it_and_args_override_fields(folder, capsys):
    from pipeplan.backends.state.model import build_model
    from pipeplan.dsl.load import load_plan

    model = build_model(load_plan(str(write_plan(folder, weights=False))))
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config.num_hidden_layers == 2 and len(model.model.layers) == 2
    stored = stored_embedding(folder / "llama")
    assert not torch.equal(model.model.embed_tokens.weight, stored)  # random, not the file's
    one = build_model(load_plan(str(write_plan(folder, False, "num_hidden_layers = 1", "o.plan"))))
    assert len(one.model.layers) == 1
    bad = write_plan(folder, False, "num_hiden_layers = 1", "b.plan")
    assert main(["check", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "has no field 'num_hiden_layers'" in err and "did you mean 'num_hidden_layers'" in err
    (folder / "empty").mkdir(exist_ok=True)
    nowhere = folder / "n.plan"
    nowhere.write_text(PLAN.format(weights="", args="").replace('"llama"', '"empty"'))
    assert main(["check", str(nowhere)]) == 2
    err = capsys.readouterr().err
    assert "has no config.json" in err and f"{nowhere}:1:" in err and "^" in err, err
    assert "Traceback" not in err


def stored_embedding(path: Path) -> torch.Tensor:
    from safetensors.torch import load_file

    return load_file(path / "model.safetensors")["model.embed_tokens.weight"]


def test_a_build_directory_keeps_pointing_at_the_folder_and_the_text(folder):
    """`pipeplan compile -o DIR`: the plan copy in DIR names the same model folder, text,
    tokenizer and token cache (its paths rewritten relative to DIR)."""
    from pipeplan.dsl.load import load_plan

    path = write_plan(folder, name="b.plan")
    out = folder / "build" / "deep"
    assert main(["compile", str(path), "-o", str(out)]) == 0
    plan, copy = load_plan(str(path)), load_plan(str(out / "plan.plan"))
    assert copy.model.source != plan.model.source  # rewritten, relative to the build
    for get in (lambda p: p.model.source, lambda p: p.model.weights, lambda p: p.data.files[0],
                lambda p: p.data.tokenizer, lambda p: p.data.cache):
        assert copy.resolve_path(get(copy)) == plan.resolve_path(get(plan))


DOC_PLAN = """\
model {
  source = "llama"
  weights = "llama"
  inputs = { input_ids = int64[batch, seq], position_ids = int64[batch, seq] }
}
data = text(["c.txt"], tokenizer = "tok/pretrained", seq_len = 16, shuffle = false,
            inputs = { position_ids = document_positions })
mesh { pp = 2 }
pipeline { schedule = 1f1b  microbatches = 2 }
train { steps = 1  global_batch = 4  precision = fp64  optimizer = adamw(lr = 0.01) }
"""


def _documents_in(plan, batch):
    """(row, start) of a document that begins inside a row of `batch`, after an EOS."""
    from pipeplan.backends.runtime.data import text_cache

    eos = text_cache(plan).eos
    for r, row in enumerate(batch.input_ids):
        inside = (row[:-2] == eos).nonzero().flatten()
        if len(inside):
            return r, int(inside[-1]) + 1
    raise AssertionError("no window holds two documents")


def test_document_positions_keep_packed_documents_apart(folder, capsys):
    """`position_ids = document_positions`: positions restart after each EOS, and the model
    (transformers' own packed-sequence mask, built from them) computes a document that
    starts mid-window exactly as it computes that document alone; plain positions do not.
    Synthetic data or context parallel with document_positions are refused at their line."""
    from transformers import LlamaForCausalLM

    from pipeplan.backends.runtime import data
    from pipeplan.dsl.load import load_plan

    path = folder / "d.plan"
    path.write_text(DOC_PLAN)
    assert main(["check", str(path), "--no-model"]) == 0
    plan = load_plan(str(path))
    batch = data.global_batch(plan, 0)
    pos = batch.field("position_ids")
    r, start = _documents_in(plan, batch)
    assert pos[r, start] == 0 and pos[r, start - 1] > 0
    assert torch.equal(pos[r, start:], torch.arange(SEQ - start))
    ref = LlamaForCausalLM.from_pretrained(folder / "llama", dtype=torch.float64)
    row = batch.input_ids[r:r + 1]
    with torch.no_grad():
        packed = ref(input_ids=row, position_ids=pos[r:r + 1]).logits[0, start:]
        alone = ref(input_ids=row[:, start:]).logits[0]
        plain = ref(input_ids=row).logits[0, start:]
    assert torch.allclose(packed, alone, rtol=1e-10, atol=1e-12)
    assert not torch.allclose(plain, alone, rtol=1e-3)
    bad = folder / "ds.plan"
    bad.write_text(DOC_PLAN.replace('text(["c.txt"], tokenizer = "tok/pretrained", seq_len = 16, '
                                    'shuffle = false,', 'synthetic(vocab = 64, seq_len = 16,'))
    assert main(["check", str(bad), "--no-model"]) == 2
    err = capsys.readouterr().err
    assert "only data = text(...) knows where documents end" in err and "^" in err
    cp = folder / "dc.plan"
    cp.write_text(DOC_PLAN.replace("mesh { pp = 2 }", "mesh { pp = 2  cp = 2 }"))
    assert main(["check", str(cp), "--no-model"]) == 2
    assert "a context-parallel rank's slice of a row cannot" in capsys.readouterr().err


def _step(rank, world, plan_path):
    from pipeplan.backends.runtime.trainer import PipelineTrainer
    from pipeplan.dsl.load import load_plan

    return PipelineTrainer.for_plan(load_plan(str(plan_path)).with_resolved_paths()).step(0).loss


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_document_positions_train_pp2_as_transformers_computes_them(folder):
    """Step 1 of a pp2 run fed document positions: the loss of transformers'
    `from_pretrained` given the same input ids and position ids (float64)."""
    from transformers import LlamaForCausalLM

    from pipeplan.backends.runtime import data
    from pipeplan.dsl.load import load_plan

    path = folder / "d2.plan"
    path.write_text(DOC_PLAN)
    assert main(["check", str(path), "--no-model"]) == 0
    plan = load_plan(str(path))
    batch = data.global_batch(plan, 0)
    _documents_in(plan, batch)  # the step's windows do pack documents
    losses = spawn(_step, 2, path, timeout=240)
    ref = LlamaForCausalLM.from_pretrained(folder / "llama", dtype=torch.float64)
    with torch.no_grad():
        logits = ref(input_ids=batch.input_ids, position_ids=batch.field("position_ids")).logits
    expected = float(F.cross_entropy(logits.flatten(0, 1), batch.targets.flatten()))
    assert losses[0] == pytest.approx(expected, **TOL) and losses[1] == losses[0]
