"""Fits a device family's three efficiency constants (compiler/estimate/devices.py:
Efficiency: gemm_peak, memory, link) on its calibration set only, by least squares on
log(predicted / published throughput), and stores the result in
compiler/estimate/calibration.json:

* a100: Narayanan et al. 2021 Table 1 (table1.py), TFLOP/s per GPU;
* h100: MosaicML's H100 80GB BF16 table (mosaic.py), its rows at 2,048 tokens a sequence
  only (mosaic.CALIBRATION: 20 rows, 760M-70B on 8-64 GPUs), tokens/s per GPU; its other
  rows (512-65,536 tokens) are held out, as is the whole A100 table there.

    python tests/benchmarks/calibration/fit.py [--family a100|h100]   # ~1-2 min on 2 cores

Bounds: every constant is a fraction of a datasheet figure, in (0, 1].
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import numpy as np
from scipy.optimize import least_squares

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mosaic  # noqa: E402
from table1 import timings  # noqa: E402

from pipeplan.compiler.estimate.device import device_model, model_of  # noqa: E402
from pipeplan.compiler.estimate.devices import Efficiency, calibration_path  # noqa: E402


SOURCES = {"a100": "tests/benchmarks/calibration/fit.py on Narayanan et al. 2021 Table 1",
           "h100": "tests/benchmarks/calibration/fit.py on MosaicML's H100 80GB BF16 table "
                   "(llm-foundry), its 2,048-token rows"}


def calibration_set(family: str) -> list:
    """(row name, published throughput, its throughput from a predict.Prediction, Timing)
    of each row the family is fitted on."""
    if family == "a100":
        return [(row[0], row[-1], lambda p: p.tflops_per_gpu, t) for row, t, _ in timings()]
    return [(mosaic.name_of(row), row[5], mosaic.tokens_per_gpu(row), mosaic.timing(row, "h100"))
            for row in mosaic.CALIBRATION]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", choices=sorted(SOURCES), default="a100")
    family = ap.parse_args(argv).family
    rows = calibration_set(family)
    published = np.array([r[1] for r in rows], float)
    bases = [device_model(t.plan) for *_, t in rows]

    def predicted(x):
        eff = Efficiency(*x, source="fit")
        return np.array([of(t.time_on(model_of(t.plan, dataclasses.replace(
            b.hardware, efficiency=eff)))) for (_, _, of, t), b in zip(rows, bases)])

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
    stored[family] = {
        "gemm_peak": gemm_peak, "memory": memory, "link": link, "source": SOURCES[family],
        "ratios": {r[0]: round(float(q), 4) for r, q in zip(rows, ratios)}}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(stored, f, indent=2)
        f.write("\n")
    print(f"{family}: gemm_peak={gemm_peak} memory={memory} link={link} -> {path}")
    print("predicted / published:", " ".join(f"{r:.3f}" for r in ratios))
    return 0


if __name__ == "__main__":
    sys.exit(main())
