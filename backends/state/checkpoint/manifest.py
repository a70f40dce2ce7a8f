"""A checkpoint's `manifest.json`, and what a plan can load of it.

Rank 0 writes it beside DCP's `.metadata`, inside the folder that is renamed
into place, so a complete checkpoint always has both. It says what the
checkpoint came from, in words a person and `plan_diff` can read:

    format, step, plan_hash       (the hash of what every rank ran: agreement.py)
    plan: mesh, zero, schedule, virtual, microbatches, split points, precision
    optimizer: name, momentum     (the optimizer state kept, by name)
    sync: every_step, or diloco's islands, inner_steps, fragments, outer optimizer
                                  (islands.py: a diloco checkpoint resumes only under the same)
    parameters: name -> global shape
    data: step, tokens            (the data position: step t's batch is a function of t)
    lr                            (the LR after the last step: the schedule replays from step)
    files: name -> size, sha256   every other file of the folder (integrity.py); the
                                  manifest is written after them, atomically
    timing: write_s, hash_s       how long the write and the hashing took (BENCHMARKS.md)

`incompatibilities(manifest, plan, shapes, reset_optimizer)` lists, one line
each, what will not load under a plan (with the choices); `pipeplan run`
refuses before any process starts when the list is not empty, and every rank
asks again before loading (a run under torchrun has no pre-launch step).
"""
from __future__ import annotations

import json
import os

from ....dsl.ast import Plan
from ....errors import PipeplanError
from .islands import describe, sync_summary

MANIFEST = "manifest.json"
FORMAT = 2  # 2: with "files" (checksums); 1 (none) still reads, unverified
FORMATS = (1, 2)
SHOWN = 6  # names listed per refused item before "and N more"


def plan_summary(plan: Plan, split_points=()) -> dict:
    m = plan.mesh
    return {"mesh": {"pp": m.pp, "dp": m.dp, "cp": m.cp, "tp": m.tp, "ep": m.ep},
            "zero": plan.zero, "schedule": plan.pipeline.schedule,
            "virtual": plan.pipeline.virtual, "microbatches": plan.microbatches,
            "split": list(split_points),
            "precision": plan.train.precision}


def optimizer_summary(plan: Plan) -> dict:
    spec = plan.train.optimizer
    return {"name": spec.name, "momentum": bool(spec.name == "sgd" and spec.momentum)}


def build_manifest(plan: Plan, step: int, plan_hash: str, shapes: dict, split_points,
                   lr: float, files: dict, timing: dict) -> dict:
    return {"format": FORMAT, "step": step, "plan_hash": plan_hash, "files": files,
            "timing": timing,
            "plan": plan_summary(plan, split_points), "optimizer": optimizer_summary(plan),
            "sync": sync_summary(plan),
            "parameters": {n: list(s) for n, s in sorted(shapes.items())},
            "data": {"step": step, "tokens": step * plan.train.global_batch * plan.data.seq_len},
            "lr": lr}


def write_manifest(folder: str, manifest: dict) -> None:
    """Atomically: a temporary file, flushed to disk, renamed over manifest.json."""
    tmp = os.path.join(folder, MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(folder, MANIFEST))


def read_manifest(folder: str) -> dict:
    """The manifest of the checkpoint in `folder`; a PipeplanError naming the file if absent
    or unreadable."""
    path = os.path.join(folder, MANIFEST)
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise PipeplanError(f"checkpoint {folder}: no {MANIFEST} (written by another pipeplan "
                            f"version, or not a pipeplan checkpoint); point train.checkpoint.dir "
                            f"at another folder, or move this one away to start fresh") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PipeplanError(f"checkpoint manifest {path}: cannot be read ({e}); point "
                            f"train.checkpoint.dir at another folder to start fresh") from None
    if not isinstance(manifest, dict) or manifest.get("format") not in FORMATS or \
            not isinstance(manifest.get("parameters"), dict):
        raise PipeplanError(f"checkpoint manifest {path}: not a pipeplan manifest (format "
                            f"{FORMAT}); point train.checkpoint.dir at another folder")
    return manifest


def _names(names: list[str]) -> str:
    shown = ", ".join(names[:SHOWN])
    return shown + (f" and {len(names) - SHOWN} more" if len(names) > SHOWN else "")


def incompatibilities(manifest: dict, plan: Plan, shapes: dict[str, tuple[int, ...]],
                      reset_optimizer: bool = False) -> list[str]:
    """One line per item of the checkpoint that will not load under `plan` (empty: it loads).

    `shapes`: the plan's model, name -> global shape (state.parameter_shapes)."""
    out = []
    fresh = "start fresh (another train.checkpoint.dir, or move this folder away)"
    saved = manifest["optimizer"]
    now = optimizer_summary(plan)
    if saved != now and not reset_optimizer:
        def say(o):
            return o["name"] + (" with momentum" if o.get("momentum") else "")
        out.append(f"the optimizer state is {say(saved)}'s, the plan trains with {say(now)}: "
                   f"it will not load; resume with --reset-optimizer (weights only, a fresh "
                   f"optimizer), change train.optimizer back, or {fresh}")
    saved_sync, now_sync = manifest.get("sync", {"mode": "every_step"}), sync_summary(plan)
    if saved_sync != now_sync:
        out.append(f"the checkpoint was written under {describe(saved_sync)}, the plan runs "
                   f"{describe(now_sync)}: DiLoCo's per-island parameters, inner optimizer "
                   f"states and outer state resume only under the same islands and outer "
                   f"loop; set sync and mesh.dp back, or {fresh}")
    have = {n: tuple(s) for n, s in manifest["parameters"].items()}
    missing = sorted(set(shapes) - set(have))
    if missing:
        out.append(f"the model has {len(missing)} parameter(s) the checkpoint lacks: "
                   f"{_names(missing)}; {fresh}")
    extra = sorted(set(have) - set(shapes))
    if extra:
        out.append(f"the checkpoint has {len(extra)} parameter(s) the model lacks: "
                   f"{_names(extra)}; use the model the checkpoint was trained with, or {fresh}")
    for n in sorted(set(have) & set(shapes)):
        if have[n] != tuple(shapes[n]):
            out.append(f"parameter {n} has shape {list(have[n])} in the checkpoint but "
                       f"{list(shapes[n])} in the model (model.args differ?): it will not "
                       f"load; use the model the checkpoint was trained with, or {fresh}")
    return out


def check_loadable(folder: str, plan: Plan, shapes: dict, reset_optimizer: bool = False,
                   before_launch: bool = True) -> dict:
    """The manifest, or a PipeplanError listing everything that will not load."""
    manifest = read_manifest(folder)
    problems = incompatibilities(manifest, plan, shapes, reset_optimizer)
    if problems:
        when = " (nothing was started)" if before_launch else " (stopped before step 1)"
        raise PipeplanError(f"checkpoint {folder} does not load under this plan{when}:\n"
                            + "\n".join(f"  - {p}" for p in problems))
    return manifest


