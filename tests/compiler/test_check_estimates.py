"""`pipeplan check` prints the compiler's per-rank estimates once the model is traced."""
from pathlib import Path

from pipeplan.cli import main

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_check_prints_estimates_per_pipeline_rank(capsys):
    assert main(["check", str(EXAMPLES / "gpt_pp4_1f1b.plan")]) == 0
    out = capsys.readouterr().out
    tail = out.split("# after tracing the model")[1]
    rows = [line.split() for line in tail.splitlines() if line.strip()[:1].isdigit()]
    assert [int(r[0]) for r in rows] == [0, 1, 2, 3]  # one row per pipeline rank
    assert all(float(r[1]) > 0 for r in rows)  # parameter MiB held by each rank
    assert "predicted bubble" in tail


def test_check_no_model_skips_tracing(capsys):
    assert main(["check", "--no-model", str(EXAMPLES / "gpt_pp4_1f1b.plan")]) == 0
    assert "after tracing" not in capsys.readouterr().out


def test_check_reports_model_errors_at_the_plan_line(tmp_path, capsys):
    text = (EXAMPLES / "gpt_pp4_1f1b.plan").read_text().replace("models/gpt.py:GPT", "models/gpt.py:GTP")
    bad = tmp_path / "bad.plan"
    bad.write_text(text)
    (tmp_path / "models").symlink_to(EXAMPLES / "models")
    assert main(["check", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}:" in err and "GTP" in err and "did you mean" in err
