"""Token files checked before launch: each bad file is refused by `pipeplan check` (and
`run`, before any process starts) with exit 2, the plan's data line and the file named,
no traceback, in bounded time and memory; `wrap = true` is the one way to read a short
file, and it changes what the run reads."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeplan.backends.runtime import data
from pipeplan.compiler.data import check_data
from pipeplan.dsl import PlanError, parse_plan

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bad_input_plans", REPO / "tests/dsl/test_bad_input.py")
_corpus = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_corpus)

SEQ, BATCH, STEPS = 8, 4, 2  # the plan reads STEPS * BATCH windows of SEQ + 1 tokens
NEED = STEPS * BATCH * (SEQ + 1)


def plan_for(path: str, extra: str = "") -> str:
    return _corpus.plan_text(data_extra=extra).replace(
        "synthetic(vocab = 32, seq_len = 8", f'tokens("{path}", seq_len = {SEQ}')


def _npy(array) -> bytes:
    import io

    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


GOOD_IDS = np.arange(NEED) % 32

# name -> (file name, file bytes or None for no file, what the message says)
FILES = {
    "missing file": ("nope.bin", None, "does not exist"),
    "float .npy": ("f.npy", _npy(GOOD_IDS.astype(np.float32)), "holds float32 values"),
    "bool .npy": ("b.npy", _npy(GOOD_IDS > 3), "holds bool values"),
    "not an .npy": ("x.npy", b"hello, world", "is not a readable .npy array"),
    "id >= vocab": ("big.bin", np.concatenate([GOOD_IDS, [32]]).astype(np.uint16).tobytes(),
                    "holds token id 32, but the model's vocabulary is 32"),
    "negative ids": ("neg.npy", _npy(np.concatenate([GOOD_IDS, [-5]]).astype(np.int32)),
                     "negative token ids (smallest -5)"),
    "empty .bin": ("e.bin", b"", "is empty"),
    "odd-sized .bin": ("o.bin", b"\x01\x00\x02", "an odd count"),
    "53x too short": ("short.bin", GOOD_IDS[:NEED // 53].astype(np.uint16).tobytes(),
                      "fewer than one window"),
    "too short for the steps": ("half.bin", GOOD_IDS[:NEED // 2].astype(np.uint16).tobytes(),
                                "2 steps of global_batch = 4 read 8 (2.0x the file)"),
}


@pytest.mark.parametrize("command", ["check", "run"])
def test_every_bad_token_file_is_refused_before_launch(tmp_path, command):
    cases = {}
    for name, (file, content, says) in FILES.items():
        cases[name] = (plan_for(file), says, {} if content is None else {file: content})
    results = _corpus.run_corpus(tmp_path, cases, lambda plan: [command, str(plan)])
    assert set(results) == set(FILES)
    for i, (name, (file, content, says)) in enumerate(FILES.items()):
        r = results[name]
        assert r["rc"] == 2, (name, r)
        assert "Traceback" not in r["err"] and "launching" not in r["out"], (name, r)
        assert says in r["err"], (name, r["err"])
        assert f"data file {tmp_path / f'case{i}' / file}" in r["err"], (name, r["err"])
        assert f"{tmp_path / f'case{i}' / 'bad.plan'}:" in r["err"] and "^" in r["err"]
        assert r["seconds"] < 60


def test_wrap_reads_a_short_file_again_from_its_start(tmp_path):
    ids = (np.arange(NEED // 2) % 32).astype(np.uint16)
    (tmp_path / "half.bin").write_bytes(ids.tobytes())
    strict = parse_plan(plan_for("half.bin"), str(tmp_path / "p.plan"))
    wrapped = parse_plan(plan_for("half.bin", ", wrap = true"), str(tmp_path / "p.plan"))
    with pytest.raises(PlanError, match="add wrap = true"):
        check_data(strict)
    check_data(wrapped)
    # the file holds one step's windows: step 0 reads them in both; step 1 exists only
    # when wrapping, and reads them again
    windows = ids[:len(ids) // (SEQ + 1) * (SEQ + 1)].reshape(-1, SEQ + 1).astype(np.int64)
    assert len(windows) == BATCH
    assert torch.equal(data.global_batch(strict, 0).input_ids, torch.from_numpy(windows[:, :-1]))
    with pytest.raises(Exception, match="wrap = true"):
        data.global_batch(strict, 1)
    again = data.global_batch(wrapped, 1)
    assert torch.equal(again.input_ids, torch.from_numpy(windows[:, :-1]))
    assert torch.equal(again.targets, torch.from_numpy(windows[:, 1:]))


def test_a_long_enough_file_passes_and_its_ids_are_read_as_written(tmp_path):
    ids = (np.arange(NEED) * 7 % 32).astype(np.int32)
    np.save(tmp_path / "ok.npy", ids)
    plan = parse_plan(plan_for("ok.npy"), str(tmp_path / "p.plan"))
    check_data(plan)
    rows = ids.reshape(-1, SEQ + 1).astype(np.int64)
    batch = data.global_batch(plan, 1)
    assert torch.equal(batch.input_ids, torch.from_numpy(rows[BATCH:2 * BATCH, :-1]))
    assert torch.equal(batch.targets, torch.from_numpy(rows[BATCH:2 * BATCH, 1:]))
