"""The time model against published runs (heavy: minutes on 2 cores; run with -m heavy).

* Narayanan et al. 2021 Table 1 (calibration/table1.py), with the stored fit
  (compiler/estimate/calibration.json): every row within 10% of its published TFLOP/s per
  GPU and Spearman >= 0.8 across the rows;
* `pipeplan check` on the 1T row (128 layers, hidden 25600, PP 64, 3072 ranks) in under 30 s
  of CPU time and 1 GiB, printing the per-rank breakdown and the predicted MFU.
"""
from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


@pytest.mark.heavy
def test_table1_rows_within_ten_percent_and_ranked():
    sys.path.insert(0, str(HERE / "calibration"))
    from table1 import spearman, timings

    from pipeplan.compiler.estimate.device import device_model
    published, predicted = [], []
    for row, timing, _ in timings():
        p = timing.time_on(device_model(timing.plan))
        published.append(row[-1])
        predicted.append(p.tflops_per_gpu)
        assert abs(p.tflops_per_gpu / row[-1] - 1) <= 0.10, (row[0], p.tflops_per_gpu)
    assert spearman(published, predicted) >= 0.8


@pytest.mark.heavy
def test_check_of_the_1t_plan_is_fast_and_small():
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run([sys.executable, "-m", "pipeplan", "check",
                          str(HERE / "calibration" / "gpt_1t.plan")], capture_output=True,
                         text=True, cwd=REPO, env={**os.environ}, timeout=600)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert out.returncode == 0, out.stderr[-2000:]
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert cpu < 30, cpu
    assert after.ru_maxrss < 1024 * 1024  # KiB on Linux
    assert "step per pp rank (s): compute / exposed comm / bubble / optimizer" in out.stdout
    assert "pp rank  63:" in out.stdout and "predicted MFU 0." in out.stdout
