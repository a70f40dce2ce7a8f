"""Where a run writes, checked before any process starts: every output's folder exists (it is
made) and can be written, or the run is refused naming the output, the path and why.

The paths come resolved by the one rule (dsl/ast.py Plan.resolve_path): a path written in
the plan file is relative to the plan file's folder, one typed on the command line (a flag,
or a `--set` value) to the working directory.
"""
from __future__ import annotations

import os
from typing import Iterable, Optional

from ...errors import PipeplanError


def run_outputs(plan, trace: Optional[str] = None, metrics: Optional[str] = None,
                profile_out: Optional[str] = None) -> list[tuple[str, str, bool]]:
    """(what, absolute path, is a folder) for everything a run of `plan` writes."""
    t = plan.train
    found = [("--trace", trace, False), ("--metrics", metrics, False),
             ("the cost file (-o)", profile_out, False),
             ("train.log_dir", t.log_dir, True),
             ("train.checkpoint.dir", t.checkpoint.dir if t.checkpoint else None, True)]
    return [(what, os.path.abspath(path), folder) for what, path, folder in found if path]


def check_outputs(outputs: Iterable[tuple[str, str, bool]]) -> None:
    """Make each output's folder (a folder output: itself) and check it can be written."""
    for what, path, folder in outputs:
        where = path if folder else os.path.dirname(path)
        if not folder and os.path.isdir(path):
            raise PipeplanError(f"{what} {path}: is a folder; give a file name "
                                "(nothing was started)")
        blocked = _file_in_the_way(where)
        if blocked:
            raise PipeplanError(f"{what} {path}: {blocked} is a file, not a folder (nothing "
                                "was started)")
        try:
            os.makedirs(where, exist_ok=True)
        except OSError as e:
            raise PipeplanError(f"{what} {path}: cannot create the folder {where}: "
                                f"{e.strerror or e} (nothing was started)") from None
        target = path if os.path.exists(path) else where
        if not os.access(target, os.W_OK) or (folder and not os.access(where, os.X_OK)):
            raise PipeplanError(f"{what} {path}: {target} is not writable (nothing was "
                                "started)")


def _file_in_the_way(folder: str) -> Optional[str]:
    """The nearest existing ancestor of `folder` (itself included) when it is not a folder."""
    while not os.path.exists(folder):
        parent = os.path.dirname(folder)
        if parent == folder:
            return None
        folder = parent
    return None if os.path.isdir(folder) else folder
