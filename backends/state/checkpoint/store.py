"""Save every N steps, atomically; resume from the newest complete checkpoint.

Atomic: every rank writes `DIR/.step_000010.tmp/`; after all have finished
(a barrier) rank 0 adds the manifest, renames the folder to
`DIR/step_000010/` and deletes the oldest beyond `keep`. A crash mid-write
leaves only a .tmp folder, which resume ignores, so a checkpoint already
written stays intact.

Decoupled DiLoCo (backends/parallel/diloco/decoupled.py): the islands are at different steps and may be
lost, so each island checkpoints alone, at its own steps, into its own series
`DIR/island<d>/step_N/`: the collectives (barriers, DCP's plan exchange) run over the
island's process group only, and the island's first rank writes the manifest.
"""
from __future__ import annotations

import os
import re
import shutil
from typing import Optional

import torch
import torch.distributed as dist

from ....dsl.ast import Plan
from .manifest import build_manifest, check_loadable, write_manifest
from .pieces import PiecesLoadPlanner, PiecesSavePlanner
from .islands import after_load as islands_after_load
from .state import after_load, rank_pieces

_STEP_DIR = re.compile(r"^step_(\d+)$")


def step_dir(folder: str, step: int) -> str:
    return os.path.join(folder, f"step_{step:06d}")


def checkpoint_folder(plan: Plan, island: int) -> str:
    """Where this rank's checkpoints go: train.checkpoint.dir, or under decoupled DiLoCo
    its island's own series `dir/island<d>`."""
    spec = plan.train.checkpoint
    return os.path.join(spec.dir, f"island{island}") if plan.sync.decoupled else spec.dir


def latest_step(folder: str) -> Optional[int]:
    """The newest complete checkpoint's step in `folder` (None: nothing to resume)."""
    if not os.path.isdir(folder):
        return None
    steps = [int(m.group(1)) for m in map(_STEP_DIR.match, os.listdir(folder)) if m]
    return max(steps, default=None)


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
        dcp.save(state, checkpoint_id=tmp, planner=PiecesSavePlanner(), process_group=self.group)
        dist.barrier(group=self.group)
        if dist.get_rank() == self.leader:
            optimizer = self.trainer.optimizer
            lr = optimizer.param_groups[0]["lr"] if optimizer else self.plan.train.optimizer.lr
            write_manifest(tmp, build_manifest(self.plan, step, self.plan_hash,
                                               self.trainer.global_shapes, self.split_points, lr))
            final = step_dir(folder, step)
            shutil.rmtree(final, ignore_errors=True)
            os.rename(tmp, final)
            steps = sorted(int(m.group(1)) for m in map(_STEP_DIR.match, os.listdir(folder)) if m)
            for old in steps[:-self.spec.keep]:
                shutil.rmtree(step_dir(folder, old), ignore_errors=True)
        dist.barrier(group=self.group)

    def load(self, step: int, reset_optimizer: bool = False) -> int:
        """Restore what was saved at `step` (resharded to this plan); returns the step.

        `reset_optimizer`: the weights only; the optimizer starts fresh."""
        import torch.distributed.checkpoint as dcp

        folder = step_dir(self.folder, step)
        manifest = check_loadable(folder, self.plan, self.trainer.global_shapes,
                                  reset_optimizer, before_launch=False)
        state = dict(rank_pieces(self.trainer, "first", with_optimizer=not reset_optimizer))
        extras = self._extras(step)
        same_plan = bool(self.plan_hash) and manifest.get("plan_hash") == self.plan_hash
        state.update(extras if same_plan else {"step": extras["step"]})
        dcp.load(state, checkpoint_id=folder, planner=PiecesLoadPlanner(),
                 process_group=self.group)
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
