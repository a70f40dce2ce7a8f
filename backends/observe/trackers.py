"""Experiment trackers: `train { log = [jsonl, tensorboard, wandb] }`, written by rank 0.

One table (`TRACKERS`) says what each name needs; every tracker gets the same
rows under the same names as metrics.jsonl (`step`, `loss`, `lr`, `grad_norm`,
`tokens_per_s`, `step_time_s`, `tokens`, and `eval_loss` / `eval_perplexity`
on the steps that evaluate), plus, once at the end, the run's measured bubble
and each rank's memory (`bubble`, `memory/rank<r>/<what>_bytes`, the names of
bubble.json and memory.json).

* jsonl: `train.log_dir/metrics.jsonl` (backends/observe/progress.py writes it).
* tensorboard: event files in `train.log_dir/tensorboard` (torch's SummaryWriter;
  the `tensorboard` package, extra `pipeplan[tensorboard]`).
* wandb: a Weights & Biases run in `train.log_dir` (extra `pipeplan[wandb]`);
  `WANDB_MODE=offline` keeps it on disk, `WANDB_PROJECT` names the project
  (default "pipeplan").
"""
from __future__ import annotations

import hashlib
import os
from typing import Mapping, Optional

# Which trackers exist and what each needs: dsl/schema_train.py TRACKERS (checked there).


class Trackers:
    """The plan's trackers other than jsonl, on rank 0: opened once the run knows where it
    starts (`open`), given every metrics row (`log`), the end-of-run `summary`, `close`."""

    def __init__(self, names, log_dir: Optional[str], run_name: str):
        self.names, self.log_dir, self.run_name = tuple(names), log_dir, run_name
        self.writers: list = []

    def open(self, resumed_after: int = 0) -> None:
        """`resumed_after`: the step a resumed run continues after (TensorBoard drops what
        the interrupted run logged past it, as metrics.jsonl does)."""
        if "tensorboard" in self.names:
            from torch.utils.tensorboard import SummaryWriter

            folder = os.path.join(self.log_dir, "tensorboard")
            self.writers.append(_TensorBoard(SummaryWriter(
                folder, purge_step=resumed_after + 1 if resumed_after else None)))
        if "wandb" in self.names:
            import wandb

            run = wandb.init(project=os.environ.get("WANDB_PROJECT", "pipeplan"),
                             name=self.run_name, dir=self.log_dir, resume="allow",
                             id=_run_id(self.log_dir))
            self.writers.append(_WandB(run))

    def log(self, step: int, row: Mapping[str, object]) -> None:
        scalars = {k: float(v) for k, v in row.items()
                   if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        for w in self.writers:
            w.log(step, scalars)

    def summary(self, step: int, bubble: Optional[float], memory) -> None:
        """Once at the end: the measured bubble (bubble.json's `measured`) and each rank's
        memory (memory.json's fields, in bytes)."""
        row = {} if bubble is None else {"bubble": bubble}
        for m in memory or ():
            for what in ("param_bytes", "startup_peak", "peak"):
                row[f"memory/rank{m.rank}/{what}"] = getattr(m, what)
        if row:
            self.log(step, row)

    def close(self) -> None:
        for w in self.writers:
            w.close()
        self.writers = []


def _run_id(log_dir: str) -> str:
    """One W&B run id per log_dir, so a resumed run continues its run."""
    return hashlib.sha256(os.path.abspath(log_dir).encode()).hexdigest()[:16]


class _TensorBoard:
    def __init__(self, writer):
        self.writer = writer

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        for k, v in scalars.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _WandB:
    def __init__(self, run):
        self.run = run

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        self.run.log(dict(scalars), step=step)

    def close(self) -> None:
        self.run.finish()
