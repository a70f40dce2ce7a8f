"""Checkpoints are verified before anything loads them, and never run code.

* A real 2-rank run writes two checkpoints; its manifest records every file's size and
  sha256 (checked here with hashlib directly). Two bytes flipped in a shard: named by
  `pipeplan checkpoint verify` and `export`, and automatic resume falls back to the
  previous checkpoint by itself with a warning and continues the run exactly (its
  losses equal the first run's).
* A bit flip, a truncated or missing shard and a truncated `.metadata` are each named by
  `checkpoint verify`, and refused before launch by `run --resume-from` and `export`,
  which offer the previous intact checkpoint.
* A crafted `.metadata` (a pickle whose payload would create a marker file), with a
  manifest whose hash matches it, is refused by verify, export and run, and the marker
  never appears; a pickled byte item is refused by the load planner (the control shows
  DCP's default reader and planner would run both payloads).
"""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from pipeplan.cli import main

from .test_resume_paths import PLAN as BASE

PLAN = (BASE.replace("steps = 5", "steps = 4").replace("keep = 1", "keep = 2")
        .replace('  log_dir = "logs"\n', ""))


def _run(cwd: Path, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeplan", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=240)


def _losses(path: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, path.read_text().splitlines())}


def _cli(capsys, *argv) -> tuple[int, str]:
    code = main([*map(str, argv)])
    out = capsys.readouterr()
    assert "Traceback" not in out.err, out.err
    return code, out.out + out.err


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x10
    data[at + 1] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.heavy  # two real runs: ~1 min on 2 shared cores
def test_a_bit_flip_is_named_and_resume_falls_back_to_the_previous(tmp_path, capsys):
    """A real run's manifest records every file's size and sha256; two bytes flipped in a
    shard are named by verify and export (which offers the previous checkpoint), and
    automatic resume skips it with a warning and continues exactly from step 2."""
    plan = tmp_path / "p.plan"
    plan.write_text(PLAN)
    r = _run(tmp_path, "run", plan, "--metrics", tmp_path / "first.jsonl")
    assert r.returncode == 0, r.stdout + r.stderr
    ckpt = tmp_path / "ckpt"
    s2, s4 = ckpt / "step_000002", ckpt / "step_000004"
    files = json.loads((s4 / "manifest.json").read_text())["files"]
    on_disk = sorted(p.name for p in s4.iterdir() if p.name != "manifest.json")
    assert sorted(files) == on_disk and ".metadata" in files
    for name in on_disk:
        data = (s4 / name).read_bytes()
        assert files[name] == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    code, out = _cli(capsys, "checkpoint", "verify", ckpt)
    assert code == 0 and out.count("ok ") == 2, out

    shard = sorted(s4.glob("*.distcp"))[-1]
    _flip(shard, shard.stat().st_size // 2)
    code, out = _cli(capsys, "checkpoint", "verify", ckpt)
    assert code == 1 and f"DAMAGED {s4}" in out and f"{shard}: sha256" in out, out
    assert f"ok {s2}" in out
    code, out = _cli(capsys, "export", ckpt, "-o", tmp_path / "out")
    assert code == 2 and str(shard) in out and str(s2) in out, out
    assert not (tmp_path / "out").exists()

    r = _run(tmp_path, "run", plan, "--metrics", tmp_path / "again.jsonl")
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"skipped the damaged checkpoint {s4}" in r.stderr and str(shard) in r.stderr
    assert "after step 2" in r.stdout, r.stdout
    first, again = _losses(tmp_path / "first.jsonl"), _losses(tmp_path / "again.jsonl")
    assert sorted(again) == [3, 4] and all(again[t] == first[t] for t in again), (first, again)
    code, out = _cli(capsys, "checkpoint", "verify", s4)  # rewritten, intact
    assert code == 0, out


def _checkpoint(series: Path, step: int) -> Path:
    """A small checkpoint as pipeplan writes it: DCP files, then the manifest's record."""
    import torch.distributed.checkpoint as dcp
    from pipeplan.backends.state.checkpoint.integrity import checkpoint_files, digest

    folder = series / f"step_{step:06d}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"params/w": torch.arange(4096.0), "params/b": torch.ones(3)},
                 checkpoint_id=str(folder), no_dist=True)
    (folder / "manifest.json").write_text(json.dumps(
        {"format": 2, "step": step, "plan_hash": "", "parameters": {"w": [4096], "b": [3]},
         "optimizer": {"name": "adamw", "momentum": False},
         "files": digest(str(folder), checkpoint_files(str(folder), "manifest.json"))}))
    return folder


@pytest.mark.parametrize("what", ["bit flip", "truncated shard", "missing shard",
                                  "truncated metadata"])
def test_damage_is_named_before_launch_with_the_previous_offered(tmp_path, capsys, what):
    plan = tmp_path / "p.plan"
    plan.write_text(PLAN)
    s2, s4 = _checkpoint(tmp_path / "ckpt", 2), _checkpoint(tmp_path / "ckpt", 4)
    shard = next(s4.glob("*.distcp"))
    victim, said = {"bit flip": (shard, ": sha256 "),
                    "truncated shard": (shard, ": 40 bytes, the manifest says"),
                    "missing shard": (shard, ": missing"),
                    "truncated metadata": (s4 / ".metadata", ": 40 bytes, the manifest says")}[what]
    if what == "bit flip":
        _flip(victim, 3000)
    elif what == "missing shard":
        victim.unlink()
    else:
        victim.write_bytes(victim.read_bytes()[:40])
    code, out = _cli(capsys, "checkpoint", "verify", tmp_path / "ckpt")
    assert code == 1 and f"DAMAGED {s4}" in out and f"{victim}{said}" in out, out
    assert f"ok {s2}" in out
    code, out = _cli(capsys, "run", plan, "--resume-from", s4)
    assert code == 2 and f"{victim}{said}" in out and f"--resume-from {s2}" in out, out
    assert "launching" not in out and "nothing was loaded" in out
    code, out = _cli(capsys, "export", tmp_path / "ckpt", "-o", tmp_path / "out")
    assert code == 2 and f"{victim}{said}" in out and str(s2) in out, out
    from pipeplan.backends.state.checkpoint.verify import choose
    assert choose(str(tmp_path / "ckpt"))[0] == str(s2)  # automatic resume's fallback


class _Payload:
    """Unpickling it runs `touch MARKER` (what a crafted checkpoint could do)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _manifest(folder: Path, names) -> None:
    """A manifest whose hashes match the folder's (the crafter rewrote it too)."""
    files = {n: {"size": (folder / n).stat().st_size,
                 "sha256": hashlib.sha256((folder / n).read_bytes()).hexdigest()}
             for n in names}
    (folder / "manifest.json").write_text(json.dumps(
        {"format": 2, "step": 2, "plan_hash": "", "parameters": {}, "files": files,
         "optimizer": {"name": "adamw", "momentum": False}}))


def test_a_crafted_metadata_pickle_is_refused_without_running(tmp_path, capsys):
    marker, control = tmp_path / "pwned", tmp_path / "control"
    folder = tmp_path / "ckpt" / "step_000002"
    folder.mkdir(parents=True)
    (folder / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    _manifest(folder, [".metadata"])
    twin = tmp_path / "twin"
    twin.mkdir()
    (twin / ".metadata").write_bytes(pickle.dumps(_Payload(control)))
    import torch.distributed.checkpoint as dcp
    try:  # the control: DCP's own reader runs the payload
        dcp.FileSystemReader(str(twin)).read_metadata()
    except Exception:
        pass
    assert control.exists()

    code, out = _cli(capsys, "checkpoint", "verify", folder)
    assert code == 1 and "refers to posix.system" in out and "refused without running" in out
    code, out = _cli(capsys, "export", tmp_path / "ckpt", "-o", tmp_path / "out")
    assert code == 2 and "posix.system" in out, out
    plan = tmp_path / "p.plan"
    plan.write_text(PLAN)
    code, out = _cli(capsys, "run", plan)
    assert code == 2 and "posix.system" in out and "launching" not in out, out
    code, out = _cli(capsys, "plan-diff", plan, plan, "--checkpoint", tmp_path / "ckpt")
    assert code == 1 and "posix.system" in out, out
    assert not marker.exists()


def test_a_pickled_byte_item_is_refused_by_the_load_planner(tmp_path):
    import torch.distributed.checkpoint as dcp
    from pipeplan.backends.state.checkpoint.trusted import (NoBytesLoadPlanner, TrustedReader,
                                                            UnsafeCheckpoint, load)

    marker, control = tmp_path / "pwned", tmp_path / "control"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for where, m in ((tmp_path / "a", marker), (tmp_path / "b", control)):
            dcp.save({"w": torch.ones(2), "obj": _Payload(m)}, checkpoint_id=str(where),
                     no_dist=True)
        state = {"w": torch.zeros(2), "obj": None}
        dcp.load(dict(state), checkpoint_id=str(tmp_path / "b"), no_dist=True)  # the control
        assert control.exists()
        with pytest.raises(UnsafeCheckpoint, match="obj is a pickled object"):
            load(dict(state), str(tmp_path / "a"), NoBytesLoadPlanner(), no_dist=True)
        with pytest.raises(BaseException, match="obj is a pickled object"):  # the backstop
            dcp.load(dict(state), storage_reader=TrustedReader(str(tmp_path / "a")),
                     planner=NoBytesLoadPlanner(), no_dist=True)
    assert not marker.exists()


def test_one_writer_per_checkpoint_folder(tmp_path, capsys):
    """One writer per folder: a live holder (here: this process) refuses a second run before launch, naming its
    pid; a holder killed by SIGKILL leaves a stale lock that the next run takes over."""
    from pipeplan.backends.state.checkpoint.lock import LOCK, FolderInUse, FolderLock

    plan = tmp_path / "p.plan"
    plan.write_text(PLAN)
    folder = tmp_path / "ckpt"
    with FolderLock(str(folder)):
        code, out = _cli(capsys, "run", plan)
        assert code == 2 and f"is in use by pid {os.getpid()} on " in out, out
        assert "launching" not in out
    assert not (folder / LOCK).exists()  # released

    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\n"
         "from pipeplan.backends.state.checkpoint.lock import FolderLock\n"
         f"FolderLock({str(folder)!r}).acquire()\nprint('held', flush=True)\ntime.sleep(120)"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(FolderInUse, match=f"pid {holder.pid} on "):
            FolderLock(str(folder)).acquire()
    finally:
        holder.kill()
        holder.wait()
    assert (folder / LOCK).exists()  # left behind by the killed holder
    lock = FolderLock(str(folder)).acquire()
    assert lock.stale and f"pid {holder.pid} " in lock.stale
    lock.release()
