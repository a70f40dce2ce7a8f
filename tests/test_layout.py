"""The package's shape: imports point down the layers, no module imports itself back
through others, and the wheel holds every module of the source tree.

Layers, top to bottom (a module may import its own layer or any layer below):
cli > planner > backends > compiler > dsl > schedules > (errors, the package root).
examples/ holds user models and plans: it may import nothing of pipeplan's but errors.
"""
from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("schedules", "dsl", "compiler", "backends", "planner", "cli")  # bottom to top
NOT_PACKAGE = {"tests", "docs", "scripts", "build", "dist"}


def source_modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in NOT_PACKAGE or rel.name == "setup.py" and len(rel.parts) == 1 \
                or any(p.startswith(".") for p in rel.parts):
            continue
        parts = ["pipeplan", *rel.with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports_of(module: str, path: Path, known: set[str]) -> set[str]:
    """Every pipeplan module `module` imports, at any depth of its code (lazy imports too)."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in known else target)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m in known and m != module}


def graph() -> nx.DiGraph:
    modules = source_modules()
    g = nx.DiGraph()
    g.add_nodes_from(modules)
    for m, path in modules.items():
        g.add_edges_from((m, t) for t in imports_of(m, path, set(modules)))
    return g


def layer(module: str) -> int:
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else ""
    return LAYERS.index(top) if top in LAYERS else -1  # the root package and errors: lowest


def test_imports_point_down_the_layers():
    entry = {"pipeplan.__main__"}  # `python -m pipeplan`: the command line's entry point
    upward = sorted(f"{a} -> {b}" for a, b in graph().edges
                    if a not in entry and layer(b) > layer(a))
    assert not upward, "upward imports (move the shared piece down):\n" + "\n".join(upward)


def test_examples_import_no_pipeplan_internals():
    g = graph()
    bad = sorted(f"{a} -> {b}" for a, b in g.edges
                 if a.startswith("pipeplan.examples") and not b.startswith(("pipeplan.examples",
                                                                            "pipeplan.errors")))
    assert not bad, "\n".join(bad)


def test_no_import_circles():
    circles = [sorted(c) for c in nx.strongly_connected_components(graph()) if len(c) > 1]
    assert not circles, f"modules that import each other (one idea: merge, or move the shared " \
                        f"piece down): {circles}"


def test_the_checker_sees_what_it_must():
    """The walk finds lazy and relative imports (else the tests above hold by construction)."""
    g = graph()
    assert ("pipeplan.cli.check", "pipeplan.compiler") in g.edges  # a lazy import in a function
    assert ("pipeplan.backends.runtime.data", "pipeplan.compiler.data") in g.edges
    assert g.number_of_nodes() > 100 and g.number_of_edges() > 300


@pytest.mark.slow
def test_the_wheel_holds_every_module(tmp_path):
    """`pip wheel .` (no editable install): every source module is in the wheel, no generic
    top-level package (dsl, compiler, ...) beside `pipeplan`."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split("\n")
    src = tmp_path / "src"  # a copy: the build's own folders stay out of the checkout
    for f in filter(None, files):
        if (ROOT / f).is_file():
            (src / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, src / f)
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps",
                    "--no-build-isolation", "-q", "-w", str(tmp_path)],
                   check=True, capture_output=True, timeout=600, cwd=tmp_path)
    wheel = next(tmp_path.glob("pipeplan-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {"pipeplan/" + str(p.relative_to(ROOT)) for p in source_modules().values()}
    assert not expected - names, f"missing from the wheel: {sorted(expected - names)}"
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"pipeplan"}, tops
    assert "pipeplan/dsl/plan.lark" in names and "pipeplan/examples/gpt_pp4_1f1b.plan" in names
