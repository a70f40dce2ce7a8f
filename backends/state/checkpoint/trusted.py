"""Reading a checkpoint without running code from it.

DCP's `.metadata` is a pickle, and its default load planner `torch.load`s byte
items with `weights_only=False`: unpickling runs whatever callables the file
names. pipeplan reads checkpoints only through this module:

* `read_metadata(folder)`: a restricted unpickler that resolves only DCP's
  metadata classes (`ALLOWED`), torch dtypes, `torch.Size` and the layout
  lookup; any other global (os.system, builtins.eval, ...) is refused, naming
  it, before it is called. The result must be a `Metadata` whose storage
  entries name plain files of the folder.
* `TrustedReader`: DCP's FileSystemReader with that metadata (tensors are read
  by DCP with `torch.load(weights_only=True)`).
* `NoBytesLoadPlanner`: refuses byte items (pipeplan writes none) instead of
  `torch.load(weights_only=False)`;
* `load(state, folder, planner)`: dcp.load through both, after refusing any asked-for
  key the metadata says is a pickled object (so the refusal is one clean error).

Plans import code by design (the model's source); checkpoints and weights
never do (docs/runtime.md, "Trust").
"""
from __future__ import annotations

import os
import pickle

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from ....errors import PipeplanError

METADATA = ".metadata"
_DCP = "torch.distributed.checkpoint.metadata"
ALLOWED = {(_DCP, n) for n in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                               "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                               "StorageMeta", "_MEM_FORMAT_ENCODING")} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset")}


class UnsafeCheckpoint(PipeplanError):
    """A checkpoint file that would run code, or is not what pipeplan writes."""


class _Restricted(pickle.Unpickler):
    def __init__(self, file, path: str):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str):
        if (module, name) in ALLOWED or (module == "torch" and
                                         isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise UnsafeCheckpoint(
            f"{self.path}: refers to {module}.{name}, which checkpoint metadata never holds; "
            f"refused without running it (a crafted or foreign file: a checkpoint may not run "
            f"code, see docs/runtime.md)")


def read_metadata(folder: str) -> Metadata:
    """DCP's metadata of the checkpoint in `folder`, unpickled with the allow-list."""
    path = os.path.join(folder, METADATA)
    try:
        with open(path, "rb") as f:
            metadata = _Restricted(f, path).load()
    except UnsafeCheckpoint:
        raise
    except FileNotFoundError:
        raise UnsafeCheckpoint(f"{path}: missing (not a checkpoint folder)") from None
    except Exception as e:  # truncated or garbled pickle
        raise UnsafeCheckpoint(f"{path}: unreadable checkpoint metadata "
                               f"({type(e).__name__}: {e})") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise UnsafeCheckpoint(f"{path}: holds a {type(metadata).__name__}, not DCP metadata")
    for info in metadata.storage_data.values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or os.path.basename(name) != name or name in ("", ".", ".."):
            raise UnsafeCheckpoint(f"{path}: names the data file {name!r}, which is not a file "
                                   f"of this folder")
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    return metadata


class TrustedReader(FileSystemReader):
    """DCP's FileSystemReader whose metadata comes from `read_metadata` (read once)."""

    def __init__(self, folder: str):
        super().__init__(folder)
        self._metadata = read_metadata(folder)

    def read_metadata(self) -> Metadata:  # no **kwargs: DCP then never tries rank files
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


class NoBytesLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner without `torch.load(weights_only=False)` of byte items."""

    def load_bytes(self, read_item, value) -> None:
        raise _object_refused(read_item.dest_index.fqn)


def _object_refused(fqn: str) -> UnsafeCheckpoint:
    return UnsafeCheckpoint(f"checkpoint item {fqn} is a pickled object; pipeplan checkpoints "
                            f"hold tensors only, and loading never unpickles objects")


def load(state: dict, folder: str, planner: DefaultLoadPlanner, **kwargs) -> None:
    """dcp.load of `state` from `folder` with the allow-listed metadata and `planner` (a
    NoBytesLoadPlanner); kwargs go to dcp.load (process_group, no_dist)."""
    import torch.distributed.checkpoint as dcp

    reader = TrustedReader(folder)
    stored = reader._metadata.state_dict_metadata
    objects = sorted(k for k in state if k in stored and
                     not isinstance(stored[k], TensorStorageMetadata))
    if objects:
        raise _object_refused(objects[0])
    try:
        dcp.load(state, storage_reader=reader, planner=planner, **kwargs)
    except CheckpointException as e:  # DCP's wrapper of every rank's traceback: the cause
        cause = next(iter(e.failures.values()), (e,))[0]
        if isinstance(cause, PipeplanError):
            raise cause from None
        raise PipeplanError(f"checkpoint {folder}: reading it failed: "
                            f"{type(cause).__name__}: {str(cause).splitlines()[0][:300]}") from None
