"""Trackers (`train { log = [...] }`), read back with their own formats' readers.

* TensorBoard: TensorBoard's EventAccumulator reads every row under the JSONL's
  names; a resumed run (opened after step 3) replaces what the interrupted one
  logged past step 3, as metrics.jsonl does.
* W&B, offline (WANDB_MODE=offline, nothing leaves the machine): the run file's
  history records, decoded with W&B's own protobuf schema, hold the same rows.
(That `log` without jsonl writes no metrics.jsonl, and a real run's TensorBoard
file: tests/backends/test_text_run.py.)
"""
from __future__ import annotations

import glob
import json
import struct
import time

import pytest

from pipeplan.backends.observe.trackers import Trackers

ROWS = [{"step": s, "loss": 5.0 - s / 4, "lr": 0.01 * s, "grad_norm": None if s % 2 else 0.5 * s,
         "tokens_per_s": 1000.0 + s, "step_time_s": 0.01, "tokens": 64,
         **({"eval_loss": 4.0 - s / 8, "eval_perplexity": 2.0 ** s} if s % 2 == 0 else {})}
        for s in range(1, 7)]


def logged(row: dict) -> dict:
    return {k: float(v) for k, v in row.items() if k != "step" and v is not None}


def tensorboard_scalars(folder) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def test_tensorboard_holds_the_rows_and_a_resume_replaces_the_steps_after_it(tmp_path):
    first = Trackers(["tensorboard"], str(tmp_path), "run")
    first.open(0)
    for row in ROWS:
        first.log(row["step"], row)
    first.close()
    again = Trackers(["tensorboard"], str(tmp_path), "run")
    again.open(resumed_after=3)  # steps 4.. are trained again, with other values here
    redone = [dict(r, loss=r["loss"] + 100) for r in ROWS[3:]]
    for row in redone:
        again.log(row["step"], row)
    again.close()
    tb = tensorboard_scalars(tmp_path / "tensorboard")
    want: dict[str, dict[int, float]] = {}
    for row in ROWS[:3] + redone:
        for k, v in logged(row).items():
            want.setdefault(k, {})[row["step"]] = v
    assert tb.keys() == want.keys()
    for k in want:
        assert tb[k].keys() == want[k].keys(), k
        for s, v in want[k].items():
            assert tb[k][s] == pytest.approx(v, rel=1e-6), (k, s)


def wandb_records(path: str):
    """The records of a W&B run file: W&B's block log (a 7-byte file header, 32 KiB blocks,
    7-byte record headers: crc, length, type FULL=1 FIRST=2 MIDDLE=3 LAST=4), each record a
    wandb_internal_pb2.Record."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7]) if left >= 7 else (0, 0, 0)
        if left < 7 or (kind == 0 and length == 0):
            pos += left
            continue
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


@pytest.mark.slow  # W&B starts its service process: ~15 s
def test_wandb_offline_run_holds_the_rows(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    trackers = Trackers(["wandb"], str(tmp_path), "run")
    trackers.open(0)
    for row in ROWS:
        trackers.log(row["step"], row)
    trackers.close()
    [path] = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    want = {row["step"]: logged(row) for row in ROWS}
    deadline = time.monotonic() + 20  # read again for a while: W&B's service process writes
    while True:  # the file, and one run on a loaded machine read it with no history yet
        history = {}
        for r in wandb_records(path):
            if r.WhichOneof("record_type") == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                         for i in r.history.item}
                step = items.pop("_step", r.history.step.num)
                history[step] = {k: v for k, v in items.items() if not k.startswith("_")}
        if history == want or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert history == want


def test_the_report_draws_the_held_out_loss(tmp_path):
    from pipeplan.backends.observe.run_dir import write_report

    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    page = open(write_report(str(tmp_path))).read()
    chart = page[page.index('data-name="held-out loss"'):]
    points = chart[chart.index('class="curve"'):].split('points="')[1].split('"')[0].split()
    assert len(points) == 3  # the steps that evaluated: 2, 4, 6
    ys = [float(p.split(",")[1]) for p in points]
    assert ys[0] < ys[1] < ys[2]  # the loss falls: the curve descends (SVG y grows downward)
    assert "held-out loss 3.2500 (perplexity 64) after step 6" in page


def test_the_progress_bar_and_line_show_the_held_out_loss(tmp_path):
    import dataclasses
    import io
    import math

    from pipeplan.backends.observe.progress import Progress
    from pipeplan.backends.runtime.trainer import StepReport

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    first = StepReport(0, 2.5, None, 0.01, 0.5, 1000, ())
    tty = Terminal()
    bar = Progress(3, tmp_path / "m.jsonl", stream=tty)
    bar.step(first, eval_loss=2.0)
    bar.step(dataclasses.replace(first, step=1, loss=2.25))  # the last eval stays shown
    bar.close()
    shown = tty.getvalue().split("\r")[-1]
    assert "loss 2.2500  eval 2.0000 (ppl 7.389)" in shown, shown
    rows = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert rows[0]["eval_loss"] == 2.0 and rows[0]["eval_perplexity"] == math.exp(2.0)
    assert "eval_loss" not in rows[1]
    pipe = io.StringIO()
    plain = Progress(3, stream=pipe)
    plain.step(first, eval_loss=2.0)
    plain.close()
    assert pipe.getvalue() == ("step 1/3  loss 2.5000  lr 1.00e-02  eval_loss 2.0000  "
                               "ppl 7.389  2,000 tok/s  500 ms\n")
