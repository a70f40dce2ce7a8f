"""`pipeplan checkpoint verify DIR`: is a checkpoint (or every checkpoint of a folder) intact.

DIR is one checkpoint (a step_N folder) or a train.checkpoint.dir (each of its
step_N folders, and a decoupled DiLoCo run's island<d>/ series). For each it
checks what resume, `export` and `plan-diff` check before loading:
manifest.json readable; every file it lists present, of its size and its
sha256; `.metadata` readable without running code (an allow-list of DCP's
classes) and naming only listed files.
Exit 0 when every checkpoint checked is intact, 1 when one is damaged.
"""
from __future__ import annotations

import os
import time

from ..errors import PipeplanError


def add_commands(sub) -> None:
    ck = sub.add_parser("checkpoint", help="inspect checkpoints (verify: are they intact)")
    inner = ck.add_subparsers(dest="checkpoint_command", metavar="ACTION", required=True)
    v = inner.add_parser("verify", help="check a checkpoint's files against its manifest",
                         description=__doc__.split("\n\n")[1])
    v.add_argument("dir", help="a checkpoint (step_N folder) or a train.checkpoint.dir")
    v.set_defaults(func=_cmd_verify)


def _folders(path: str) -> list[str]:
    """The checkpoints under `path`, newest first per series."""
    from ..backends.state.checkpoint.integrity import step_dir, steps

    if os.path.isfile(os.path.join(path, "manifest.json")) or \
            os.path.isfile(os.path.join(path, ".metadata")):
        return [path]
    if not os.path.isdir(path):
        raise PipeplanError(f"{path}: no such checkpoint folder")
    series = [path] + sorted(os.path.join(path, n) for n in os.listdir(path)
                             if n.startswith("island") and os.path.isdir(os.path.join(path, n)))
    out = [step_dir(s, k) for s in series for k in steps(s)]
    if not out:
        raise PipeplanError(f"{path}: not a checkpoint (no manifest.json) and no step_N "
                            f"checkpoint in it")
    return out


def _cmd_verify(args) -> int:
    from ..backends.state.checkpoint.verify import LEGACY, problems

    bad = 0
    for folder in _folders(args.dir):
        started = time.perf_counter()
        wrong, manifest = problems(folder)
        took = time.perf_counter() - started
        if wrong:
            bad += 1
            print(f"DAMAGED {folder}:")
            print("\n".join(f"  - {w}" for w in wrong))
        elif manifest.get("files") is None:
            print(f"unverified {folder}: {LEGACY}")
        else:
            files = manifest["files"]
            size = sum(f["size"] for f in files.values())
            print(f"ok {folder}: step {manifest.get('step')}, {len(files)} files, "
                  f"{size:,} bytes, sha256 matches ({took:.2f} s)")
    return 1 if bad else 0
