"""`pipeplan compile PLAN -o BUILD/`: the build directory is complete and consistent."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from pipeplan.cli import main
from pipeplan.compiler import compile_plan
from pipeplan.dsl import load_plan
from pipeplan.schedules import schedule_from_json

REPO = Path(__file__).resolve().parents[2]


def test_compile_writes_a_readable_build(tmp_path, capsys):
    plan_path = REPO / "examples" / "moe_pp2_ep2_zbv.plan"
    out = tmp_path / "build"
    assert main(["compile", str(plan_path), "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "split = [" in printed and "predicted bubble" in printed
    names = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}
    assert names == {"plan.plan", "schedule.json", "report.md", "manifest.json", "trace.json",
                     "stages/stage_0.py", "stages/stage_1.py", "stages/stage_2.py",
                     "stages/stage_3.py"}
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["plan"]["sha256"] == hashlib.sha256(plan_path.read_bytes()).hexdigest()
    model_file = REPO / "examples" / "models" / "moe_gpt.py"
    assert manifest["model_source"]["sha256"] == hashlib.sha256(model_file.read_bytes()).hexdigest()
    for name, digest in manifest["files"].items():
        assert hashlib.sha256((out / name).read_bytes()).hexdigest() == digest
    schedule = schedule_from_json((out / "schedule.json").read_text())
    assert schedule.stage_to_rank == (0, 1, 1, 0)
    trace = json.loads((out / "trace.json").read_text())
    slices = [ev for ev in trace["traceEvents"] if ev.get("ph") == "X"]
    # µs (Chrome's unit) of the simulated seconds: the last slice ends at the makespan
    makespan_s = trace["metadata"]["makespan"]
    assert max(ev["ts"] + ev["dur"] for ev in slices) == pytest.approx(makespan_s * 1e6, rel=1e-9)
    report = (out / "report.md").read_text()
    for section in ("## Split", "## Expert placement", "## Estimates per rank", "## Timeline",
                    "## Tied parameters"):
        assert section in report
    stage = (out / "stages" / "stage_1.py").read_text()
    assert "def forward(self, " in stage and "layers.1" in stage

    # the resolved plan loads from the build directory and pins the same stages
    rebuilt = compile_plan(load_plan(str(out / "plan.plan")))
    original = compile_plan(load_plan(str(plan_path)))
    assert [s.module_names for s in rebuilt.stages] == [s.module_names for s in original.stages]
    assert rebuilt.plan.pipeline.split.kind == "points"

    # the collectives table: one row per (group, op), one column per pipeline rank
    from pipeplan.compiler.estimate.report import human_bytes
    assert "## Collectives per step" in report
    assert "| group | collective | pp rank 0 | pp rank 1 |" in report
    per_pp = [original.estimates.ranks[r * 2] for r in range(2)]  # dp 2 x tp 1 per pp rank
    keys = sorted({k for x in per_pp for k in x.collectives})
    assert ("ep", "alltoall") in keys and ("dp", "allreduce") in keys  # edp has 1 rank
    for group, op in keys:
        cells = " | ".join(human_bytes(x.collectives.get((group, op), 0)) for x in per_pp)
        assert f"| {group} (" in report and f") | {op} | {cells} |" in report
    assert "from measured CPU model" in report or "from built-in defaults" in report


def test_report_states_the_plans_device_model_and_flag_overrides(tmp_path, capsys):
    plan_path = tmp_path / "r.plan"
    plan_path.write_text(
        f'model {{\n  source = "{REPO}/tests/compiler/models.py:Regressor"\n'
        '  args = { layers = 4 }\n  inputs = { x = float32[batch, 8] }\n  loss = mse\n}\n'
        "mesh { pp = 2 }\npipeline { schedule = 1f1b  microbatches = 2 }\n"
        "train { global_batch = 4 }\n"
        "device {\n  name = a100\n  flops = 20TFLOP/s\n  inter_node = 100Gb/s\n}\n"
        "data = synthetic(inputs = { x = mask })\n")  # the one data field of any shape
    out = tmp_path / "build"
    assert main(["compile", str(plan_path), "-o", str(out), "--link-gbps", "25"]) == 0
    report = (out / "report.md").read_text()
    assert "20 TFLOP/s peak (" in report and " GB/s between nodes" in report
    assert "25 GB/s between nodes" in report
    assert "from profile a100 (devices.py; fit: " in report
    assert f"plan device section ({plan_path}:10); overridden by --link-gbps" in report
    assert "| group | collective |" not in report  # dp = tp = 1: nothing collective
    assert "No collectives" in report
    assert "device {\n  name = a100\n  flops = 20TFLOP/s" in (out / "plan.plan").read_text()
