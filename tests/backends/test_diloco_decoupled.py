"""Decoupled DiLoCo through `pipeplan run` (4 gloo ranks: pp=2 x dp=2 islands, H=2).

Island 1 (ranks 1 and 3) sleeps 6 s in its step 2, then its rank 1 kills itself in its
step 5 (20 steps). Island 0 must not wait beyond the timeout (1 s) at any sync, the late island must
adopt the newest global parameters, the launcher must drop island 1 when it dies and the
run must finish with exit code 0, island 0's log naming the absent and lost island.
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
PLAN = """
model {{
  source = "{source}"
  args = {{ vocab = 32, dim = 16, layers = 2, heads = 2, seq_len = 8, {faults} }}
  capture = fx
  leaf_modules = [hazard]
}}
data = synthetic(seed = 1, vocab = 32, seq_len = 8)
mesh {{ pp = 2  dp = 2 }}
pipeline {{ schedule = 1f1b  microbatches = 2  split = [layers[0:1], layers[1:2]] }}
sync = diloco(inner_steps = 2, outer_optimizer = nesterov(lr = 0.7, momentum = 0.9),
              decoupled = true, timeout = 1s)
train {{ steps = 20  global_batch = 8  optimizer = adamw(lr = 0.003) }}
"""


@pytest.mark.heavy  # suite time: run with -m heavy
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_late_island_is_not_waited_for_and_a_lost_one_is_dropped(tmp_path):
    # stage 0 runs the hazard once per microbatch: calls 3-4 are step 2, 9-10 step 5
    faults = "sleep_rank = 1, sleep_after = 2, sleep_s = 6.0, kill_rank = 1, kill_after = 8"
    plan = tmp_path / "decoupled.plan"
    plan.write_text(PLAN.format(source=str(HERE / "island_faults.py") + ":IslandFaultGPT",
                                faults=faults))
    run = subprocess.run([sys.executable, "-m", "pipeplan", "run", str(plan)],
                         capture_output=True, text=True, timeout=280)
    out, err = run.stdout, run.stderr
    assert run.returncode == 0, out + err
    assert re.search(r"island 1 lost: rank 1 was killed by signal 9 in step 5", err), err
    island0 = [line for line in out.splitlines() if "island 0: sync" in line]
    assert len(island0) == 10, out  # after steps 2, 4, ..., 20, every one of them ran
    waited = [float(re.search(r"waited ([0-9.]+) s", line).group(1)) for line in island0]
    assert max(waited) < 3.0, out  # the timeout is 1 s; island 1 slept 6 s
    assert "absent [1]" in island0[0], out  # island 1 was asleep at the first sync
    # after adopting, island 1 is back in the others' rounds (island 0 waits for it again),
    # so its death in its step 5 comes before island 0's last syncs, which name it lost
    assert "lost [1]" in island0[-1], out
    assert "step 20/20" in out
    # the late island merged the newest global parameters when it arrived
    late = [line for line in out.splitlines() if line.startswith("island 1: sync")]
    assert late and "averaged islands [0]" in late[0], out
    assert re.search(r"late and adopted round [1-9]", late[0]), out
