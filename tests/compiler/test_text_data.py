"""`data = text(...)`: documents -> a Hugging Face tokenizer -> one cached token file.

References share no code with pipeplan's: the documents the test wrote, and
`tokenizers` encoding each one (+ EOS) itself. Checked: every input kind (plain
text, JSONL field, Parquet column, a `save_to_disk` dataset folder) gives the
same tokens; the held-out split takes whole documents, a seeded choice; the
cache is keyed by the inputs' contents (reused when unchanged, remade when an
input changes); the run's windows are the file's, each once per epoch in a
seeded order (file order with shuffle = false); bad input is refused by
`pipeplan check` at the plan line with a caret and no traceback.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeplan.backends.runtime import data
from pipeplan.cli import main
from pipeplan.compiler.data import check_data
from pipeplan.dsl import PlanError, parse_plan

from .text_corpus import build_tokenizer, documents, reference_tokens, write_jsonl, write_text

SEQ, BATCH = 8, 4
PLAN = """\
model {{
  source = "{repo}/examples/models/gpt.py:GPT"
  args = {{ vocab = {vocab}, dim = 16, layers = 2, heads = 2, seq_len = 8 }}
}}
data = text({files}, tokenizer = "{tokenizer}", seq_len = 8{extra})
train {{ steps = {steps}  global_batch = 4{train} }}
"""
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    docs = documents(60)
    tok_json, tok_dir = build_tokenizer(root / "tok", docs)
    return root, docs, tok_json, tok_dir


def plan_at(folder: Path, files, tokenizer, extra: str = ', eos = "<eos>"', steps: int = 2,
            vocab: int = 64, train: str = "", name: str = "p.plan", parse: bool = True):
    text = PLAN.format(repo=REPO, vocab=vocab, files=json.dumps([str(f) for f in files]),
                       tokenizer=tokenizer, extra=extra, steps=steps, train=train)
    path = folder / name
    path.write_text(text)
    return (parse_plan(text, str(path)) if parse else None), path


def cache_ids(plan) -> tuple[np.ndarray, dict]:
    cache = check_data(plan)
    return np.load(cache.path), cache


def test_every_input_kind_gives_each_document_then_eos(corpus, tmp_path):
    root, docs, tok_json, tok_dir = corpus
    want = np.concatenate([np.array(t) for t in reference_tokens(tok_json, docs)])
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": docs, "n": list(range(len(docs)))}), tmp_path / "c.parquet")
    datasets.Dataset.from_dict({"body": docs}).save_to_disk(str(tmp_path / "saved"))
    inputs = {
        "txt": ([write_text(tmp_path / "c.txt", docs)], ""),
        "jsonl": ([write_jsonl(tmp_path / "c.jsonl", docs, "body")], ', field = "body"'),
        "parquet": ([tmp_path / "c.parquet"], ', field = "body"'),
        "datasets": ([tmp_path / "saved"], ', field = "body"'),
        "two files": ([write_text(tmp_path / "a.txt", docs[:25]),
                       write_jsonl(tmp_path / "b.jsonl", docs[25:])], ""),
    }
    for name, (files, extra) in inputs.items():
        plan, _ = plan_at(tmp_path, files, tok_json, ', eos = "<eos>"' + extra, name=f"{name}.plan")
        ids, cache = cache_ids(plan)
        assert np.array_equal(ids, want), name
        assert (cache.split, cache.documents, cache.eos) == (len(want), len(docs), 1), name
    # the save_pretrained folder: the same ids, its eos_token found without `eos`
    plan, _ = plan_at(tmp_path, [tmp_path / "c.txt"], tok_dir, extra="", name="folder.plan")
    assert np.array_equal(cache_ids(plan)[0], want)


def test_holdout_takes_whole_documents_a_seeded_choice(corpus, tmp_path):
    root, docs, tok_json, _ = corpus
    txt = write_text(tmp_path / "c.txt", docs)
    per_doc = [tuple(t) for t in reference_tokens(tok_json, docs)]
    held_sets = []
    for seed in (0, 0, 1):
        plan, _ = plan_at(tmp_path, [txt], tok_json, ', eos = "<eos>", holdout = 0.1',
                          train=f"  seed = {seed}", name=f"s{seed}.plan")
        ids, cache = cache_ids(plan)
        assert cache.held_out_documents == 6 and cache.documents == 60
        # split both parts back into documents at each EOS: every document once, whole
        parts = [_split_docs(ids[:cache.split]), _split_docs(ids[cache.split:])]
        assert sorted(parts[0] + parts[1]) == sorted(per_doc)
        assert len(parts[1]) == 6
        assert parts[0] == [d for d in per_doc if d not in parts[1]]  # the rest, in order
        held_sets.append(parts[1])
    assert held_sets[0] == held_sets[1] and held_sets[0] != held_sets[2]


def _split_docs(ids: np.ndarray) -> list[tuple]:
    out, start = [], 0
    for i in np.flatnonzero(ids == 1):
        out.append(tuple(int(x) for x in ids[start:i + 1]))
        start = i + 1
    assert start == len(ids)
    return out


def test_the_cache_is_reused_until_an_input_changes(corpus, tmp_path):
    _, docs, tok_json, _ = corpus
    txt = write_text(tmp_path / "c.txt", docs)
    plan, _ = plan_at(tmp_path, [txt], tok_json)
    first = check_data(plan)
    stamp = os.stat(first.path).st_mtime_ns
    again = check_data(plan)
    assert again.path == first.path and os.stat(again.path).st_mtime_ns == stamp
    os.utime(txt)  # touched, same content: found by content, not tokenised again
    assert check_data(plan).path == first.path and os.stat(first.path).st_mtime_ns == stamp
    write_text(txt, docs[:-1])  # changed content: a new token file
    changed = check_data(plan)
    assert changed.path != first.path and changed.documents == len(docs) - 1
    assert sorted(p.name for p in (tmp_path / ".pipeplan-cache").glob("*.npy")) == \
        sorted({Path(first.path).name, Path(changed.path).name})
    moved, _ = plan_at(tmp_path, [txt], tok_json, ', eos = "<eos>", cache = "elsewhere/tokens"',
                       name="moved.plan")
    there = check_data(moved)
    assert Path(there.path).parent == tmp_path / "elsewhere" / "tokens"
    assert np.array_equal(np.load(there.path), np.load(changed.path))


def test_windows_each_once_per_epoch_in_a_seeded_order(corpus, tmp_path):
    _, docs, tok_json, _ = corpus
    txt = write_text(tmp_path / "c.txt", docs)
    plan, _ = plan_at(tmp_path, [txt], tok_json, ', eos = "<eos>", wrap = true', steps=40)
    ids, cache = cache_ids(plan)
    once, _ = plan_at(tmp_path, [txt], tok_json, steps=40, name="once.plan")  # no wrap
    with pytest.raises(PlanError, match=r"read 160 \(1\.4 epochs\)"):
        check_data(once)
    windows = ids[:cache.split // (SEQ + 1) * (SEQ + 1)].reshape(-1, SEQ + 1).astype(np.int64)
    n = len(windows)
    read = np.concatenate([data.global_batch(plan, t).input_ids.numpy() for t in range(40)])
    targets = np.concatenate([data.global_batch(plan, t).targets.numpy() for t in range(40)])
    assert np.array_equal(read[:, 1:], targets[:, :-1])
    rows = [tuple(r) for r in np.concatenate([read, targets[:, -1:]], axis=1)]
    every = sorted(tuple(w) for w in windows)
    for e in range(len(rows) // n):  # each full epoch: every window once
        assert sorted(rows[e * n:(e + 1) * n]) == every
    in_order = [tuple(w) for w in windows]
    assert rows[:n] != in_order and rows[:n] != rows[n:2 * n]  # shuffled, anew each epoch
    same, _ = plan_at(tmp_path, [txt], tok_json, ', eos = "<eos>", wrap = true', steps=40,
                      name="same.plan")
    assert torch.equal(data.global_batch(same, 3).input_ids, data.global_batch(plan, 3).input_ids)
    ordered, _ = plan_at(tmp_path, [txt], tok_json, ', eos = "<eos>", shuffle = false',
                         name="ordered.plan")
    assert np.array_equal(data.global_batch(ordered, 1).input_ids.numpy(),
                          windows[BATCH:2 * BATCH, :-1])
    seeded, _ = plan_at(tmp_path, [txt], tok_json, ', eos = "<eos>", wrap = true', steps=40,
                        train="  seed = 5", name="seeded.plan")
    assert not torch.equal(data.global_batch(seeded, 0).input_ids,
                           data.global_batch(plan, 0).input_ids)


BAD = {  # name -> (files, extra, plan vocab, what stderr says, the text the caret is under)
    "missing file": (["nope.txt"], ', eos = "<eos>"', 64, "does not exist", '"nope.txt"'),
    "empty text": (["empty.txt"], ', eos = "<eos>"', 64, "holds no text", '"empty.txt"'),
    "unknown field": (["c.jsonl"], ', eos = "<eos>", field = "body"', 64,
                      "has no field 'body' (it has: id, text)", '"body"'),
    "unknown column": (["c.parquet"], ', eos = "<eos>", field = "body"', 64,
                       "has no column 'body' (it has: text)", '"body"'),
    "vocab too big": (["c.txt"], ', eos = "<eos>"', 16, "the tokenizer has", '"TOK"'),
    "no eos": (["c.txt"], "", 64, "names no end-of-document token", '"TOK"'),
    "eos not a token": (["c.txt"], ', eos = "</s>"', 64, "'</s>' is not a token", '"</s>"'),
    "no held-out text": (["c.txt"], ', eos = "<eos>"', 64,
                         "eval reads held-out documents", "eval"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_text_input_is_refused_at_the_data_line(corpus, tmp_path, capsys, name):
    _, docs, tok_json, _ = corpus
    write_text(tmp_path / "c.txt", docs)
    write_jsonl(tmp_path / "c.jsonl", docs)
    (tmp_path / "empty.txt").write_text("\n\n  \n")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": docs}), tmp_path / "c.parquet")
    files, extra, vocab, says, under = BAD[name]
    train = "  eval { every = 1 }" if name == "no held-out text" else ""
    _, path = plan_at(tmp_path, files, tok_json, extra, vocab=vocab, train=train, parse=False)
    assert main(["check", str(path), "--no-model"]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err, err
    line = next(x for x in err.splitlines() if x.startswith("    ") and "^" not in x)
    caret = next(x for x in err.splitlines() if x.strip().startswith("^"))
    start = caret.index("^")
    assert line[start:start + len(caret.strip())] == under.replace("TOK", str(tok_json)), err
    assert err.startswith(f"{path}:"), err
