"""Accelerators `pipeplan plan --device NAME` knows: datasheet numbers, one row each.

Sources: NVIDIA A100 datasheet (SXM4 80 GB: 312 TFLOP/s dense bf16/fp16, NVLink 3 600 GB/s
bidirectional, so 300 GB/s each way; DGX A100: 8 x 200 Gb/s HDR per node, 25 GB/s per GPU),
NVIDIA H100 datasheet (SXM5 80 GB: 989 TFLOP/s dense bf16, NVLink 4 900 GB/s bidirectional,
450 GB/s each way; DGX H100: 400 Gb/s NDR per GPU, 50 GB/s). Memory is the HBM capacity.

`mfu` is not a datasheet number: today's time estimate (compiler/estimate/device.py) runs at
peak x mfu, and 0.4 is the plan language's default (dsl/ast.py DeviceSpec). The per-op time
model of the `predict` work replaces it.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Device:
    flops: float  # peak dense FLOP/s at bf16/fp16
    memory_bytes: float
    intra_node: float  # bytes/s per GPU each way inside a node
    inter_node: float  # bytes/s per GPU between nodes
    latency: float = 10e-6  # seconds per point-to-point message (the plan default)
    mfu: float = 0.4


DEVICES = {
    "a100": Device(flops=312e12, memory_bytes=80e9, intra_node=300e9, inter_node=25e9),
    "h100": Device(flops=989e12, memory_bytes=80e9, intra_node=450e9, inter_node=50e9),
}


def device_section(name: str, ranks_per_node: int) -> str:
    """The plan's `device` section for `name` (what the written plan carries, so `pipeplan
    check` estimates it under the same model)."""
    d = DEVICES[name]
    return (f"device {{\n  flops = {d.flops / 1e12:g}TFLOP/s\n  mfu = {d.mfu:g}\n"
            f"  intra_node = {d.intra_node / 1e9:g}GB/s\n  inter_node = {d.inter_node / 1e9:g}GB/s\n"
            f"  latency = {d.latency * 1e6:g}us\n  ranks_per_node = {ranks_per_node}\n}}")
