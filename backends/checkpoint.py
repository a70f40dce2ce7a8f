"""Checkpoints with torch.distributed.checkpoint (DCP): save every N steps, resume from the newest.

What is saved, keyed by the unmodified model's parameter names (so a
checkpoint does not depend on how the model was split or on which rank held
what; DCP stores a key held by several ranks — DP replicas, tied copies —
once):

    params/<name>           the parameter
    optim/<name>/<state>    its optimizer state (AdamW: step, exp_avg, exp_avg_sq;
                            SGD: momentum_buffer)
    step                    optimizer steps done

The data position needs nothing: step t's batch is a pure function of t.

Atomic: every rank writes `DIR/.step_000010.tmp/`; after all have finished,
rank 0 renames it to `DIR/step_000010/` and deletes the oldest beyond `keep`.
A crash mid-write leaves only a .tmp folder, which resume ignores, so a
checkpoint already written stays intact.

Not yet: ZeRO shards, TP and expert shards (their local tensors are not the
reference's shapes); plans asking for both are refused at the plan line.
"""
from __future__ import annotations

import os
import re
import shutil
from typing import Optional

import torch
import torch.distributed as dist

from ..dsl.ast import CheckpointSpec
from ..compiler.checks import check_checkpointable  # noqa: F401 (compile-time, re-exported)

_STEP_DIR = re.compile(r"^step_(\d+)$")


def step_dir(folder: str, step: int) -> str:
    return os.path.join(folder, f"step_{step:06d}")


def latest_step(folder: str) -> Optional[int]:
    """The newest complete checkpoint's step in `folder` (None: nothing to resume)."""
    if not os.path.isdir(folder):
        return None
    steps = [int(m.group(1)) for m in map(_STEP_DIR.match, os.listdir(folder)) if m]
    return max(steps, default=None)


class Checkpointer:
    """Saves and restores one rank's share: its named parameters and their optimizer state."""

    def __init__(self, spec: CheckpointSpec, params: dict[str, torch.nn.Parameter],
                 optimizer: Optional[torch.optim.Optimizer]):
        self.spec = spec
        self.params = params  # reference name -> this rank's parameter (tied copies under each name)
        self.optimizer = optimizer

    def _state(self, step: int, fill_missing: bool) -> dict:
        state: dict = {"step": torch.tensor(step, dtype=torch.int64)}
        for name, p in self.params.items():
            state[f"params/{name}"] = p.data
            if self.optimizer is None:
                continue
            opt_state = self.optimizer.state[p]
            if fill_missing and not opt_state:
                opt_state.update(_empty_optimizer_state(self.optimizer, p))
            for key, value in opt_state.items():
                if torch.is_tensor(value):
                    state[f"optim/{name}/{key}"] = value
        return state

    def save(self, step: int) -> None:
        """Collective: every rank writes its share; rank 0 publishes the folder atomically."""
        folder = self.spec.dir
        tmp = os.path.join(folder, f".step_{step:06d}.tmp")
        if dist.get_rank() == 0:
            os.makedirs(folder, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
        dist.barrier()
        import torch.distributed.checkpoint as dcp

        dcp.save(self._state(step, fill_missing=False), checkpoint_id=tmp)
        dist.barrier()
        if dist.get_rank() == 0:
            final = step_dir(folder, step)
            shutil.rmtree(final, ignore_errors=True)
            os.rename(tmp, final)
            steps = sorted(int(m.group(1)) for m in map(_STEP_DIR.match, os.listdir(folder)) if m)
            for old in steps[:-self.spec.keep]:
                shutil.rmtree(step_dir(folder, old), ignore_errors=True)
        dist.barrier()

    def load(self, step: int) -> int:
        """Collective: restore parameters and optimizer state saved at `step`; returns it."""
        import torch.distributed.checkpoint as dcp

        state = self._state(step, fill_missing=True)
        dcp.load(state, checkpoint_id=step_dir(self.spec.dir, step))
        return int(state["step"])


def _empty_optimizer_state(optimizer: torch.optim.Optimizer, p: torch.nn.Parameter) -> dict:
    """The state tensors the optimizer will hold for p, zero, for DCP to load into."""
    if isinstance(optimizer, torch.optim.AdamW):
        return {"step": torch.zeros((), dtype=torch.float32),
                "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
    if isinstance(optimizer, torch.optim.SGD) and optimizer.defaults.get("momentum", 0):
        return {"momentum_buffer": torch.zeros_like(p)}
    return {}
