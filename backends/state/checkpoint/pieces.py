"""A rank's share of a global tensor as rectangular pieces, in the form DCP reads and writes.

DCP stores each key as chunks (offsets, sizes) of a tensor of global shape
and, on load, reads for every local chunk whatever saved chunks overlap it:
that is the resharding. DTensor offers DCP one chunk per rank; pipeplan's
shards are more varied (a TP slice, an expert block, a ZeRO flat range of
either), so `Pieces` offers DCP any number of chunks per rank through the
same hooks DTensor implements (`__create_write_items__`,
`__create_chunk_list__`), each chunk a view of the tensor that holds it (a
parameter, an optimizer state, a slice of a ZeRO shard). Loading writes
through the views, in place.

A ZeRO flat range of a parameter is not one rectangle: `flat_boxes` cuts it
into at most 2·ndim−1 rectangles, each a contiguous run of elements.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex,
                                                   TensorProperties)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from .trusted import NoBytesLoadPlanner


@dataclass(frozen=True)
class Box:
    """Elements [lo, hi) of a row-major tensor, which form the rectangle offsets/sizes."""

    lo: int
    hi: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


def flat_boxes(shape: tuple[int, ...], lo: int, hi: int) -> list[Box]:
    """Cut the flat element range [lo, hi) of a tensor of `shape` into rectangles."""
    if lo >= hi:
        return []
    if not shape:
        return [Box(lo, hi, (), ())]
    inner = math.prod(shape[1:])
    rest = tuple(shape[1:])
    if lo % inner == 0 and hi % inner == 0:  # whole rows
        return [Box(lo, hi, (lo // inner,) + (0,) * len(rest), (hi // inner - lo // inner,) + rest)]
    first_full, end_full = -(-lo // inner), hi // inner

    def row(r: int, a: int, b: int) -> list[Box]:  # part [a, b) of row r
        return [Box(r * inner + x.lo, r * inner + x.hi, (r,) + x.offsets, (1,) + x.sizes)
                for x in flat_boxes(rest, a, b)]

    if first_full > end_full:  # inside one row
        r = lo // inner
        return row(r, lo - r * inner, hi - r * inner)
    out = []
    if lo < first_full * inner:
        out += row(first_full - 1, lo - (first_full - 1) * inner, inner)
    if first_full < end_full:
        out += flat_boxes(shape, first_full * inner, end_full * inner)
    if end_full * inner < hi:
        out += row(end_full, 0, hi - end_full * inner)
    return out


class Pieces:
    """This rank's chunks of one global tensor: (global offsets, view) pairs."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype):
        self.shape, self.dtype = tuple(shape), dtype
        self.parts: dict[tuple[int, ...], torch.Tensor] = {}

    def add(self, offsets: tuple[int, ...], view: torch.Tensor) -> None:
        self.parts[tuple(offsets)] = view

    def size(self) -> torch.Size:  # DCP compares it with the saved size on load
        return torch.Size(self.shape)

    def at(self, offset) -> torch.Tensor:
        return self.parts[tuple(offset)]

    # -- the hooks DCP's planner helpers call (as they do on a DTensor)
    def __create_write_items__(self, fqn: str, obj) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(off)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(torch.Size(off), view.size()),
                              properties=TensorProperties.create_from_tensor(view),
                              size=self.size()))
                for off, view in self.parts.items()]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(torch.Size(off), view.size())
                for off, view in self.parts.items()]


class PiecesSavePlanner(DefaultSavePlanner):
    def lookup_object(self, index: MetadataIndex):
        obj = self.state_dict[index.fqn]
        if isinstance(obj, Pieces):
            return obj.at(index.offset).detach().contiguous()
        return super().lookup_object(index)


class PiecesLoadPlanner(NoBytesLoadPlanner):
    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        # DCP's set-up maps every value it does not know to None, in place: keep ours
        pieces = {k: v for k, v in state_dict.items() if isinstance(v, Pieces)}
        super().set_up_planner(state_dict, metadata, is_coordinator)
        state_dict.update(pieces)
        self.state_dict.update(pieces)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict[index.fqn]
        if isinstance(obj, Pieces):
            return obj.at(index.offset)
        return super().lookup_tensor(index)
