"""Text -> tokens: `data = text(files = [...], tokenizer = "...")`, tokenised once, cached.

The inputs' documents and the tokenizer are read by compiler/documents.py.
Each document is encoded without special tokens and followed by the EOS id, so
documents are packed back to back with EOS between them. A window may hold
the end of one document and the start of the next, attended to as one
sequence (as nanoGPT's and torchtitan's default loaders do), unless the model
takes the `document_positions` field (backends/runtime/data.py: positions
restarting after each EOS, from which a Hugging Face model builds its own
packed-sequence mask).

The held-out split: a seeded choice (`train.seed`) of round(holdout x documents)
whole documents. The cache file is one `.npy` of token ids (the token-file
format compiler/data.py checks): the training documents in order, then the
held-out ones; `<key>.json` beside it records where the held-out part begins.
`key` hashes the inputs' contents (every file, the tokenizer's files) and every
setting that changes the tokens, so a changed input makes a new file and an
unchanged one is never tokenised twice. A stat memo (paths, sizes, mtimes ->
key) spares later look-ups (every rank's) re-hashing the inputs.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import numpy as np

from ..dsl.ast import Plan
from ..dsl.errors import PlanError
from .documents import (TextError, Tokenizer, check_inputs, documents, input_paths,
                        load_tokenizer)

FORMAT = 1  # bump when the way tokens are made changes
_BATCH = 256  # documents encoded per tokenizer call


@dataclass(frozen=True)
class TokenCache:
    """The tokenised corpus: `path` (.npy ids), training ids in [0, split), held out after."""

    path: str
    split: int  # tokens of the training documents
    tokens: int  # all tokens
    documents: int
    held_out_documents: int
    vocab: int  # the tokenizer's vocabulary (added tokens included)
    eos: int

    @property
    def held_out_tokens(self) -> int:
        return self.tokens - self.split


def refuse(plan: Plan, e: TextError) -> PlanError:
    return PlanError.at(plan, e.key, e.message, e.hint)


# ------------------------------------------------------------------ the cache
def cache_folder(plan: Plan) -> str:
    return plan.resolve_path(plan.data.cache, "data.cache")


def _walk(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    return sorted(os.path.join(d, n) for d, _, names in os.walk(path) for n in names)


def _settings(plan: Plan, tok_files) -> dict:
    d = plan.data
    return {"format": FORMAT, "field": d.field, "eos": d.eos, "holdout": d.holdout,
            "seed": plan.train.seed if d.holdout else 0, "tokenizer": list(tok_files)}


def _stat_key(plan: Plan, inputs: list[str], tok_files) -> str:
    h = hashlib.sha256(json.dumps(_settings(plan, tok_files), sort_keys=True).encode())
    for f in [f for p in inputs for f in _walk(p)] + list(tok_files):
        st = os.stat(f)
        h.update(f"{os.path.abspath(f)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:32]


def _content_key(plan: Plan, inputs: list[str], tok_files) -> str:
    h = hashlib.sha256(json.dumps(_settings(plan, [os.path.basename(f) for f in tok_files]),
                                  sort_keys=True).encode())
    for group in [_walk(p) for p in inputs] + [list(tok_files)]:
        for f in group:
            h.update(os.path.basename(f).encode() + b"\0")
            with open(f, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    h.update(chunk)
        h.update(b"\1")
    return h.hexdigest()[:32]


def _read_meta(folder: str, key: str) -> Optional[TokenCache]:
    try:
        with open(os.path.join(folder, key + ".json"), encoding="utf-8") as f:
            meta = json.load(f)
        cache = TokenCache(**{k: meta[k] for k in TokenCache.__dataclass_fields__})
    except (OSError, ValueError, KeyError, TypeError):
        return None
    cache = TokenCache(**dict(asdict(cache), path=os.path.join(folder, key + ".npy")))
    return cache if os.path.isfile(cache.path) else None


def _atomic_write(path: str, write: Callable) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    write(tmp)
    os.replace(tmp, path)


_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt")


def tokenizer_files(plan: Plan) -> tuple[str, ...]:
    """The files the plan's tokenizer is read from (hashed into the cache key): a folder's
    files but model weights (a model folder may hold its tokenizer too)."""
    path = plan.resolve_path(plan.data.tokenizer, "data.tokenizer")
    if not os.path.exists(path):
        return ()
    return tuple(f for f in _walk(path) if f == path or not f.endswith(_WEIGHTS))


def cached(plan: Plan) -> Optional[TokenCache]:
    """The plan's token file when a cache holds it, found without reading the inputs
    (the stat memo) or, failing that, by hashing them; None when there is none."""
    inputs, folder, tok_files = input_paths(plan), cache_folder(plan), tokenizer_files(plan)
    memo = os.path.join(folder, "stat-" + _stat_key(plan, inputs, tok_files))
    if os.path.isfile(memo):
        with open(memo, encoding="utf-8") as f:
            found = _read_meta(folder, f.read().strip())
        if found is not None:
            return found
    key = _content_key(plan, inputs, tok_files)
    found = _read_meta(folder, key)
    if found is not None:
        _write_text(memo, key)
    return found


def prepare(plan: Plan, vocab: Optional[int] = None, stream=None) -> TokenCache:
    """The plan's cached token file, tokenising the inputs first when no cache holds them
    (a progress bar on `stream`, default stderr). `vocab`: the classes the model predicts;
    a tokenizer with more ids is refused before anything is tokenised. Raises TextError."""
    check_inputs(plan)
    if not plan.data.tokenizer or not os.path.exists(plan.resolve_path(plan.data.tokenizer, "data.tokenizer")):
        load_tokenizer(plan)  # raises: the tokenizer is missing
    found = cached(plan)
    if found is None:
        tok = load_tokenizer(plan)
        check_vocab(tok.vocab, vocab, plan)
        _tokenize(plan, tok, input_paths(plan), cache_folder(plan),
                  _content_key(plan, input_paths(plan), tokenizer_files(plan)),
                  stream or sys.stderr)
        found = cached(plan)
    check_vocab(found.vocab, vocab, plan)
    return found


def check_vocab(tokenizer_vocab: int, model_vocab: Optional[int], plan: Plan) -> None:
    if model_vocab is not None and tokenizer_vocab > model_vocab:
        raise TextError("data.tokenizer", f"the tokenizer has {tokenizer_vocab} ids, but the "
                        f"model predicts {model_vocab} classes (ids 0..{model_vocab - 1})",
                        "use the model's own tokenizer, or a model whose vocabulary holds "
                        f"at least {tokenizer_vocab} ids")


def _write_text(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)

    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)

    _atomic_write(path, write)


def _tokenize(plan: Plan, tok: Tokenizer, inputs: list[str], folder: str, key: str,
              stream) -> TokenCache:
    from tqdm import tqdm

    os.makedirs(folder, exist_ok=True)
    raw = os.path.join(folder, f"{key}.{os.getpid()}.raw")
    lengths: list[int] = []
    dtype = np.uint16 if tok.vocab <= 1 << 16 else np.uint32
    try:
        with open(raw, "wb") as out, tqdm(desc="tokenise", unit="doc", file=stream,
                                          disable=None) as bar:
            for i, path in enumerate(inputs):
                batch: list[str] = []
                docs = 0
                for doc in documents(path, plan.data.field, f"data.files.{i}"):
                    docs += 1
                    batch.append(doc)
                    if len(batch) == _BATCH:
                        _write(out, tok, batch, lengths, dtype, bar)
                        batch = []
                _write(out, tok, batch, lengths, dtype, bar)
                if docs == 0:
                    raise TextError(f"data.files.{i}", f"{path} holds no text",
                                    "every input needs at least one non-empty document")
        if sum(lengths) == len(lengths):
            raise TextError("data.files", "the inputs tokenise to no tokens (only EOS)")
        cache = _arrange(plan, raw, np.asarray(lengths, dtype=np.int64), dtype, tok, folder, key)
    finally:
        if os.path.exists(raw):
            os.remove(raw)
    return cache


def _write(out, tok: Tokenizer, batch: list[str], lengths: list[int], dtype, bar) -> None:
    if not batch:
        return
    for ids in tok.encode(batch):
        row = np.asarray(list(ids) + [tok.eos], dtype=dtype)
        out.write(row.tobytes())
        lengths.append(len(row))
    bar.update(len(batch))


def held_out_documents(count: int, fraction: float, seed: int) -> np.ndarray:
    """Which documents the held-out split takes: round(fraction x count) of them, a seeded
    choice, sorted (at least one when fraction > 0 and there are two documents or more)."""
    take = round(fraction * count)
    if fraction > 0 and count > 1:
        take = min(max(take, 1), count - 1)
    else:
        take = 0
    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(count, size=take, replace=False)) if take else \
        np.zeros(0, dtype=np.int64)


def _arrange(plan: Plan, raw: str, lengths: np.ndarray, dtype, tok: Tokenizer, folder: str,
             key: str) -> TokenCache:
    """The cache file: training documents in order, then the held-out ones."""
    ids = np.memmap(raw, dtype=dtype, mode="r")
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    held = held_out_documents(len(lengths), plan.data.holdout, plan.train.seed)
    is_held = np.zeros(len(lengths), dtype=bool)
    is_held[held] = True
    total = int(lengths.sum())
    path = os.path.join(folder, key + ".npy")

    def write(tmp: str) -> None:
        out = np.lib.format.open_memmap(tmp + ".npy", mode="w+", dtype=dtype, shape=(total,))
        at = 0
        for doc in np.concatenate([np.flatnonzero(~is_held), np.flatnonzero(is_held)]):
            n = int(lengths[doc])
            out[at:at + n] = ids[starts[doc]:starts[doc] + n]
            at += n
        out.flush()
        del out
        os.replace(tmp + ".npy", tmp)

    _atomic_write(path, write)
    cache = TokenCache(path, int(lengths[~is_held].sum()), total, len(lengths), len(held),
                       tok.vocab, tok.eos)
    meta = dict(asdict(cache), path=os.path.basename(path), inputs=input_paths(plan))
    _write_text(os.path.join(folder, key + ".json"), json.dumps(meta, indent=1))
    return cache
