"""`pipeplan verify` on every example plan, several times: the judge must say EQUAL each time.

    python tests/benchmarks/verify_examples.py            # 3 rounds, fp64
    python tests/benchmarks/verify_examples.py --rounds 1 --precision fp32

Runs on demand (minutes per plan on a small machine; too long for the test
suite). Prints one line per run with the verdict and the largest loss,
gradient and parameter differences; exits 1 if any run was not EQUAL.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
DIFF = re.compile(r"max \|(loss|grad|param) - reference \w+\|\s+= (\S+)")


def verify(plan: Path, precision: str, timeout: float) -> tuple[bool, str]:
    started = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "pipeplan", "verify", str(plan),
                        "--precision", precision], capture_output=True, text=True,
                       timeout=timeout)
    diffs = " ".join(f"{k}={v}" for k, v in DIFF.findall(r.stdout))
    equal = r.returncode == 0 and f"EQUAL to single-process training ({precision}" in r.stdout
    detail = diffs if r.returncode in (0, 1) else (r.stderr.strip().splitlines() or ["?"])[-1]
    return equal, f"{time.perf_counter() - started:6.0f} s  {detail}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--precision", choices=("fp64", "fp32"), default="fp64")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per verify")
    args = ap.parse_args()
    failed = 0
    for round_ in range(1, args.rounds + 1):
        for plan in sorted(EXAMPLES.glob("*.plan")):
            equal, detail = verify(plan, args.precision, args.timeout)
            failed += not equal
            print(f"round {round_} {plan.name:28s} {'EQUAL' if equal else 'NOT EQUAL':9s} "
                  f"{detail}", flush=True)
    print(f"{failed} of {args.rounds * len(list(EXAMPLES.glob('*.plan')))} runs not EQUAL "
          f"({args.precision})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
