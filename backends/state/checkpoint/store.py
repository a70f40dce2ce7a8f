"""Save every N steps, atomically; resume from the newest complete checkpoint.

Atomic: every rank writes `DIR/.step_000010.tmp/`; after all have finished
(a barrier) every rank hashes a share of the files (integrity.py), rank 0
adds the manifest with every file's size and sha256 (written last, itself
atomically), renames the folder to `DIR/step_000010/` and deletes the oldest
beyond `keep`. A crash mid-write leaves only a .tmp folder, which resume
ignores, so a checkpoint already written stays intact; one damaged later is
found by its checksums before anything loads it (verify.py).

Loading reads DCP's metadata with an allow-list and never unpickles objects
(trusted.py).

Decoupled DiLoCo (backends/parallel/diloco/decoupled.py): the islands are at different steps and may be
lost, so each island checkpoints alone, at its own steps, into its own series
`DIR/island<d>/step_N/`: the collectives (barriers, DCP's plan exchange) run over the
island's process group only, and the island's first rank writes the manifest.
"""
from __future__ import annotations

import os
import shutil
import time
from typing import Optional

import torch
import torch.distributed as dist

from ....dsl.ast import Plan
from .integrity import checkpoint_files, digest_share, step_dir, steps
from .manifest import MANIFEST, build_manifest, check_loadable, write_manifest
from .pieces import PiecesLoadPlanner, PiecesSavePlanner
from .islands import after_load as islands_after_load
from .state import after_load, rank_pieces
from .trusted import load as trusted_load
from .verify import verify

def checkpoint_folder(plan: Plan, island: int) -> str:
    """Where this rank's checkpoints go: train.checkpoint.dir, or under decoupled DiLoCo
    its island's own series `dir/island<d>`."""
    spec = plan.train.checkpoint
    return os.path.join(spec.dir, f"island{island}") if plan.sync.decoupled else spec.dir


def latest_step(folder: str) -> Optional[int]:
    """The newest checkpoint's step in `folder` (None: none); verify.choose picks the
    newest intact one."""
    return next(iter(steps(folder)), None)


class Checkpointer:
    """Saves and restores one rank's share of a run (collective: every rank calls each method;
    under decoupled DiLoCo every rank of its island).

    `trainer`: the rank's PipelineTrainer; `plan_hash`: the hash of what every rank runs
    (agreement.plan_hash); `split_points`: the compiled split, for the manifest.
    """

    def __init__(self, plan: Plan, trainer, plan_hash: str = "", split_points=()):
        self.plan, self.trainer = plan, trainer
        self.spec = plan.train.checkpoint
        self.plan_hash, self.split_points = plan_hash, tuple(split_points)
        self.folder = checkpoint_folder(plan, trainer.topo.coords.dp)
        # decoupled DiLoCo: the island's group alone; else the world
        self.group = trainer.island_group if plan.sync.decoupled else None
        self.leader = dist.get_process_group_ranks(self.group)[0] if self.group else 0

    def _extras(self, step: int) -> dict:
        """The step and this rank's RNG states (restored only under the same plan)."""
        state = {"step": torch.tensor(step, dtype=torch.int64),
                 f"rng/{dist.get_rank()}/cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            state[f"rng/{dist.get_rank()}/cuda"] = torch.cuda.get_rng_state()
        return state

    def save(self, step: int) -> None:
        import torch.distributed.checkpoint as dcp

        folder = self.folder
        tmp = os.path.join(folder, f".step_{step:06d}.tmp")
        if dist.get_rank() == self.leader:
            os.makedirs(folder, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
        dist.barrier(group=self.group)
        state = dict(rank_pieces(self.trainer, "written"))
        state.update(self._extras(step))
        started = time.perf_counter()
        dcp.save(state, checkpoint_id=tmp, planner=PiecesSavePlanner(), process_group=self.group)
        dist.barrier(group=self.group)
        written = time.perf_counter()
        files = self._digests(tmp)
        if dist.get_rank() == self.leader:
            optimizer = self.trainer.optimizer
            lr = optimizer.param_groups[0]["lr"] if optimizer else self.plan.train.optimizer.lr
            timing = {"write_s": round(written - started, 6),
                      "hash_s": round(time.perf_counter() - written, 6)}
            write_manifest(tmp, build_manifest(self.plan, step, self.plan_hash,
                                               self.trainer.global_shapes, self.split_points, lr,
                                               files, timing))
            final = step_dir(folder, step)
            shutil.rmtree(final, ignore_errors=True)
            os.rename(tmp, final)
            for old in steps(folder)[self.spec.keep:]:  # newest first
                shutil.rmtree(step_dir(folder, old), ignore_errors=True)
        dist.barrier(group=self.group)

    def _digests(self, tmp: str) -> dict:
        """Every file's size and sha256 (on the leader; each rank of the group hashes a
        share of the files, the leader gathers them)."""
        group_rank = dist.get_rank(self.group) if self.group else dist.get_rank()
        size = dist.get_world_size(self.group)
        mine = digest_share(tmp, checkpoint_files(tmp, MANIFEST), group_rank, size)
        shares = [None] * size if dist.get_rank() == self.leader else None
        dist.gather_object(mine, shares, dst=self.leader, group=self.group)
        return {k: v for share in shares or () for k, v in share.items()}

    def load(self, where: int | str, reset_optimizer: bool = False,
             verified: bool = False) -> int:
        """Restore a checkpoint, resharded to this plan; returns its step. `where`: a step
        of this run's series, or a step_N folder.

        `reset_optimizer`: the weights only; the optimizer starts fresh. `verified`: its
        files were checked against the manifest already (verify.py); else checked here."""
        folder = step_dir(self.folder, where) if isinstance(where, int) else where
        if not verified:
            verify(folder)
        manifest = check_loadable(folder, self.plan, self.trainer.global_shapes,
                                  reset_optimizer, before_launch=False)
        state = dict(rank_pieces(self.trainer, "first", with_optimizer=not reset_optimizer))
        extras = self._extras(int(manifest["step"]))
        same_plan = bool(self.plan_hash) and manifest.get("plan_hash") == self.plan_hash
        state.update(extras if same_plan else {"step": extras["step"]})
        trusted_load(state, folder, PiecesLoadPlanner(), process_group=self.group)
        after_load(self.trainer)
        islands_after_load(self.trainer, state)
        if same_plan:
            torch.set_rng_state(state[f"rng/{dist.get_rank()}/cpu"])
            if torch.cuda.is_available():
                torch.cuda.set_rng_state(state[f"rng/{dist.get_rank()}/cuda"])
        return int(state["step"])


def newest(folder: str) -> Optional[str]:
    """The newest complete checkpoint folder in `folder` (a decoupled DiLoCo run's: island
    0's, whose global parameters are the coordinators' own), or None."""
    step = latest_step(folder)
    if step is None and latest_step(os.path.join(folder, "island0")) is not None:
        return newest(os.path.join(folder, "island0"))
    return None if step is None else step_dir(folder, step)
