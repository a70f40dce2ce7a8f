"""`pipeplan schedule`: formats, compare, load, and one-line errors with exit code 2."""
import json

import pytest

from pipeplan.cli import main
from pipeplan.schedules import generate, schedule_to_csv, schedule_to_json


def run(capsys, *argv):
    code = main(["schedule", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_table_states_bubble_definition(capsys):
    code, out, _ = run(capsys, "zbv", "-p", "4", "-m", "8")
    assert code == 0
    assert "0.0588" in out and "whole iteration" in out and "critical path" in out


def test_ascii_timeline_has_a_row_per_rank(capsys):
    code, out, _ = run(capsys, "1f1b", "-p", "3", "-m", "4", "--format", "ascii")
    assert code == 0
    assert [line[:6] for line in out.splitlines() if line.startswith("rank ")] == ["rank 0", "rank 1", "rank 2"]


def test_json_output_matches_schema(capsys):
    code, out, _ = run(capsys, "zbh1", "-p", "4", "-m", "8", "--format", "json")
    data = json.loads(out)
    assert code == 0 and data["schedule"] == "zbh1" and abs(data["metrics"]["bubble"] - 1 / 9) < 1e-9


def test_trace_and_svg(capsys, tmp_path):
    out_file = tmp_path / "t.json"
    assert run(capsys, "zbv", "-p", "2", "-m", "4", "-f", "trace", "-o", str(out_file))[0] == 0
    trace = json.loads(out_file.read_text())
    pids = {e["pid"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert pids == {0, 1}
    assert any(e["ph"] == "C" for e in trace["traceEvents"]) and any(e["ph"] == "s" for e in trace["traceEvents"])
    code, out, _ = run(capsys, "zbv", "-p", "2", "-m", "4", "-f", "svg")
    assert code == 0 and out.startswith("<svg") and out.count("<title>") == 2 * 2 * 4 * 3


def test_svg_gantt_legend_axis_and_labels_at_p8_m32(capsys):
    """The Gantt at p=8, m=32: a legend naming F/B/W, a time axis with round ticks up to the
    makespan, and every action's label drawn inside its own box (none vanishes)."""
    import xml.etree.ElementTree as ET

    code, out, _ = run(capsys, "zbh1", "-p", "8", "-m", "32", "-f", "svg")
    assert code == 0
    ns = "{http://www.w3.org/2000/svg}"
    root = ET.fromstring(out)
    legend = [g.find(ns + "text").text for g in root.iter(ns + "g") if g.get("class") == "legend"]
    assert [x.split()[0] for x in legend[:3]] == ["F", "B", "W"]
    ticks = [line for line in root.iter(ns + "line") if line.get("class") == "tick"]
    xs = [float(t.get("x1")) for t in ticks]
    assert len(ticks) >= 5 and xs == sorted(xs) and len({round(b - a, 3) for a, b in zip(xs, xs[1:])}) == 1
    boxes = [r for r in root.iter(ns + "rect") if r.find(ns + "title") is not None]
    assert len(boxes) == 8 * 32 * 3
    texts = {(round(float(t.get("x")) - 2, 2), round(float(t.get("y")))): t.text
             for t in root.iter(ns + "text") if t.get("fill") == "white"}
    assert len(texts) == len(boxes)  # every box labelled ...
    for r in boxes:  # ... with text no wider than its box (6.7 px per 11 px character)
        x, y, w = float(r.get("x")), float(r.get("y")), float(r.get("width"))
        label = next(t for (tx, ty), t in texts.items() if abs(tx - x) < 0.02 and 0 < ty - y < 28)
        assert label and len(label) * 6.7 <= w


def test_compare_prints_one_table_and_skips_what_does_not_fit(capsys):
    code, out, _ = run(capsys, "--compare", "gpipe,1f1b,zbv,auto", "-p", "4", "-m", "8", "--memory-limit", "4")
    assert code == 0
    assert "gpipe: skipped, gpipe needs 8" in out
    rows = [line.split()[0] for line in out.splitlines()[2:] if line.startswith(("1f1b", "zbv", "auto"))]
    assert rows[:2] == ["1f1b", "zbv"] and rows[2].startswith("auto")


def test_load_json_and_csv(capsys, tmp_path):
    s = generate("zbh1", 4, 8)
    (tmp_path / "s.json").write_text(schedule_to_json(s))
    (tmp_path / "s.csv").write_text(schedule_to_csv(s))
    for name in ("s.json", "s.csv"):
        code, out, _ = run(capsys, "--load", str(tmp_path / name))
        assert code == 0 and "0.1111" in out


@pytest.mark.parametrize("argv,message", [
    (["nope", "-p", "4", "-m", "8"], "unknown schedule kind 'nope'"),
    (["zbv", "-p", "4", "-m", "8", "-v", "3"], "zbv needs virtual=2"),
    (["1f1b", "-p", "4", "-m", "0"], "microbatches must be an integer >= 1"),
    (["1f1b", "-p", "0", "-m", "4"], "ranks must be an integer >= 1"),
    (["zbh2", "-p", "4", "-m", "8", "--memory-limit", "2"], "above the memory limit 2"),
    (["1f1b", "-p", "4", "-m", "8", "--costs", "F=x"], "bad cost 'F=x'"),
    (["1f1b"], "--ranks and --microbatches are required"),
    ([], "name a schedule kind"),
    (["--load", "/nonexistent.json"], "cannot read /nonexistent.json"),
    (["1f1b", "-p", "2", "-m", "4", "--stage-costs", "1,1;1,1,1"], "stage 0 is '1,1'; expected three numbers"),
    (["1f1b", "-p", "2", "-m", "4", "--stage-costs", "1,1,1"], "per-stage costs list 1 stages"),
])
def test_bad_input_is_one_line_exit_2(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_malformed_files_exit_2(capsys, tmp_path):
    bad_json, bad_csv = tmp_path / "b.json", tmp_path / "b.csv"
    bad_json.write_text('{"ranks": 2')
    bad_csv.write_text("0F0,0Z0\n")
    deadlock = tmp_path / "d.csv"
    deadlock.write_text("0F0,0B0,0F1,0B1\n1F0,1F1,1B0,1B1\n")
    for path, message in ((bad_json, "malformed schedule JSON"), (bad_csv, "malformed schedule CSV"),
                          (deadlock, "deadlock: rank 0 blocks at BW(stage 0, mb 0)")):
        code, _, err = run(capsys, "--load", str(path))
        assert code == 2 and message in err and "Traceback" not in err


def test_stage_costs_change_the_timing_and_auto_reports_its_search(capsys):
    """A heavy first and last stage: 1f1b's makespan follows them; auto prints its time and bound gap."""
    heavy = "2,2,2;1,1,1;1,1,1;2,2,2"
    code, out, _ = run(capsys, "1f1b", "-p", "4", "-m", "4", "--stage-costs", heavy, "--format", "json")
    timed = json.loads(out)["metrics"]["makespan"]
    code, out, _ = run(capsys, "1f1b", "-p", "4", "-m", "4", "--format", "json")
    assert timed > json.loads(out)["metrics"]["makespan"]
    code, out, err = run(capsys, "auto", "-p", "4", "-m", "4", "-v", "1", "--stage-costs", heavy,
                         "--memory-limit", "4")
    assert code == 0 and "per-stage" in out and "gap" in out
    assert err.startswith("auto: ") and "s of CPU" in err and "bound over the placements searched" in err
