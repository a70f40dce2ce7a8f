"""Deterministic capture: every rank and the verify reference run under one PYTHONHASHSEED.

Gemma 3's forward loops over `set(config.layer_types)`: without one hash seed each rank
captures its nodes in another order and the ranks stop before step 1. The launcher gives
every rank the user's PYTHONHASHSEED, else the plan's train.seed; the reference runs
under the same value; a stage mismatch names the first differing node.

End to end: `pipeplan verify` of a tiny Gemma 3 under pp2 1F1B and ZBV, started with a
random PYTHONHASHSEED of its own (or none), says EQUAL (twice in the default suite, ten
times each as a heavy test).
"""
from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest

from pipeplan.backends.runtime import launcher
from pipeplan.backends.runtime.failure import ERROR_DIR_ENV
from pipeplan.backends.runtime.agreement import first_difference

GEMMA3 = """\
model {{
  source = "pipeplan.tests.parallel.families:gemma3"
  inputs = {{ input_ids = int64[batch, seq] }}
  capture = export
}}
data = synthetic(seed = 0, vocab = 64, seq_len = 8)
mesh {{ pp = 2 }}
pipeline {{ schedule = {schedule}, microbatches = 2{virtual} }}
train {{ steps = 2, global_batch = 4, optimizer = adamw(lr = 0.01), seed = {seed} }}
"""


_SEEN_HERE: list = []  # set by the test: a rank that inherited this process would see it


def _rank_reports(argv: list) -> None:
    """Stands in for a rank's `pipeplan *argv`: writes what it runs under, says it finished,
    and, at exit, that it exited as an interpreter does."""
    import atexit
    import json
    import sys as _sys

    rank = os.environ["RANK"]
    out = os.environ["HASH_TEST_OUT"]
    atexit.register(lambda: open(os.path.join(out, f"{rank}.exited"), "w").close())
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump({"seed": os.environ.get("PYTHONHASHSEED"), "hash": hash("pipeplan"),
                   "threads": os.environ.get("OMP_NUM_THREADS"), "argv": argv,
                   "inherited": list(_SEEN_HERE), "torch": "torch" in _sys.modules,
                   "session": os.getsid(0) == os.getpid(), "pid": os.getpid()}, f)
    open(os.path.join(os.environ[ERROR_DIR_ENV], f"rank{rank}.done"), "w").close()


def _fresh_hash(seed: str) -> int:
    env = dict(os.environ, PYTHONHASHSEED=seed)
    return int(subprocess.run([sys.executable, "-c", "print(hash('pipeplan'))"], env=env,
                              capture_output=True, text=True, check=True).stdout)


def test_launcher_gives_every_rank_the_plan_seed_unless_the_user_set_one(monkeypatch,
                                                                           tmp_path):
    """Real forked ranks (runtime/forkserver.py): each hashes as a new interpreter started
    with the seed would, in a session of its own, with torch already imported and none of
    this process's state."""
    import json

    monkeypatch.setenv("HASH_TEST_OUT", str(tmp_path))
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    _SEEN_HERE.append("the launcher's state")

    def ranks(world: int) -> list:
        return [json.load(open(tmp_path / f"{r}.json")) for r in range(world)]

    assert launcher.launch_local(_rank_reports, ["run", "x.plan"], 3, seed=11) == 0
    said = ranks(3)
    assert [r["seed"] for r in said] == ["12"] * 3  # 1..2**32-1: never 0 (off)
    assert [r["hash"] for r in said] == [_fresh_hash("12")] * 3
    assert len({r["pid"] for r in said}) == 3 and all(r["session"] for r in said)
    assert all(r["torch"] and r["inherited"] == [] and r["argv"] == ["run", "x.plan"]
               for r in said), said
    assert [r["threads"] for r in said] == [str(max(1, os.cpu_count() // 3))] * 3
    assert sorted(f.name for f in tmp_path.glob("*.exited")) == ["0.exited", "1.exited",
                                                                 "2.exited"]  # as at exit
    for f in tmp_path.iterdir():
        f.unlink()
    monkeypatch.setenv("PYTHONHASHSEED", "77")
    assert launcher.launch_local(_rank_reports, ["run", "x.plan"], 2, seed=11) == 0
    assert [(r["seed"], r["hash"]) for r in ranks(2)] == [("77", _fresh_hash("77"))] * 2


def test_stage_mismatch_names_the_first_differing_node():
    rank0 = ["def forward(self, x):\n    a = x.sin()\n    b = a.cos()\n    return b",
             "def forward(self, b):\n    c = b + 1\n    return c"]
    rank1 = [rank0[0], "def forward(self, b):\n    d = b * 2\n    c = b + 1\n    return c"]
    said = first_difference([rank0, rank0, rank1])
    assert said == "stage 1's graph first differs at rank 0's `c = b + 1` where rank 2 " \
                   "has `d = b * 2`", said


def _verify(tmp_path, schedule: str, hash_seed) -> subprocess.CompletedProcess:
    virtual = ", virtual = 2" if schedule == "zbv" else ""
    plan = tmp_path / f"gemma3_{schedule}.plan"
    plan.write_text(GEMMA3.format(schedule=schedule, virtual=virtual,
                                  seed=random.randrange(1000)))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    if hash_seed is not None:
        env["PYTHONHASHSEED"] = str(hash_seed)
    return subprocess.run([sys.executable, "-m", "pipeplan", "verify", str(plan)],
                          capture_output=True, text=True, timeout=600, env=env)


def _equal(r: subprocess.CompletedProcess) -> None:
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "EQUAL to single-process training (fp64)" in r.stdout
    assert "Traceback" not in r.stderr


@pytest.mark.heavy  # ~30 s each: Gemma 3 verified twice (the heavy tier runs it ten times)
@pytest.mark.timeout(1300)
@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_gemma3_verifies_equal_under_a_random_hash_seed(tmp_path, schedule):
    _equal(_verify(tmp_path, schedule, None if schedule == "1f1b" else
                   random.randrange(1, 2 ** 32 - 1)))


@pytest.mark.heavy
@pytest.mark.timeout(7200)
@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_gemma3_verifies_equal_ten_times_in_a_row(tmp_path, schedule):
    for _ in range(10):
        _equal(_verify(tmp_path, schedule, random.choice([None, random.randrange(1, 2 ** 32 - 1)])))


def _hash_into(path: str) -> None:
    with open(path, "w") as f:
        f.write(str(hash("pipeplan")))


def test_a_fork_server_that_died_is_started_again_with_the_ranks_seed(monkeypatch, tmp_path):
    """multiprocessing starts a fork server that died again, from this process's
    environment: forkserver.start gives it the ranks' PYTHONHASHSEED, not this process's
    (none here, so a random one)."""
    import signal
    import time

    from pipeplan.backends.runtime import forkserver

    monkeypatch.setattr(forkserver, "PRELOAD", ())  # (quick to start; nothing else changes)
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    path = str(tmp_path / "hash")
    with forkserver.serving("12", "1"):
        pid = forkserver._server()._forkserver_pid
        os.kill(pid, signal.SIGKILL)
        while open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
            time.sleep(0.01)
        child = forkserver.start(_hash_into, (path,),
                                 dict(os.environ, PYTHONHASHSEED="12", OMP_NUM_THREADS="1"))
        child.join()
        assert forkserver._server()._forkserver_pid != pid  # started again
    assert child.exitcode == 0 and int(open(path).read()) == _fresh_hash("12")
