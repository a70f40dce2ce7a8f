"""Resume under another plan from the command line: what cannot load is refused before launch,
one line per item with the choices; `--reset-optimizer` resumes the weights only; `pipeplan
plan-diff` shows the differences and whether the checkpoint loads under plan B.

One real checkpoint (a 2-rank run, 2 steps); the refusals run `pipeplan`'s main in this
process (they stop before any process starts) and then a 2-rank reshard with a fresh
optimizer runs for real."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipeplan.cli import main

from .test_resume_paths import PLAN as BASE

# test_resume_paths' tiny GPT on pp = 2 (AdamW), 4 steps, a checkpoint every 2
PLAN = (BASE.replace("steps = 5", "steps = 4").replace("  keep = 1", "")
        .replace('  log_dir = "logs"\n', ""))
# another plan: dp instead of pp, ZeRO-1 (reshards on load)
DP2 = PLAN.replace("mesh { pp = 2 }", "mesh { dp = 2 }\nzero = 1")


def write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.write_text(text)
    return path


def refuse(capsys, *argv) -> str:
    code = main(["run", *map(str, argv)])
    out = capsys.readouterr()
    assert code == 2, out.out + out.err
    assert "Traceback" not in out.err and "launching" not in out.out
    return out.err


@pytest.mark.heavy  # suite time: run with -m heavy
@pytest.mark.slow
def test_resume_refusals_reset_optimizer_and_plan_diff(tmp_path, capsys):
    plan = write(tmp_path, "a.plan", PLAN)
    r = subprocess.run([sys.executable, "-m", "pipeplan", "run", str(plan), "--steps", "2"],
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    ckpt = tmp_path / "ckpt" / "step_000002"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["step"] == 2 and manifest["optimizer"] == {"name": "adamw", "momentum": False}
    assert manifest["parameters"]["tok_emb.weight"] == [32, 16]

    # what cannot carry over: one line per item, the choices named, exit 2, nothing started
    sgd = write(tmp_path, "sgd.plan", DP2.replace("adamw(lr = 0.01)", "sgd(lr = 0.1, momentum = 0.9)"))
    err = refuse(capsys, sgd)
    assert f"checkpoint {ckpt} does not load under this plan (nothing was started)" in err
    assert "the optimizer state is adamw's, the plan trains with sgd with momentum" in err
    assert "--reset-optimizer" in err and "start fresh" in err
    assert err.count("\n  - ") == 1, err
    wide = write(tmp_path, "wide.plan", PLAN.replace("dim = 16", "dim = 24"))
    err = refuse(capsys, wide)
    assert "parameter tok_emb.weight has shape [32, 16] in the checkpoint but [32, 24] in " \
           "the model" in err, err
    assert "optimizer" not in err  # only what differs
    deeper = write(tmp_path, "deeper.plan", PLAN.replace("layers = 2", "layers = 3"))
    err = refuse(capsys, deeper)
    assert "parameter(s) the checkpoint lacks: layers.2." in err and err.count("\n  - ") == 1

    # plan-diff: the differences side by side; whether the checkpoint loads under B
    dp2 = write(tmp_path, "dp2.plan", DP2)
    assert main(["plan-diff", str(plan), str(dp2), "--checkpoint", str(tmp_path / "ckpt")]) == 0
    out = capsys.readouterr().out
    rows = {line.split("  ")[0]: line for line in out.splitlines()}
    assert rows["mesh"].split() == ["mesh", "pp=2", "dp=1", "cp=1", "tp=1", "ep=1",
                                    "pp=1", "dp=2", "cp=1", "tp=1", "ep=1"], out
    assert rows["zero"].split() == ["zero", "0", "1"], out
    assert "stage placement" in rows and "split" in rows, out
    assert f"checkpoint {ckpt} (step 2) loads under B" in out
    assert "resharded on load: pp 2 -> 1; dp 1 -> 2; zero 0 -> 1" in out, out
    assert main(["plan-diff", str(plan), str(wide), "--checkpoint", str(tmp_path / "ckpt")]) == 1
    out = capsys.readouterr().out
    assert "does NOT load under B" in out and "tok_emb.weight has shape [32, 16]" in out

    # --reset-optimizer: the weights (and step) under another plan and optimizer, for real
    r = subprocess.run([sys.executable, "-m", "pipeplan", "run", str(sgd), "--reset-optimizer",
                        "--metrics", str(tmp_path / "m.jsonl")],
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "resumed from" in r.stdout and "after step 2" in r.stdout, r.stdout
    steps = [json.loads(line)["step"] for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert steps == [3, 4]
    assert (tmp_path / "ckpt" / "step_000004" / "manifest.json").is_file()
