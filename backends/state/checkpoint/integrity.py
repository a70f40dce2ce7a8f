"""A checkpoint's files and their checksums: recorded when it is written, verified before use.

The manifest (manifest.py) lists every file of the step folder but itself,

    "files": {"<name>": {"size": <bytes>, "sha256": "<hex>"}, ...}

computed after every rank has written (each rank hashes a share of the files;
`digest_share`), and written last, atomically (manifest.write_manifest), before the
folder is renamed into place. `damage(folder)` reads every listed file again
(streamed, in parallel threads: hashlib releases the GIL; memory is
`CHUNK` per thread) and names each that is missing, of another size or of
another hash. `choose(series)` is the newest checkpoint of a series that is
intact, with a line for each newer one skipped.

Nothing here unpickles: the hashes are checked before `.metadata` is read
(trusted.py reads it, with an allow-list).
"""
from __future__ import annotations

import hashlib
import os
import re
from concurrent.futures import ThreadPoolExecutor

from ....errors import PipeplanError

HASH = "sha256"  # 0.75 GB/s a core here, blake2b 0.37 (hashlib, 64 MiB buffer)
CHUNK = 1 << 20  # bytes read at once per file being hashed
WORKERS = 8  # files hashed at once, at most
STEP_DIR = re.compile(r"^step_(\d+)$")


class DamagedCheckpoint(PipeplanError):
    """A checkpoint whose files do not match its manifest (each damaged file named)."""


def hash_file(path: str) -> dict:
    """{"size", HASH} of the file at `path`, read in CHUNK pieces."""
    h, size = hashlib.new(HASH), 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(CHUNK)
        view = memoryview(buf)
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(view[:n])
            size += n
    return {"size": size, HASH: h.hexdigest()}


def digest(folder: str, names) -> dict[str, dict]:
    """name -> {"size", HASH} for `names` in `folder`, hashed in parallel threads."""
    names = sorted(names)
    if not names:
        return {}
    with ThreadPoolExecutor(max_workers=min(WORKERS, len(names))) as pool:
        return dict(zip(names, pool.map(lambda n: hash_file(os.path.join(folder, n)), names)))


def checkpoint_files(folder: str, manifest_name: str) -> list[str]:
    """The files of a written checkpoint (everything in it but the manifest)."""
    return sorted(n for n in os.listdir(folder)
                  if n != manifest_name and os.path.isfile(os.path.join(folder, n)))


def digest_share(folder: str, names: list[str], index: int, count: int) -> dict[str, dict]:
    """This rank's share (every `count`-th file from `index`) of the files' digests."""
    return digest(folder, sorted(names)[index::count])


def damage(folder: str, files: dict) -> list[str]:
    """One line per file of `files` (the manifest's record) that is not as recorded."""
    out, present = [], {}
    for name, want in sorted(files.items()):
        path = os.path.join(folder, name)
        if os.sep in name or name in ("", ".", ".."):
            out.append(f"{name!r}: not a file name of this folder")
        elif not os.path.isfile(path):
            out.append(f"{path}: missing")
        elif os.path.getsize(path) != want.get("size"):
            out.append(f"{path}: {os.path.getsize(path)} bytes, the manifest says "
                       f"{want.get('size')} (truncated or overwritten)")
        else:
            present[name] = want
    for name, got in digest(folder, present).items():
        if got[HASH] != present[name].get(HASH):
            out.append(f"{os.path.join(folder, name)}: {HASH} {got[HASH][:16]}..., the "
                       f"manifest says {str(present[name].get(HASH))[:16]}... (the bytes "
                       f"changed after it was written)")
    return out


def step_dir(series: str, step: int) -> str:
    return os.path.join(series, f"step_{step:06d}")


def steps(series: str) -> list[int]:
    """The step numbers of the checkpoints in a series folder, newest first."""
    if not os.path.isdir(series):
        return []
    return sorted((int(m.group(1)) for m in map(STEP_DIR.match, os.listdir(series)) if m),
                  reverse=True)
