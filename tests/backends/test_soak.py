"""Soak: 200 steps, a checkpoint every 20, three SIGKILLs of a random rank, automatic resume.

Not in the default suite (minutes): run it by name,

    python -m pytest -m heavy -k soak -s tests/backends/test_soak.py

A pp2 x dp2 ZeRO-3 run (sharded checkpoints, world 4) of a small GPT trains
200 steps uninterrupted (the reference), then again with `checkpoint { every
= 20 }`: each time a new checkpoint has appeared since the last (re)start, a
random rank is killed with SIGKILL after a random delay (possibly in the
middle of a checkpoint write), the launcher stops the others, and the run is
started again, resuming from the newest complete checkpoint. After the third
kill it runs to the end. Every final parameter must be bitwise equal to the
uninterrupted run's; the runtime is printed.
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pipeplan.tests.backends.local_ranks import ranks_of

REPO = Path(__file__).resolve().parents[2]
STEPS, EVERY, KILLS = 200, 20, 3

PLAN = f"""\
model {{
  source = "{REPO / 'examples/models/gpt.py'}:GPT"
  args = {{ vocab = 32, dim = 16, layers = 4, heads = 2, seq_len = 8 }}
  capture = fx
}}
data = synthetic(seed = 3, vocab = 32, seq_len = 8)
mesh {{ pp = 2  dp = 2 }}
pipeline {{ schedule = 1f1b  microbatches = 2 }}
zero = 3
train {{
  steps = {STEPS}
  global_batch = 8
  optimizer = adamw(lr = 0.003)
  lr_schedule = cosine(warmup = 10)
  grad_clip = 1.0
CHECKPOINT}}
"""


def _launch(plan: Path, dump: Path) -> subprocess.Popen:
    dump.mkdir(exist_ok=True)
    return subprocess.Popen([sys.executable, "-m", "pipeplan", "run", str(plan),
                             "--dump-dir", str(dump)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _newest(folder: Path) -> int:
    steps = [int(p.name[5:]) for p in folder.glob("step_*") if p.name[5:].isdigit()]
    return max(steps, default=0)


def _params(dump: Path) -> dict[str, torch.Tensor]:
    merged = {}
    for f in sorted(dump.glob("rank*.pt")):
        merged.update(torch.load(f, weights_only=False)["params"])
    return merged


@pytest.mark.heavy
@pytest.mark.timeout(3600)
def test_soak_three_random_kills_resume_bitwise(tmp_path):
    started = time.monotonic()
    rng = random.Random(int(os.environ.get("SOAK_SEED", "12")))
    straight = tmp_path / "straight.plan"
    straight.write_text(PLAN.replace("CHECKPOINT", ""))
    soak = tmp_path / "soak.plan"
    soak.write_text(PLAN.replace("CHECKPOINT", f'  checkpoint {{ every = {EVERY}  dir = "ckpt"  keep = 2 }}\n'))
    ckpt = tmp_path / "ckpt"

    ref = _launch(straight, tmp_path / "ref")
    log, _ = ref.communicate(timeout=1800)
    assert ref.returncode == 0, log
    reference_s = time.monotonic() - started

    kills = []
    while True:
        run = _launch(soak, tmp_path / "soak")
        if len(kills) < KILLS:
            since = _newest(ckpt)
            while run.poll() is None and _newest(ckpt) <= since:
                time.sleep(0.05)
            time.sleep(rng.uniform(0.0, 1.5))
            ranks = ranks_of(run.pid)
            if run.poll() is None and ranks:
                victim = rng.choice(sorted(ranks))
                os.kill(ranks[victim], signal.SIGKILL)
                log, _ = run.communicate(timeout=120)
                assert run.returncode != 0, log
                assert f"rank {victim}" in log, log  # the launcher names the killed rank
                kills.append((victim, _newest(ckpt)))
                continue
        log, _ = run.communicate(timeout=1800)
        assert run.returncode == 0, log
        break
    total_s = time.monotonic() - started
    assert len(kills) == KILLS, (kills, log)
    assert "resumed from" in log, log

    want, got = _params(tmp_path / "ref"), _params(tmp_path / "soak")
    assert sorted(got) == sorted(want) and want
    differ = [n for n in want if not torch.equal(want[n], got[n])]
    assert not differ, differ
    timing = [json.loads((d / "manifest.json").read_text())["timing"]
              for d in sorted(ckpt.glob("step_*"))]
    write = sum(t["write_s"] for t in timing) / len(timing)
    digest = sum(t["hash_s"] for t in timing) / len(timing)
    print(f"\nsoak: per checkpoint (the {len(timing)} kept, "
          f"{sum(f.stat().st_size for f in ckpt.glob('step_*/*')) // len(timing):,} bytes): "
          f"write {write * 1e3:.1f} ms, sha256 of every file {digest * 1e3:.1f} ms "
          f"(hash/write {digest / write:.2f})")
    print(f"\nsoak: {STEPS} steps, checkpoint every {EVERY}, kills (rank, newest checkpoint "
          f"step) {kills}: every one of {len(want)} parameters bitwise equal to the "
          f"uninterrupted run; reference {reference_s:.1f} s, total {total_s:.1f} s")
