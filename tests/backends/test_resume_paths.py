"""Relative checkpoint.dir and log_dir resolve against the plan file (not the working
directory), and a resumed run continues its step numbering and metrics without repeats
or lr_scheduler warnings."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

PLAN = f"""\
model {{
  source = "{REPO / 'examples/models/gpt.py'}:GPT"
  args = {{ vocab = 32, dim = 16, layers = 2, heads = 2, seq_len = 8 }}
  capture = fx
}}
data = synthetic(seed = 2, vocab = 32, seq_len = 8)
mesh {{ pp = 2 }}
pipeline {{ schedule = 1f1b  microbatches = 2 }}
train {{
  steps = 5
  global_batch = 4
  optimizer = adamw(lr = 0.01)
  lr_schedule = cosine(warmup = 1)
  checkpoint {{ every = 2  dir = "ckpt"  keep = 1 }}
  log_dir = "logs"
}}
"""


def run(cwd: Path, *args) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "pipeplan", "run", *map(str, args)], cwd=cwd,
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    return r


@pytest.mark.heavy  # suite time: run with -m heavy
@pytest.mark.slow
def test_resume_from_another_directory_continues_the_same_run(tmp_path):
    plans, here, there = tmp_path / "plans", tmp_path / "here", tmp_path / "there"
    for d in (plans, here, there):
        d.mkdir()
    plan = plans / "p.plan"
    plan.write_text(PLAN)
    run(here, plan, "--steps", 3)  # checkpoint after step 2; metrics for steps 1..3
    assert (plans / "ckpt" / "step_000002").is_dir() and not (here / "ckpt").exists()
    assert (plans / "logs" / "metrics.jsonl").is_file() and not (here / "logs").exists()
    r = run(there, plan)  # resumes after step 2 from the plan's folder, trains 3..5
    assert "resumed from" in r.stdout and "after step 2" in r.stdout, r.stdout
    steps = [json.loads(line)["step"] for line in
             (plans / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5]  # step 3 trained twice, recorded once
    assert "median of steps 4-5)" in r.stdout, r.stdout  # the bubble line numbers the run's steps
    assert "median of steps 4-5: the ranks' processes" in r.stdout, r.stdout  # and the CPU's
    assert "lr_scheduler.step()" not in r.stderr, r.stderr
    assert sorted(p.name for p in (plans / "ckpt").iterdir()) == ["step_000004"]
