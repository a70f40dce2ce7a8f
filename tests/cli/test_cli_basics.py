"""The `pipeplan` command itself: --version, help that answers without torch and speaks of
the user's task, the one rule for paths, and outputs refused before any process starts."""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent.parent
PLAN = """
model {
  source = "models/gpt.py:GPT"
  args = { vocab = 64, dim = 32, layers = 4, heads = 4, seq_len = 16 }
  inputs = { input_ids = int64[batch, seq] }
  capture = fx
}
data = synthetic(seed = 1, vocab = 64, seq_len = 16)
mesh { pp = 2 }
pipeline { schedule = 1f1b  microbatches = 2 }
train {
  steps = 2
  global_batch = 4
  optimizer = sgd(lr = 0.1)
  log_dir = "logs"
}
"""


def pipeplan(*args, cwd=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "pipeplan", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


def test_version_is_the_package_version():
    pyproject = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    (version,) = re.findall(r'^version = "([^"]+)"', pyproject, re.MULTILINE)
    r = pipeplan("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"pipeplan {version}"


HELP_WITHOUT_TORCH = """
import sys
from pipeplan.cli import main
for argv in (["--help"], ["run", "--help"], ["export", "--help"], ["--version"]):
    try:
        main(argv)
    except SystemExit as e:
        assert e.code == 0, (argv, e.code)
print("TORCH" if "torch" in sys.modules else "NO TORCH", file=sys.stderr)
"""


def test_help_answers_without_importing_torch():
    r = subprocess.run([sys.executable, "-c", HELP_WITHOUT_TORCH], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stderr.strip().splitlines()[-1] == "NO TORCH"
    assert "COMMAND" in r.stdout and "pipeplan run" in r.stdout


def test_help_texts_name_no_internal_files():
    from pipeplan.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    texts = {"pipeplan": parser.format_help(),
             **{name: p.format_help() for name, p in sub.choices.items()}}
    assert {"run", "profile", "report", "verify", "plan-diff", "export", "check"} <= set(texts)
    internal = re.compile(r"[\w./-]*\.py\b|\b(?:backends|compiler|dsl|schedules|tests|cli)/")
    for name, text in texts.items():
        assert not internal.findall(text), (name, internal.findall(text))


def test_paths_typed_on_the_command_line_are_relative_to_the_working_directory(
        tmp_path, monkeypatch):
    """One rule: in the plan file, relative to its folder; in a --set value, to the cwd."""
    from pipeplan.dsl.load import load_plan

    (tmp_path / "plans").mkdir()
    (tmp_path / "work").mkdir()
    plan_file = tmp_path / "plans" / "p.plan"
    plan_file.write_text(PLAN.replace("train {", 'train {\n  checkpoint { every = 1  '
                                              'dir = "ck" }'))
    monkeypatch.chdir(tmp_path / "work")
    written = load_plan(str(plan_file)).with_resolved_paths()
    assert written.train.log_dir == str(tmp_path / "plans" / "logs")
    assert written.train.checkpoint.dir == str(tmp_path / "plans" / "ck")
    typed = load_plan(str(plan_file), ['train.log_dir="runs/a"', 'train.checkpoint={every = 1 '
                                       ' dir = "runs/ck"}', 'pipeline.profile="c.json"'])
    typed_paths = typed.with_resolved_paths()
    assert typed_paths.train.log_dir == str(tmp_path / "work" / "runs" / "a")
    assert typed_paths.train.checkpoint.dir == str(tmp_path / "work" / "runs" / "ck")
    assert typed.resolve_path("c.json", "pipeline.profile") == str(tmp_path / "work" / "c.json")
    # the model file stays next to the plan, whatever the working directory
    assert typed.resolve_path("models/gpt.py", "model.source") == str(
        tmp_path / "plans" / "models" / "gpt.py")


@pytest.mark.parametrize("flags, message", [
    (["--metrics", "afile/m.jsonl"], "--metrics {cwd}/afile/m.jsonl: {cwd}/afile is a file, "
                                     "not a folder (nothing was started)"),
    (["--trace", "adir"], "--trace {cwd}/adir: is a folder; give a file name"),
    (["--set", 'train.log_dir="afile/logs"'], "train.log_dir {cwd}/afile/logs: {cwd}/afile is "
                                              "a file, not a folder"),
])
def test_an_output_that_cannot_be_written_is_refused_before_launch(tmp_path, flags, message,
                                                                  monkeypatch, capsys):
    from pipeplan.cli import main

    plan = tmp_path / "p.plan"
    plan.write_text(PLAN.replace("models/gpt.py", str(REPO / "examples/models/gpt.py")))
    (tmp_path / "afile").write_text("not a folder")
    (tmp_path / "adir").mkdir()
    monkeypatch.chdir(tmp_path)
    assert main(["run", str(plan), *flags]) == 2
    out, err = capsys.readouterr()
    assert message.format(cwd=os.getcwd()) in err, err
    assert "launching" not in out and "Traceback" not in err


def test_missing_output_folders_are_made(tmp_path):
    """`pipeplan report -o` into a folder that does not exist yet (no processes started)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text(
        '{"step": 1, "loss": 2.0, "step_time_s": 0.1, "tokens_per_s": 10}\n'
        '{"step": 2, "loss": 1.5, "step_time_s": 0.1, "tokens_per_s": 10}\n')
    r = pipeplan("report", "run", "-o", "new/deeper/r.html", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "new/deeper/r.html").read_text().startswith("<!DOCTYPE html>")


def test_a_build_directory_writes_where_its_plan_would(tmp_path, monkeypatch, capsys):
    """`pipeplan compile` copies the plan into BUILD/: its output folders are rewritten
    relative to BUILD/ so that they still point where the plan's (or the --set's) did."""
    from pipeplan.backends.runtime.source import load_source
    from pipeplan.cli import main

    (tmp_path / "plans").mkdir()
    plan = tmp_path / "plans" / "p.plan"
    plan.write_text(PLAN.replace("models/gpt.py", str(REPO / "examples/models/gpt.py"))
                    .replace("train {", 'train {\n  checkpoint { every = 1  dir = "ck" }'))
    monkeypatch.chdir(tmp_path)
    assert main(["compile", str(plan), "-o", "build/p", "--set", 'train.log_dir="runs/a"']) == 0
    capsys.readouterr()
    built = load_source("build/p", [], None).plan
    assert built.train.log_dir == str(tmp_path / "runs" / "a")
    assert built.train.checkpoint.dir == str(tmp_path / "plans" / "ck")
