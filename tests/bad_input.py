"""Run `pipeplan` on a corpus of bad inputs in one child process, bounded in time and memory.

    python tests/bad_input.py CASES.json OUT.json

CASES.json is a list of {"name", "argv"}; for each case the CLI's `main(argv)` runs
in this process (one interpreter start for the whole corpus) and OUT.json gets
{"name", "rc", "out", "err", "seconds"}. An exception the CLI lets escape is
recorded with its traceback (rc 99), so the test sees it. The process limits its
own address space (MEMORY_LIMIT), so a case that allocates without bound fails
instead of swapping; the caller's subprocess timeout bounds the time.
"""
from __future__ import annotations

import contextlib
import io
import json
import resource
import sys
import time
import traceback

MEMORY_LIMIT = 6 * 2**30


def main(cases_path: str, out_path: str) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    from pipeplan.cli import main as pipeplan

    with open(cases_path) as f:
        cases = json.load(f)
    results = []
    for case in cases:
        out, err = io.StringIO(), io.StringIO()
        start = time.monotonic()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = pipeplan(case["argv"])
            except SystemExit as e:
                rc = e.code if isinstance(e.code, int) else 1
            except BaseException:
                traceback.print_exc()
                rc = 99
        results.append({"name": case["name"], "rc": rc, "out": out.getvalue(),
                        "err": err.getvalue(), "seconds": time.monotonic() - start})
        with open(out_path, "w") as f:  # what finished so far, should a later case hang
            json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
