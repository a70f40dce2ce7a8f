"""A token file, opened and checked before any process starts.

`pipeplan check`, `run` and `verify` call `check_data(plan, steps)`: the file
named by `data = tokens(...)` must exist, hold integer tokens (a .bin is
uint16 by definition; a .npy any integer dtype), ids in [0, vocab) where the
vocabulary is known (model.args.vocab, or the traced model's classes), and
enough windows of seq_len + 1 tokens for every step of the run unless the
plan says `wrap = true`. Each problem is a PlanError at the data line naming
the file and the reason. The scan is cheap: the file is memory-mapped and
min/max are taken in chunks (memory bounded by CHUNK, cached per file version).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

import numpy as np

from ..dsl.ast import Plan
from ..dsl.errors import PlanError
from ..errors import PipeplanError

CHUNK = 1 << 24  # tokens per min/max chunk (128 MiB of int64 at most)


class DataFileError(PipeplanError):
    """A token file that cannot be read as tokens; str(e) names the file and why."""


@dataclass(frozen=True)
class TokenStats:
    count: int
    dtype: str
    low: int  # smallest id (0 when empty)
    high: int  # largest id (-1 when empty)


def open_token_file(path: str) -> np.ndarray:
    """The file's tokens, memory-mapped, flat (DataFileError when it is not a token file)."""
    st = _stat(path)
    return _open(path, st.st_size, st.st_mtime_ns)


def token_stats(path: str) -> TokenStats:
    st = _stat(path)
    return _stats(path, st.st_size, st.st_mtime_ns)


def _stat(path: str) -> os.stat_result:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise DataFileError(f"data file {path} does not exist") from None
    except OSError as e:
        raise DataFileError(f"data file {path} cannot be read: {e.strerror or e}") from None
    if not os.path.isfile(path):
        raise DataFileError(f"data file {path} is not a file")
    return st


@lru_cache(maxsize=8)
def _open(path: str, size: int, mtime: int) -> np.ndarray:
    if path.endswith(".bin"):
        if size % 2:
            raise DataFileError(f"data file {path} holds {size} bytes, an odd count: a .bin file "
                                "is uint16 tokens (2 bytes each)")
        if size == 0:
            return np.zeros(0, dtype=np.uint16)  # np.memmap refuses an empty file
        return np.memmap(path, dtype=np.uint16, mode="r")
    if path.endswith(".npy"):
        try:
            array = np.load(path, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError, EOFError) as e:
            raise DataFileError(f"data file {path} is not a readable .npy array: {e}") from None
        if not isinstance(array, np.ndarray):
            raise DataFileError(f"data file {path} is not one .npy array")
        if array.dtype == np.bool_ or not np.issubdtype(array.dtype, np.integer):
            raise DataFileError(f"data file {path} holds {array.dtype} values, not integer token "
                                "ids (they would be truncated); save the ids as an integer array")
        return array.reshape(-1)
    raise DataFileError(f"data file {path}: expected a .bin (uint16 tokens) or .npy file")


@lru_cache(maxsize=8)
def _stats(path: str, size: int, mtime: int) -> TokenStats:
    tokens = _open(path, size, mtime)
    low, high = 0, -1
    for start in range(0, len(tokens), CHUNK):
        part = np.asarray(tokens[start:start + CHUNK])
        low = int(part.min()) if start == 0 else min(low, int(part.min()))
        high = max(high, int(part.max()))
    return TokenStats(len(tokens), str(tokens.dtype), low, high)


def plan_vocab(plan: Plan) -> Optional[int]:
    """The vocabulary the plan states (model.args.vocab, or a model folder's config.json
    vocab_size), if any."""
    v = plan.model.args.get("vocab")
    if v is None and ":" not in plan.model.source:
        from .capture.loading import folder_config

        v = (folder_config(plan) or {}).get("vocab_size")
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def check_data(plan: Plan, steps: Optional[int] = None, vocab: Optional[int] = None) -> None:
    """Refuse a token file the run cannot read, at the plan's data line (see the module doc).

    `steps`: the steps the run will take (default train.steps); `vocab`: the number of
    classes the model predicts, when known (else model.args.vocab)."""
    if plan.data.kind == "text":
        return check_text(plan, steps, vocab)
    if plan.data.kind != "file":
        return

    path = resolve_data_path(plan)
    key = "data.path" if "data.path" in plan.spans else "data"
    try:
        stats = token_stats(path)
    except DataFileError as e:
        raise PlanError.at(plan, key, str(e), _HINT) from None
    problems = []
    if stats.count == 0:
        problems.append(f"data file {path} is empty")
    if stats.low < 0:
        problems.append(f"data file {path} holds negative token ids (smallest {stats.low})")
    vocab = vocab if vocab is not None else plan_vocab(plan)
    if vocab is not None and stats.high >= vocab:
        problems.append(f"data file {path} holds token id {stats.high}, but the model's "
                        f"vocabulary is {vocab} (ids 0..{vocab - 1})")
    window = plan.data.seq_len + 1
    windows = stats.count // window
    steps = plan.train.steps if steps is None else steps
    need = steps * plan.train.global_batch
    if stats.count and windows == 0:
        problems.append(f"data file {path} holds {stats.count} tokens, fewer than one window "
                        f"of seq_len + 1 = {window}")
    elif stats.count and need > windows and not plan.data.wrap:
        problems.append(f"data file {path} holds {windows:,} windows of seq_len + 1 = {window} "
                        f"tokens, but {steps} steps of global_batch = {plan.train.global_batch} "
                        f"read {need:,} ({need / windows:.1f}x the file)")
    if problems:
        hint = ("add wrap = true to data = tokens(...) to read the file again from its start, "
                "or train fewer steps" if "windows" in problems[-1] and len(problems) == 1
                else _HINT)
        raise PlanError.at(plan, key, "; ".join(problems), hint)


_HINT = ("data = tokens(\"FILE\") reads a .bin of uint16 ids or a .npy integer array, ids in "
         "[0, vocab); paths are relative to the plan file")


def resolve_data_path(plan: Plan) -> str:
    """A relative data path resolves against the plan file's folder."""
    return plan.resolve_path(plan.data.path or "", "data.path")


def check_text(plan: Plan, steps: Optional[int] = None, vocab: Optional[int] = None):
    """`data = text(...)`: the inputs read and tokenise (once: compiler/text.py caches the
    tokens), the tokenizer fits the model's vocabulary, and the windows suffice for the run
    (training) and for train.eval (held out). Returns the TokenCache."""
    from .documents import TextError
    from .text import prepare, refuse

    try:
        cache = prepare(plan, vocab if vocab is not None else plan_vocab(plan))
    except TextError as e:
        raise refuse(plan, e) from None
    window = plan.data.seq_len + 1
    train, held = cache.split // window, cache.held_out_tokens // window
    steps = plan.train.steps if steps is None else steps
    need = steps * plan.train.global_batch
    if train == 0:
        raise PlanError.at(plan, "data", f"the text's training documents make {cache.split} "
                           f"tokens, fewer than one window of seq_len + 1 = {window}",
                           "give more text, or a shorter seq_len")
    if need > train and not plan.data.wrap:
        raise PlanError.at(plan, "data", f"the text makes {train:,} training windows of "
                           f"seq_len + 1 = {window} tokens, but {steps} steps of global_batch "
                           f"= {plan.train.global_batch} read {need:,} ({need / train:.1f} "
                           "epochs)", "add wrap = true to data = text(...) to train more than "
                           "one epoch (reshuffled each epoch), or train fewer steps")
    if plan.train.eval is not None and held == 0:
        raise PlanError.at(plan, "data.holdout" if "data.holdout" in plan.spans else "data",
                           f"the held-out documents make {cache.held_out_tokens} tokens, fewer "
                           f"than one window of seq_len + 1 = {window}: nothing to evaluate on",
                           "hold out more (a larger holdout), or give more text")
    return cache
