"""What a run shows: rank 0's progress (a live bar on a terminal, else one line per step)
and JSONL metrics; the measured bubble is timings.py, the measured trace trace.py.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from typing import Optional, TextIO

from ..runtime.trainer import StepReport


def describe_run(compiled, world_size: int) -> str:
    """What is about to run, before step 1: the schedule and each rank's stages."""
    sch = compiled.schedule
    m = compiled.plan.mesh
    lines = [f"{sch.name}: {sch.stages} stages on {sch.ranks} pipeline ranks, "
             f"{sch.microbatches} microbatches per step; pp={m.pp} dp={m.dp} cp={m.cp} tp={m.tp} ep={m.ep} "
             f"({world_size} processes); captured with {compiled.capture}"]
    for r in range(sch.ranks):
        parts = [f"stage {st.index} [{', '.join(st.module_names) or '-'}]"
                 for st in compiled.stages if sch.stage_to_rank[st.index] == r]
        lines.append(f"  pipeline rank {r}: " + "; ".join(parts))
    return "\n".join(lines)


class Progress:
    """Rank 0's progress on stdout and, optionally, one JSON object per step.

    On a terminal: a live tqdm bar (step, loss, tokens/s, elapsed and ETA), each line
    above it kept as printed; otherwise (a pipe, a file, the launcher's
    prefixed output) one plain line per step, the format scripts and tests parse."""

    def __init__(self, total_steps: int, metrics_path: Optional[str] = None,
                 stream: TextIO = sys.stdout, append: bool = False, resumed_after: int = 0,
                 live: Optional[bool] = None, trackers=None):
        """`append`: continue the metrics file of a resumed run; the rows it holds for
        steps after `resumed_after` (written after the checkpoint the run resumes from,
        and about to be trained again) are dropped so no step appears twice. `live`: the
        bar (default: when `stream` is a terminal). `trackers`: observe/trackers.py's,
        given every row the metrics file gets."""
        self.total = total_steps
        self.stream = stream
        self.trackers = trackers
        self.last_eval = ""  # the bar keeps showing the latest held-out loss
        if metrics_path and append:
            _keep_rows_through(metrics_path, resumed_after)
        self.metrics = open(metrics_path, "a" if append else "w") if metrics_path else None
        if live is None:
            live = bool(getattr(stream, "isatty", lambda: False)())
        self.bar = None
        if live:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=resumed_after, file=stream, unit="step",
                            dynamic_ncols=True, desc="train")

    def step(self, r: StepReport, eval_loss: Optional[float] = None) -> None:
        """Step `r`'s line or bar update and metrics row; `eval_loss`: the held-out loss
        measured after it (train.eval), with its perplexity exp(loss)."""
        tps = r.tokens / r.step_time if r.step_time > 0 else 0.0
        width = len(str(self.total))
        held = {} if eval_loss is None else {"eval_loss": eval_loss,
                                             "eval_perplexity": _perplexity(eval_loss)}
        if held:
            self.last_eval = f"  eval {eval_loss:.4f} (ppl {held['eval_perplexity']:.4g})"
        if self.bar is not None:
            self.bar.set_postfix_str(f"loss {r.loss:.4f}{self.last_eval}  {tps:,.0f} tok/s  "
                                     f"{r.step_time * 1e3:.0f} ms/step", refresh=False)
            self.bar.update(1)
        else:  # the norm only when computed (the plan clips)
            norm = "" if r.grad_norm is None else f"grad_norm {r.grad_norm:.3f}  "
            shown = f"eval_loss {eval_loss:.4f}  ppl {held['eval_perplexity']:.4g}  " \
                if held else ""
            print(f"step {r.step + 1:>{width}}/{self.total}  loss {r.loss:.4f}  lr {r.lr:.2e}  "
                  f"{norm}{shown}{tps:,.0f} tok/s  {r.step_time * 1e3:.0f} ms",
                  file=self.stream, flush=True)
        for e in r.sync_events:  # DiLoCo: island 0's syncs (rank 0's fragments)
            line = f"  island 0: {e.describe()}"
            if self.bar is not None:
                self.bar.write(line, file=self.stream)
            else:
                print(line, file=self.stream, flush=True)
        row = {"step": r.step + 1, "loss": r.loss, "lr": r.lr, "grad_norm": r.grad_norm,
               "tokens_per_s": tps, "step_time_s": r.step_time, "tokens": r.tokens, **held}
        if self.metrics:
            self.metrics.write(json.dumps({
                **row, **({"sync": [dataclasses.asdict(e) for e in r.sync_events]}
                          if r.sync_events else {})}) + "\n")
            self.metrics.flush()
        if self.trackers is not None:
            self.trackers.log(r.step + 1, row)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.metrics:
            self.metrics.close()


def _perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 700 else math.inf  # exp overflows a float past ~709


def _keep_rows_through(path: str, step: int) -> None:
    """Rewrite a metrics file keeping only its rows for steps <= `step` (atomically)."""
    try:
        with open(path) as f:
            lines = f.readlines()
    except OSError:
        return
    kept = []
    for line in lines:
        try:
            row_step = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
            continue  # a row cut short by a crash
        if row_step <= step:
            kept.append(line if line.endswith("\n") else line + "\n")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(kept)
    os.replace(tmp, path)


