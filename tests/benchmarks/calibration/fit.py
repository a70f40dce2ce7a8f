"""Fits the A100 family's three efficiency constants (compiler/estimate/devices.py:
Efficiency: gemm_peak, memory, link) on Narayanan et al. 2021 Table 1 (table1.py) only, by
least squares on log(predicted / published TFLOP/s per GPU), and stores the result in
compiler/estimate/calibration.json.

    python tests/benchmarks/calibration/fit.py          # ~1-2 min on 2 cores

Bounds: every constant is a fraction of a datasheet figure, in (0, 1].
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys

import numpy as np
from scipy.optimize import least_squares

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from table1 import timings  # noqa: E402

from pipeplan.compiler.estimate.device import device_model, model_of  # noqa: E402
from pipeplan.compiler.estimate.devices import Efficiency, calibration_path  # noqa: E402


def main() -> int:
    rows = timings()
    published = np.array([row[-1] for row, _, _ in rows], float)
    bases = [device_model(t.plan) for _, t, _ in rows]

    def predicted(x):
        eff = Efficiency(*x, source="fit")
        return np.array([t.time_on(model_of(t.plan, dataclasses.replace(b.hardware,
                                                                         efficiency=eff)))
                         .tflops_per_gpu for (_, t, _), b in zip(rows, bases)])

    fit = least_squares(lambda x: np.log(predicted(x) / published), [0.8, 0.8, 0.8],
                        bounds=([0.05] * 3, [1.0] * 3), diff_step=1e-3)
    gemm_peak, memory, link = (round(float(v), 4) for v in fit.x)
    ratios = predicted([gemm_peak, memory, link]) / published
    path = calibration_path()
    try:
        with open(path, encoding="utf-8") as f:
            stored = json.load(f)
    except OSError:
        stored = {}
    stored["a100"] = {
        "gemm_peak": gemm_peak, "memory": memory, "link": link,
        "source": "tests/benchmarks/calibration/fit.py on Narayanan et al. 2021 Table 1",
        "ratios": {row[0]: round(float(r), 4) for (row, _, _), r in zip(rows, ratios)}}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(stored, f, indent=2)
        f.write("\n")
    print(f"gemm_peak={gemm_peak} memory={memory} link={link} -> {path}")
    print("predicted / published:", " ".join(f"{r:.3f}" for r in ratios))
    return 0


if __name__ == "__main__":
    sys.exit(main())
