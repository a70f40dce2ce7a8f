"""`flat_boxes`: a ZeRO flat range of a tensor cut into rectangles DCP can store.

Judged on an index tensor (element i holds i): each rectangle, read as a slice of the
tensor, must be exactly the run of elements [lo, hi) it claims, and the runs must tile
the requested range in order."""
from __future__ import annotations

import math
import random

import torch

from pipeplan.backends.state.checkpoint.pieces import flat_boxes


def test_flat_ranges_are_tiled_by_rectangles():
    rng = random.Random(0)
    shapes = [(), (7,), (3, 4), (2, 3, 5), (4, 1, 3, 2), (1, 6)]
    for shape in shapes:
        n = math.prod(shape)
        index = torch.arange(n).view(shape)
        for _ in range(200):
            lo = rng.randrange(0, n + 1)
            hi = rng.randrange(lo, n + 1)
            boxes = flat_boxes(shape, lo, hi)
            covered = []
            for b in boxes:
                region = index[tuple(slice(o, o + s) for o, s in zip(b.offsets, b.sizes))]
                assert region.flatten().tolist() == list(range(b.lo, b.hi)), (shape, lo, hi, b)
                covered += region.flatten().tolist()
            assert covered == list(range(lo, hi)), (shape, lo, hi, boxes)
            assert len(boxes) <= max(1, 2 * len(shape) - 1), (shape, lo, hi, boxes)
