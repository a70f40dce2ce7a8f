"""End to end from text: a corpus and a tokenizer written by the test -> `pipeplan run`.

Run A trains 20 steps on two processes (pp2) with the held-out loss every 5
steps, logging to metrics.jsonl and TensorBoard, checkpointing every 7 steps.
Its TensorBoard event file is read back with TensorBoard's own reader and holds
the JSONL's rows under the same names (plus the run's bubble and memory per
rank). Run B, from another folder (its own token cache: tokenised again),
resumes A's checkpoint after step 7, in the middle of the first epoch, and
continues at the exact window: its losses of steps 8..20 and its held-out
losses are bitwise A's. B logs to TensorBoard only, so its log_dir has no
metrics.jsonl (its rows go to --metrics).
"""
from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ..compiler.text_corpus import build_tokenizer, documents, write_text

REPO = Path(__file__).resolve().parents[2]
PLAN = """\
model {{
  source = "{repo}/examples/models/gpt.py:GPT"
  args = {{ vocab = 32, dim = 32, layers = 2, heads = 2, seq_len = 16 }}
  capture = fx
}}
data = text(["{corpus}"], tokenizer = "{tokenizer}", eos = "<eos>", seq_len = 16,
            holdout = 0.1)
mesh {{ pp = 2 }}
pipeline {{ schedule = 1f1b  microbatches = 2 }}
train {{
  steps = 20
  global_batch = 4
  grad_clip = 1.0
  optimizer = adamw(lr = 0.01)
  eval {{ every = 5  batches = 2 }}
  checkpoint {{ every = 7  dir = "ckpt"  keep = 3 }}
  log_dir = "logs"
  log = [{log}]
}}
"""


def run(cwd: Path, *args) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "pipeplan", "run", *map(str, args)], cwd=cwd,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return r


def rows(path: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, path.read_text().splitlines())}


def scalars(folder: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


@pytest.mark.heavy  # two launches of 2 ranks: ~35 s of CPU, minutes on a shared machine
@pytest.mark.timeout(900)
def test_text_to_a_run_with_eval_tensorboard_and_exact_resume(tmp_path):
    docs = documents(200)
    corpus = write_text(tmp_path / "corpus.txt", docs)
    tok_json, _ = build_tokenizer(tmp_path / "tok", docs)
    a, b = tmp_path / "a", tmp_path / "b"
    for folder, log in ((a, "jsonl, tensorboard"), (b, "tensorboard")):
        folder.mkdir()
        (folder / "run.plan").write_text(PLAN.format(repo=REPO, corpus=corpus,
                                                     tokenizer=tok_json, log=log))
    first = run(a, "run.plan")
    assert "launching 2 local processes" in first.stdout
    got = rows(a / "logs" / "metrics.jsonl")
    assert sorted(got) == list(range(1, 21))
    held = {s: r["eval_loss"] for s, r in got.items() if "eval_loss" in r}
    assert sorted(held) == [5, 10, 15, 20] and held[20] < held[5] < got[1]["loss"]
    for r in got.values():
        if "eval_loss" in r:
            assert r["eval_perplexity"] == pytest.approx(math.exp(r["eval_loss"]), rel=1e-12)
    assert f"eval_loss {held[5]:.4f}" in first.stdout  # the progress line shows it

    # TensorBoard, read back with its own reader: the JSONL's rows under the same names
    tb = scalars(a / "logs" / "tensorboard")
    for name in ("loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "eval_loss",
                 "eval_perplexity"):
        want = {s: r[name] for s, r in got.items() if name in r}
        assert tb[name].keys() == want.keys(), name
        for s, v in want.items():
            assert tb[name][s] == pytest.approx(v, rel=1e-6), (name, s)  # float32 in events
    bubble = json.loads((a / "logs" / "bubble.json").read_text())["measured"]
    assert tb["bubble"][20] == pytest.approx(bubble, rel=1e-6)
    memory = json.loads((a / "logs" / "memory.json").read_text())
    for m in memory:
        assert tb[f"memory/rank{m['rank']}/peak"][20] == pytest.approx(m["peak"], rel=1e-6)

    # resume after step 7 (mid-epoch: ~46 steps make one) from A's checkpoint, elsewhere
    (b / "ckpt").mkdir()
    shutil.copytree(a / "ckpt" / "step_000007", b / "ckpt" / "step_000007")
    second = run(b, "run.plan", "--metrics", b / "m.jsonl")
    assert "after step 7" in second.stdout, second.stdout
    resumed = rows(b / "m.jsonl")
    assert sorted(resumed) == list(range(8, 21))
    for s in range(8, 21):
        assert resumed[s]["loss"] == got[s]["loss"], s  # bitwise: the same windows, in order
        assert resumed[s].get("eval_loss") == got[s].get("eval_loss"), s
    assert not (b / "logs" / "metrics.jsonl").exists()  # log = [tensorboard]: no JSONL
    assert sorted(scalars(b / "logs" / "tensorboard")["loss"]) == list(range(8, 21))
