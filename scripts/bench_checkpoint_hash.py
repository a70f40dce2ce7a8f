"""Checkpoint write vs its checksums: how much sha256 of every file adds to a save.

    python scripts/bench_checkpoint_hash.py [--mib 256] [--tensors 64] [--repeats 3]

Writes a DCP checkpoint of `--mib` MiB of float32 tensors with torch's own
FileSystemWriter (one process, as one rank writes its share), then hashes its
files as the checkpoint store does after the write barrier
(backends/state/checkpoint/integrity.py: streamed 1 MiB reads, up to 8 files in
threads), and the same again with one thread. Prints the median of `--repeats`
of each and the ratio hash/write. The files are in the page cache when hashed
(just written), as in a real save.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import warnings

import torch
import torch.distributed.checkpoint as dcp

from pipeplan.backends.state.checkpoint import integrity
from pipeplan.backends.state.checkpoint.integrity import checkpoint_files, digest


def _once(state: dict, folder: str) -> tuple[float, float, float]:
    started = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=folder, no_dist=True)
    written = time.perf_counter()
    names = checkpoint_files(folder, "manifest.json")
    digest(folder, names)
    hashed = time.perf_counter()
    workers, integrity.WORKERS = integrity.WORKERS, 1
    try:
        digest(folder, names)
    finally:
        integrity.WORKERS = workers
    return written - started, hashed - written, time.perf_counter() - hashed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--tensors", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    numel = args.mib * (1 << 20) // 4 // args.tensors
    state = {f"params/t{i}": torch.randn(numel) for i in range(args.tensors)}
    runs = []
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory() as d:
            runs.append(_once(state, os.path.join(d, "step")))
            files = len(os.listdir(os.path.join(d, "step")))
    write, hashed, serial = (statistics.median(r[i] for r in runs) for i in range(3))
    print(f"{args.mib} MiB in {args.tensors} tensors, {files} files, {os.cpu_count()} cores: "
          f"write {write:.3f} s ({args.mib / write:.0f} MiB/s), sha256 {hashed:.3f} s "
          f"({args.mib / hashed:.0f} MiB/s; one thread {serial:.3f} s), "
          f"hash/write {hashed / write:.2f}")


if __name__ == "__main__":
    main()
