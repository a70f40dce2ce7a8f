"""Faults named right: the rank that died first, its last action, and Ctrl-C in one line.

Real local runs through the CLI (4 gloo ranks, a tiny GPT, one layer per stage).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeplan.backends.runtime.failure import Failure, explain

HERE = Path(__file__).parent

PLAN = """
model {{
  source = "{source}"
  args = {{ vocab = 32, dim = 16, layers = 4, heads = 2, seq_len = 8{extra} }}
  capture = fx{leaf}
}}
data = synthetic(seed = 1, vocab = 32, seq_len = 8)
mesh {{ pp = {pp} }}
pipeline {{ schedule = 1f1b  microbatches = {pp}  split = [{split}] }}
train {{ steps = {steps}  global_batch = {pp}  optimizer = sgd(lr = 0.05) }}
"""


def write_plan(tmp_path: Path, pp: int = 4, steps: int = 2, extra: str = "",
               source: str = str(HERE / "faulty.py") + ":FaultyGPT") -> Path:
    per = 4 // pp
    split = ", ".join(f"layers[{i * per}:{(i + 1) * per}]" for i in range(pp))
    path = tmp_path / "fault.plan"
    leaf = "\n  leaf_modules = [bomb]" if "Faulty" in source else ""
    path.write_text(PLAN.format(source=source, extra=extra, pp=pp, split=split, steps=steps,
                                leaf=leaf))
    return path


def pipeplan(*args, timeout=240):
    return subprocess.run([sys.executable, "-m", "pipeplan", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
@pytest.mark.parametrize("k", [pytest.param(0, marks=pytest.mark.heavy), 1,
                               pytest.param(3, marks=pytest.mark.heavy)])
def test_a_killed_rank_is_named_not_its_neighbour(tmp_path, k):
    """Rank k SIGKILLs itself in its first forward of step 2; its neighbours then fail with
    "connection closed" and report first, but the launcher names k, and its action."""
    plan = write_plan(tmp_path, extra=f", fail_layer = {k}, fail_after = 4, kill = true")
    r = pipeplan("run", plan, "--timeout", 60)
    assert r.returncode == 1, r.stdout + r.stderr
    lines = [line for line in r.stderr.splitlines() if line.startswith("pipeplan: ")]
    assert lines[0] == (f"pipeplan: run failed: rank {k} was killed by SIGKILL in step 2: "
                        f"F s{k} mb0 (it reported no error)"), r.stderr
    assert lines[-1] == "pipeplan: stopped all 4 ranks", r.stderr
    consequence = [line for line in lines if line.startswith("pipeplan: consequence: ")]
    assert all(f"rank {k} failed" not in line for line in consequence), r.stderr


def test_explain_prefers_a_signal_death_then_the_earliest_report():
    neighbour = Failure(1, "rank 1 failed in step 3: BW s1 mb0: Connection closed", 10.0)
    later = Failure(3, "rank 3 failed in step 3: F s3 mb0: Connection closed", 11.0)
    lines = explain({0: 1, 1: 1, 2: -9, 3: None}, [later, neighbour][::-1],
                    {2: "step 3: F s2 mb0"})
    assert lines[0] == "run failed: rank 2 was killed by SIGKILL in step 3: F s2 mb0 " \
                       "(it reported no error)"
    assert lines[1].startswith("consequence: rank 1 failed") and "1 more rank" in lines[1]
    first = Failure(3, "rank 3 failed in step 1: F s3 mb0: ValueError: bad", 5.0)
    lines = explain({0: 1, 1: 1, 2: 1, 3: 1}, [first, neighbour], {})
    assert lines[0] == "run failed: rank 3 failed in step 1: F s3 mb0: ValueError: bad"
    lines = explain({0: None, 1: 7}, [], {1: "setup"})
    assert lines[0] == "run failed: rank 1 exited with code 7 during setup without " \
                       "reporting an error"
    # exit 0 without reporting that it finished: the cause, before a neighbour's report
    reset = Failure(0, "rank 0 failed in setup: RuntimeError: Connection reset by peer", 9.0)
    lines = explain({0: 1, 1: 0}, [reset], {1: "model import and compile"}, frozenset({1}))
    assert lines[0].startswith("run failed: rank 1 exited with code 0 during model import "
                               "and compile without reporting that it finished"), lines
    assert lines[1].startswith("consequence: rank 0 failed"), lines


@pytest.mark.slow
def test_ctrl_c_stops_every_rank_with_one_line(tmp_path):
    """SIGINT to the launcher mid-run: every rank stops, "interrupted" once, no C++ frames."""
    plan = write_plan(tmp_path, pp=2, steps=100000,
                      source=str(HERE.parent.parent / "examples/models/gpt.py") + ":GPT")
    proc = subprocess.Popen([sys.executable, "-m", "pipeplan", "run", str(plan)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 200
        seen = ""
        while " 2/100000" not in seen and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            seen += line
        assert " 2/100000" in seen, seen + proc.stderr.read()
        os.kill(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert err.count("interrupted") == 1, err
    assert "frame #" not in err and "Traceback" not in err, err
    assert _processes_mentioning(str(plan)) == []


def _processes_mentioning(marker: str) -> list[int]:
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if marker in cmd:
                found.append(int(pid))
    return found
