"""README.md word for word: every command in it, extracted from the file and run as written.

The default suite checks every command without training: each `pipeplan` command parses
with the real parser and names files that exist (or that an earlier command writes), the
multi-node `torchrun` line starts as many ranks as its plan has, each benchmark script
exists and knows the flags the README gives it, and the install lines are CI's. The
torch-free commands (`pipeplan schedule`) run. The heavy test runs them all, in order, in a
fresh copy of the repository (tracked and untracked, not ignored, files), the multi-node
line as two torchrun node groups on 127.0.0.1 (HOST:PORT: a free port); CI runs it
(.ci/run). The benchmark lines run with `-m heavy -k benchmarks_run` (minutes each).
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent.parent
README = REPO / "README.md"


# ------------------------------------------------------------------ extraction
def readme_commands(text: str | None = None) -> list[list[str]]:
    """Every command of the README's indented code blocks, as argv lists (a `\\`-continued
    line joined, `# ...` comments dropped, `a && b` split into two)."""
    text = README.read_text(encoding="utf-8") if text is None else text
    lines, block, prev_blank = [], False, True
    for line in text.splitlines():
        if line.startswith("    ") and (block or prev_blank):
            block = True
            lines.append(line.strip())
        elif line.strip():
            block = False
        prev_blank = not line.strip()
    joined, buf = [], ""
    for line in lines:
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        joined.append(buf + line)
        buf = ""
    commands = []
    for line in joined:
        argv = shlex.split(line, comments=True)
        while argv:
            cut = argv.index("&&") if "&&" in argv else len(argv)
            commands.append(argv[:cut])
            argv = argv[cut + 1:]
    return [c for c in commands if c]


def kind(argv: list[str]) -> str:
    if argv[0] == "pip":
        return "install"
    if argv[:3] == ["python", "-m", "pytest"]:
        return "tests" if "tests/benchmarks" not in argv else "benchmark"
    if argv[0] == "python":
        return "benchmark"
    return argv[0]  # pipeplan, torchrun


COMMANDS = readme_commands()


def test_extraction_sees_continuations_comments_and_chains():
    text = ("intro\n\n    a x  # note\n    # only a comment\n    b \\\n        --c 'd e'\n"
            "text\n    not code\n\n    f && g h\n")
    assert readme_commands(text) == [["a", "x"], ["b", "--c", "d e"], ["f"], ["g", "h"]]


def test_every_command_is_of_a_known_kind():
    kinds = {kind(c) for c in COMMANDS}
    assert kinds <= {"install", "tests", "benchmark", "pipeplan", "torchrun"}, kinds
    assert {"pipeplan", "torchrun", "benchmark"} <= kinds


# ------------------------------------------------------------------ default suite
def _produced_paths(commands) -> set[str]:
    """Files and folders the README's commands write (their -o/--out/--trace and log_dir)."""
    out = set()
    for argv in commands:
        for flag in ("-o", "--out", "--trace", "--metrics"):
            if flag in argv:
                out.add(os.path.normpath(argv[argv.index(flag) + 1]))
        for value in (argv[k + 1] for k, a in enumerate(argv[:-1]) if a == "--set"):
            out.update(os.path.normpath(p) for p in re.findall(r'dir\s*=\s*"([^"]+)"', value))
    return out


def test_pipeplan_commands_parse_and_name_files_that_exist():
    from pipeplan.cli import build_parser

    parser = build_parser()
    made = set()
    for argv in (c for c in COMMANDS if kind(c) == "pipeplan"):
        try:
            args = parser.parse_args(argv[1:])
        except SystemExit:
            pytest.fail(f"README: `{shlex.join(argv)}` does not parse")
        for name in ("plan", "a", "b", "run_dir", "checkpoint"):
            value = getattr(args, name, None)
            if value:
                assert (REPO / value).exists() or os.path.normpath(value) in made, (
                    f"README: `{shlex.join(argv)}` names {value}, which neither exists nor is "
                    "written by a command before it")
        made |= _produced_paths([argv])


def test_multinode_line_starts_as_many_ranks_as_its_plan_has():
    from pipeplan.dsl.load import load_plan

    (argv,) = [c for c in COMMANDS if kind(c) == "torchrun"]
    nodes = int(argv[argv.index("--nnodes") + 1])
    per_node = int(argv[argv.index("--nproc-per-node") + 1])
    assert argv[argv.index("-m") + 1:argv.index("-m") + 3] == ["pipeplan", "run"]
    plan = load_plan(str(REPO / argv[argv.index("-m") + 3]))
    assert nodes * per_node == plan.mesh.world_size, (
        f"README's torchrun line starts {nodes} x {per_node} ranks for a plan of "
        f"{plan.mesh.world_size}")


def test_benchmark_scripts_exist_and_take_the_readme_flags():
    for argv in (c for c in COMMANDS if kind(c) == "benchmark"):
        if argv[:3] == ["python", "-m", "pytest"]:
            paths = [a for a in argv[3:] if not a.startswith("-")]
            assert paths and all((REPO / p).exists() for p in paths), argv
            continue
        script = REPO / argv[1]
        assert script.is_file(), f"README names {argv[1]}, which does not exist"
        source = script.read_text(encoding="utf-8")
        for flag in (a.split("=")[0] for a in argv[2:] if a.startswith("--")):
            assert f'"{flag}"' in source, f"{argv[1]} has no {flag} option (README: {argv})"


def test_install_lines_are_what_ci_runs():
    ci = (REPO / ".ci/run").read_text(encoding="utf-8")
    for argv in (c for c in COMMANDS if kind(c) == "install"):
        for spec in argv[2:]:
            base = spec.replace("'", "")
            assert base.startswith("torch==") or base.startswith("-e") or base in (".", ".[test]"), argv
            if base.startswith("torch=="):
                assert base in ci, f"README pins {base}; CI installs another torch"
    tests = [c for c in COMMANDS if kind(c) == "tests"]  # CI's interpreter is python3
    assert tests and all(shlex.join(["python3", *c[1:]]) in ci for c in tests), \
        "CI runs the README's test command"
    assert "-m heavy tests/cli/test_readme.py -k commands_run" in ci, \
        "CI runs the README's commands word for word"


def test_schedule_commands_run_as_written():
    """The torch-free commands run in the default suite, as written."""
    for argv in (c for c in COMMANDS if c[:2] == ["pipeplan", "schedule"]):
        r = subprocess.run([sys.executable, "-m", "pipeplan", *argv[1:]], cwd=REPO,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and r.stdout.strip(), (argv, r.stdout, r.stderr)


# ------------------------------------------------------------------ heavy: run them all
def _env(bin_dir: Path) -> dict:
    """PATH with `pipeplan`, `torchrun` and `python` as the interpreter running these tests
    (so the package under test answers, however it is installed)."""
    env = dict(os.environ)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__import__("pipeplan").__file__)))
    if not env.get("PYTHONPATH") and Path(here, "pipeplan").is_dir():
        env["PYTHONPATH"] = here
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    return env


def _shims(bin_dir: Path) -> None:
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name, target in (("pipeplan", "-m pipeplan"), ("torchrun", "-m torch.distributed.run"),
                         ("python", "")):
        path = bin_dir / name
        path.write_text(f'#!/bin/sh\nexec "{sys.executable}" {target} "$@"\n')
        path.chmod(0o755)


def fresh_copy(dest: Path) -> Path:
    """The repository as a fresh clone has it, plus this checkout's uncommitted files."""
    try:
        files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO,
                               capture_output=True, check=True, timeout=60).stdout
        names = [n for n in files.decode().split("\0") if n]
    except (OSError, subprocess.CalledProcessError):
        names = None
    if names is None:
        shutil.copytree(REPO, dest, ignore=shutil.ignore_patterns(
            ".git", "__pycache__", "*.egg-info", "build", "runs", ".pytest_cache"))
        return dest
    for name in names:
        src = REPO / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_as_written(argv: list[str], cwd: Path, env: dict, timeout: float = 600) -> str:
    if kind(argv) == "torchrun":  # two node groups on this machine
        argv = [a.replace("HOST:PORT", f"127.0.0.1:{free_port()}") for a in argv]
        nodes = [subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True) for _ in range(2)]
        try:
            outs = [n.communicate(timeout=timeout)[0] for n in nodes]
        finally:
            for n in nodes:
                if n.poll() is None:
                    n.kill()
        assert [n.returncode for n in nodes] == [0, 0], f"{shlex.join(argv)}\n" + "\n".join(outs)
        return "\n".join(outs)
    r = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"README: `{shlex.join(argv)}` exit {r.returncode}\n{r.stdout}\n{r.stderr}"
    assert "Traceback" not in r.stderr, r.stderr
    return r.stdout


@pytest.mark.heavy
@pytest.mark.timeout(1800)
def test_readme_commands_run_word_for_word(tmp_path):
    clone = fresh_copy(tmp_path / "clone")
    _shims(tmp_path / "bin")
    env = _env(tmp_path / "bin")
    for argv in (c for c in COMMANDS if kind(c) in ("pipeplan", "torchrun")):
        out = run_as_written(argv, clone, env)
        if argv[:2] == ["pipeplan", "report"]:
            assert (clone / argv[2] / "report.html").is_file(), out
        for flag in ("--trace", "-o"):
            if flag in argv and argv[1] in ("run", "profile", "compile"):
                assert (clone / argv[argv.index(flag) + 1]).exists(), (argv, out)


@pytest.mark.heavy
@pytest.mark.timeout(7200)
def test_readme_benchmarks_run_word_for_word(tmp_path):
    clone = fresh_copy(tmp_path / "clone")
    _shims(tmp_path / "bin")
    env = _env(tmp_path / "bin")
    for argv in (c for c in COMMANDS if kind(c) == "benchmark"):
        run_as_written(argv, clone, env, timeout=3600)
