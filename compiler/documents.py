"""The inputs of `data = text(...)`: their documents, and the tokenizer (compiler/text.py
tokenises them into the cached token file).

Documents come from plain text (`.txt`, `.md`: documents are separated by a
blank line), JSON Lines (`.jsonl`: the `field` of each object), Parquet
(`.parquet`: the `field` column, read by pyarrow) and Hugging Face `datasets`
folders written by `save_to_disk` (the `field` column; a DatasetDict's "train"
split). Nothing is fetched: every path is local, relative to the plan file.

The tokenizer is a Hugging Face one: a folder (`save_pretrained`, read by
transformers' AutoTokenizer) or a `tokenizer.json` file (read by `tokenizers`),
with its end-of-document id: `eos` of the plan, else the tokenizer's eos_token.
Every problem is a TextError naming the plan key it is about.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

from ..dsl.ast import Plan

TEXT_SUFFIXES = (".txt", ".text", ".md")
JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)


class TextError(Exception):
    """One input problem: the dotted plan key it is about, the message, a hint."""

    def __init__(self, key: str, message: str, hint: Optional[str] = None):
        super().__init__(message)
        self.key, self.message, self.hint = key, message, hint


# ------------------------------------------------------------------ documents
def input_paths(plan: Plan) -> list[str]:
    return [plan.resolve_path(f, "data.files") for f in plan.data.files]


def check_inputs(plan: Plan) -> None:
    """Every file exists and is of a known kind (TextError at its list item)."""
    for i, path in enumerate(input_paths(plan)):
        key = f"data.files.{i}"
        if os.path.isdir(path):
            if not _is_saved_dataset(path):
                raise TextError(key, f"{path} is a folder but not a saved Hugging Face dataset "
                                "(no dataset_info.json or dataset_dict.json)",
                                "name the text files, or a folder written by "
                                "Dataset.save_to_disk")
            continue
        if not os.path.isfile(path):
            raise TextError(key, f"data file {path} does not exist",
                            "paths are relative to the plan file's folder")
        if not path.endswith(TEXT_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES):
            raise TextError(key, f"data file {path}: unknown kind of file",
                            "text() reads .txt/.md (documents split by a blank line), .jsonl "
                            "(a field), .parquet (a column) or a save_to_disk dataset folder")


def _is_saved_dataset(path: str) -> bool:
    return any(os.path.isfile(os.path.join(path, n))
               for n in ("dataset_info.json", "dataset_dict.json", "state.json"))


def documents(path: str, field: str, key: str) -> Iterator[str]:
    """The documents of one input, in order."""
    if os.path.isdir(path):
        yield from _dataset_documents(path, field, key)
    elif path.endswith(JSONL_SUFFIXES):
        yield from _jsonl_documents(path, field, key)
    elif path.endswith(PARQUET_SUFFIXES):
        yield from _parquet_documents(path, field, key)
    else:
        yield from _text_documents(path)


def _text_documents(path: str) -> Iterator[str]:
    """Paragraphs of a text file (split at blank lines), read line by line."""
    lines: list[str] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                lines.append(line)
            elif lines:
                yield "".join(lines).rstrip("\n")
                lines = []
    if lines:
        yield "".join(lines).rstrip("\n")


def _jsonl_documents(path: str, field: str, key: str) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise TextError(key, f"{path}:{n}: not a JSON object: {e}") from None
            if not isinstance(row, dict) or field not in row:
                have = ", ".join(sorted(row)) if isinstance(row, dict) else type(row).__name__
                raise TextError("data.field", f"{path}:{n} has no field {field!r} (it has: "
                                f"{have})", "set field = \"...\" in data = text(...)")
            if not isinstance(row[field], str):
                raise TextError("data.field", f"{path}:{n}: field {field!r} holds "
                                f"{type(row[field]).__name__}, not text")
            yield row[field]


def _require(module: str, extra: str, key: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise TextError(key, f"reading this file needs the {module.split('.')[0]} package",
                        f"pip install 'pipeplan[{extra}]'") from None


def _parquet_documents(path: str, field: str, key: str) -> Iterator[str]:
    pq = _require("pyarrow.parquet", "data", key)
    try:
        f = pq.ParquetFile(path)
    except Exception as e:  # pyarrow's errors have no common base
        raise TextError(key, f"{path} is not a readable Parquet file: {e}") from None
    names = f.schema_arrow.names
    if field not in names:
        raise TextError("data.field", f"{path} has no column {field!r} (it has: "
                        f"{', '.join(names)})", "set field = \"...\" in data = text(...)")
    for batch in f.iter_batches(columns=[field]):
        yield from _strings(batch.column(0).to_pylist(), path, field)


def _dataset_documents(path: str, field: str, key: str) -> Iterator[str]:
    datasets = _require("datasets", "data", key)
    try:
        ds = datasets.load_from_disk(path)
    except Exception as e:  # datasets raises FileNotFoundError, ValueError, ...
        raise TextError(key, f"{path}: cannot load the saved dataset: {e}") from None
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise TextError(key, f"{path} holds splits {', '.join(ds)} and no 'train'",
                            "save the split to read with ds[\"...\"].save_to_disk(...)")
        ds = ds["train"]
    if field not in ds.column_names:
        raise TextError("data.field", f"{path} has no column {field!r} (it has: "
                        f"{', '.join(ds.column_names)})", "set field = \"...\" in data = text(...)")
    for start in range(0, len(ds), 1024):
        yield from _strings(ds[start:start + 1024][field], path, field)


def _strings(values, path: str, field: str) -> Iterator[str]:
    for v in values:
        if not isinstance(v, str):
            raise TextError("data.field", f"{path}: column {field!r} holds "
                            f"{type(v).__name__}, not text")
        yield v


# ------------------------------------------------------------------ tokenizer
@dataclass(frozen=True)
class Tokenizer:
    encode: Callable[[list[str]], list[list[int]]]  # no special tokens added
    vocab: int
    eos: int


def load_tokenizer(plan: Plan) -> Tokenizer:
    """The plan's tokenizer, with the EOS id (TextError at data.tokenizer / data.eos)."""
    path = plan.resolve_path(plan.data.tokenizer, "data.tokenizer")
    if os.path.isdir(path):
        return _from_folder(path, plan.data.eos)
    if not os.path.isfile(path):
        raise TextError("data.tokenizer", f"tokenizer {path} does not exist",
                        "a save_pretrained folder or a tokenizer.json, relative to the plan")
    return _from_json(path, plan.data.eos)


def _from_json(path: str, eos: Optional[str]) -> Tokenizer:
    Raw = _require("tokenizers", "data", "data.tokenizer").Tokenizer

    try:
        tok = Raw.from_file(path)
    except Exception as e:  # tokenizers raises its own Exception subclasses
        raise TextError("data.tokenizer", f"{path} is not a tokenizer.json: {e}") from None
    if eos is None:
        special = [t.content for t in tok.get_added_tokens_decoder().values() if t.special]
        raise TextError("data.tokenizer", f"{path} names no end-of-document token",
                        "say which it is: eos = \"...\" in data = text(...)"
                        + (f"; its special tokens: {', '.join(special)}" if special else ""))
    eos_id = tok.token_to_id(eos)
    if eos_id is None:
        raise TextError("data.eos", f"{eos!r} is not a token of {path}")

    def encode(texts: list[str]) -> list[list[int]]:
        return [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]

    return Tokenizer(encode, tok.get_vocab_size(with_added_tokens=True), eos_id)


def _from_folder(path: str, eos: Optional[str]) -> Tokenizer:
    try:
        from transformers import AutoTokenizer
    except ImportError:
        if os.path.isfile(os.path.join(path, "tokenizer.json")):
            return _from_json(os.path.join(path, "tokenizer.json"), eos)
        raise TextError("data.tokenizer", f"reading the tokenizer folder {path} needs "
                        "transformers", "pip install 'pipeplan[data]'") from None
    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # transformers raises OSError, ValueError, ...
        raise TextError("data.tokenizer", f"{path}: not a tokenizer folder: {e}",
                        "a folder written by tokenizer.save_pretrained(...)") from None
    eos_id = tok.eos_token_id if eos is None else tok.convert_tokens_to_ids(eos)
    if eos is not None and (eos_id is None or eos_id == tok.unk_token_id and eos != tok.unk_token):
        raise TextError("data.eos", f"{eos!r} is not a token of the tokenizer in {path}")
    if eos_id is None:
        raise TextError("data.tokenizer", f"the tokenizer in {path} has no eos_token",
                        "say which token ends a document: eos = \"...\" in data = text(...)")

    def encode(texts: list[str]) -> list[list[int]]:
        return tok(texts, add_special_tokens=False, verbose=False)["input_ids"]

    return Tokenizer(encode, len(tok), int(eos_id))
