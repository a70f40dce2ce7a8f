"""Is a checkpoint intact, and which one to use: decided before anything loads it.

`verify(folder)` checks, in order, without unpickling anything until the bytes
are known to be the ones written:

1. manifest.json is there and readable (manifest.read_manifest);
2. every file it lists is there, of its size and its sha256 (integrity.damage);
3. `.metadata` unpickles under the allow-list (trusted.read_metadata) and
   names only data files the manifest lists.

`choose(series)` is what automatic resume uses: the newest checkpoint of the
series that verifies, with one warning line per newer one skipped (and why).
`verify_offering(folder, how)` is for a checkpoint named by hand (`export`,
`plan-diff`, `--resume-from`): refused when damaged, naming the file, with the
previous intact checkpoint of its series offered (`how` says how to use it).
"""
from __future__ import annotations

import os
import sys
from typing import Optional

from ....errors import PipeplanError
from .integrity import DamagedCheckpoint, damage, step_dir, steps
from .manifest import read_manifest
from .trusted import read_metadata

LEGACY = "written before checksums (manifest format 1): its bytes cannot be verified"


def problems(folder: str) -> tuple[list[str], Optional[dict]]:
    """(what is wrong with the checkpoint in `folder`, one line each; its manifest)."""
    try:
        manifest = read_manifest(folder)
    except PipeplanError as e:
        return [str(e)], None
    files = manifest.get("files")
    if files is None:
        return [], manifest
    if not isinstance(files, dict) or not all(isinstance(v, dict) for v in files.values()):
        return [f"{folder}/manifest.json: its file list is not a name -> size, hash table"], None
    wrong = damage(folder, files)
    if wrong:
        return wrong, manifest
    try:
        metadata = read_metadata(folder)
    except PipeplanError as e:
        return [str(e)], manifest
    unlisted = sorted({i.relative_path for i in metadata.storage_data.values()} - set(files))
    if unlisted:
        return [f"{folder}/.metadata names data files the manifest does not list: "
                + ", ".join(unlisted[:5])], manifest
    return [], manifest


def verify(folder: str) -> dict:
    """The manifest of the intact checkpoint in `folder`, or DamagedCheckpoint."""
    wrong, manifest = problems(folder)
    if wrong:
        raise DamagedCheckpoint(f"checkpoint {folder} is damaged:\n"
                                + "\n".join(f"  - {w}" for w in wrong))
    return manifest


def previous(folder: str) -> Optional[str]:
    """The newest intact checkpoint of `folder`'s series older than it, or None."""
    series, name = os.path.split(os.path.normpath(folder))
    mine = int(name[5:]) if name.startswith("step_") and name[5:].isdigit() else None
    for step in steps(series):
        if mine is not None and step >= mine:
            continue
        if not problems(step_dir(series, step))[0]:
            return step_dir(series, step)
    return None


def verify_offering(folder: str, how: str) -> dict:
    """verify(folder); when damaged, the error offers the previous intact checkpoint
    (`how` formats its path into the command to use, e.g. "--resume-from {}")."""
    try:
        return verify(folder)
    except DamagedCheckpoint as e:
        prev = previous(folder)
        offer = (f"the previous complete checkpoint is intact: {how.format(prev)}" if prev else
                 "no older intact checkpoint in its folder; start fresh (another "
                 "train.checkpoint.dir, or move this one away)")
        raise DamagedCheckpoint(f"{e}\nnothing was loaded; {offer}") from None


def choose(series: str) -> tuple[Optional[str], list[str]]:
    """(the newest intact checkpoint in the series folder or None when it has none,
    warning lines for each newer one skipped). Every checkpoint damaged: DamagedCheckpoint."""
    skipped = []
    for step in steps(series):
        folder = step_dir(series, step)
        wrong, manifest = problems(folder)
        if not wrong:
            notes = [f"skipped the damaged checkpoint {f} ({w[0]}"
                     + (f" and {len(w) - 1} more" if len(w) > 1 else "") + ")"
                     for f, w in skipped]
            if skipped:
                notes.append(f"resuming from {folder}, the newest intact checkpoint")
            if manifest.get("files") is None:
                notes.append(f"checkpoint {folder} was {LEGACY}")
            return folder, notes
        skipped.append((folder, wrong))
    if skipped:
        raise DamagedCheckpoint(
            f"no checkpoint in {series} is intact, so nothing was started:\n"
            + "\n".join(f"  - {f}: {'; '.join(w[:2])}" for f, w in skipped)
            + "\nstart fresh: point train.checkpoint.dir at another folder, or move it away")
    return None, []


def resume_choice(series: str, resume_from: Optional[str] = None,
                  verified: bool = False) -> Optional[str]:
    """The checkpoint a run resumes from (None: start fresh), warnings on stderr.

    `resume_from`: the one named (--resume-from), refused when damaged; else the newest
    intact one of the series (choose). `verified`: the launcher already decided and
    checked (its choice is `resume_from`, None for a fresh start)."""
    if verified:
        return resume_from
    if resume_from:
        verify_offering(resume_from, "--resume-from {}")
        return resume_from
    found, notes = choose(series)
    for note in notes:
        print(f"pipeplan: warning: {note}", file=sys.stderr, flush=True)
    return found
