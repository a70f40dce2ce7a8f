"""`pipeplan check` and `pipeplan fmt`: exit codes, what they print, overrides."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pipeplan.cli import main
from pipeplan.dsl import load_plan

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.plan"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_check_passes_every_example(path, capsys):
    assert main(["check", str(path)]) == 0
    out = capsys.readouterr().out
    plan = load_plan(str(path))
    assert f"world size {plan.mesh.world_size}" in out
    assert "rank  pp  dp  cp  tp  ep  edp" in out
    assert f"pipeline: {plan.pipeline.schedule}" in out


def test_check_prints_the_mesh_layout_of_the_hybrid_plan(capsys):
    assert main(["check", str(ROOT / "examples/hybrid_pp2_dp2_tp2.plan")]) == 0
    out = capsys.readouterr().out
    # pp outermost, tp innermost: rank 5 = pp 1, dp 0, cp 0, tp 1
    assert "     5   1   0   0   1   0    0" in out
    assert "tp   size 2: [0,1] [2,3] [4,5] [6,7]" in out
    assert "pp   size 2: [0,4] [1,5] [2,6] [3,7]" in out


def test_check_with_overrides_and_world_size(capsys):
    path = str(ROOT / "examples/gpt_pp4_1f1b.plan")
    assert main(["check", path, "--set", "pipeline.microbatches=16", "--set",
                 "train.optimizer.lr=0.01", "--world-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "microbatches = 16" in out and "lr = 0.01" in out
    assert main(["check", path, "--world-size", "8"]) == 2
    assert "launcher started 8" in capsys.readouterr().err


def test_check_reports_a_bad_override_at_the_override(capsys):
    path = str(ROOT / "examples/gpt_pp4_1f1b.plan")
    assert main(["check", path, "--set", "train.global_batch=12"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("<--set 1>:1:20: error: global_batch = 12 is not divisible by dp * "
                          "microbatches = 1 * 8")
    assert "    train.global_batch=12\n" + " " * 23 + "^^" in err


def test_check_notes_an_underfilled_pipeline(capsys):
    path = str(ROOT / "examples/gpt_pp4_1f1b.plan")
    assert main(["check", path, "--set", "pipeline.microbatches=2"]) == 0
    assert "note: 2 microbatches for 4 pipeline ranks" in capsys.readouterr().out


def test_fmt_prints_canonical_text_and_rewrites_in_place(tmp_path, capsys):
    messy = tmp_path / "messy.plan"
    messy.write_text('model{source="m.py:M"}  # the model\nmesh{pp=2;dp=1}\n'
                     "train{global_batch=4 optimizer=adamw(lr=1e-2)}")
    assert main(["fmt", str(messy)]) == 0
    canonical = capsys.readouterr().out
    assert canonical == ('model {\n  source = "m.py:M"  # the model\n}\n\nmesh {\n  pp = 2\n'
                         "  dp = 1\n}\n\ntrain {\n"
                         "  global_batch = 4\n  optimizer = adamw(lr = 0.01)\n}\n")
    assert main(["fmt", "-i", str(messy)]) == 0
    assert messy.read_text() == canonical
    assert main(["fmt", str(messy)]) == 0
    assert capsys.readouterr().out == canonical  # canonical text is a fixed point


def test_fmt_refuses_a_broken_plan(tmp_path, capsys):
    bad = tmp_path / "bad.plan"
    bad.write_text('model { source = "m.py:M" }\nmesh { pp = two }\n')
    assert main(["fmt", "-i", str(bad)]) == 2
    assert "bad.plan:2:13: error: mesh.pp must be an integer" in capsys.readouterr().err
    assert bad.read_text() == 'model { source = "m.py:M" }\nmesh { pp = two }\n'


def test_the_installed_command_exits_2_without_a_traceback(tmp_path):
    bad = tmp_path / "bad.plan"
    bad.write_text("model {\n")
    ok = subprocess.run([sys.executable, "-m", "pipeplan", "check", str(EXAMPLES[0])],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    broken = subprocess.run([sys.executable, "-m", "pipeplan", "check", str(bad)],
                            capture_output=True, text=True, timeout=120)
    assert broken.returncode == 2
    assert "bad.plan:1:8: error: unexpected end of file" in broken.stderr
    assert "Traceback" not in broken.stderr
