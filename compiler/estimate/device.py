"""What the time estimate assumes about the hardware: one accelerator's sustained FLOP/s and
its links (`DeviceModel`, built from the plan's `device` section, CLI flags, or this CPU's
measured speed), and which link each kind of group of the mesh crosses (`mesh_links`)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterable, Optional

import torch

from ...dsl.ast import DeviceSpec, Plan
from ...dsl.layout import global_rank, groups, mesh_layout


@dataclass(frozen=True)
class DeviceModel:
    """What the time estimate assumes about one accelerator and its links.

    `device_model(plan)` builds it from the plan's `device` section (its defaults
    where the plan is silent) and the CLI's flags; the field defaults here are
    those built-in defaults."""

    flops_per_s: float = 400e12  # sustained: the plan's peak × mfu (1000 TFLOP/s × 0.4)
    link_bytes_per_s: float = 50e9  # between nodes (p2p, dp, ep), e.g. 400 Gb/s InfiniBand
    latency_s: float = 10e-6
    tp_link_bytes_per_s: float = 450e9  # inside a node (tp), e.g. NVLink 4
    ranks_per_node: Optional[int] = None  # None: tp inside a node, other groups across
    # host seconds per aten op a stage's forward dispatches, and of backward per such op: the
    # measured CPU model's (cpu_probe.py); 0 for accelerators (launches overlap the kernels)
    op_s: float = 0.0
    op_backward_s: float = 0.0
    origin: str = "built-in defaults"  # where the numbers came from, for the report
    profile: str = ""  # op times and p2p latency measured instead: the cost file (profile.py)

    def link(self, ranks: Iterable[int], inside_by_default: bool = False) -> float:
        """Bandwidth of a group of global ranks: inside a node when all share one
        (ranks are numbered node by node); without ranks_per_node, `inside_by_default`."""
        if self.ranks_per_node is None:
            inside = inside_by_default
        else:
            inside = len({g // self.ranks_per_node for g in ranks}) <= 1
        return self.tp_link_bytes_per_s if inside else self.link_bytes_per_s


def device_model(plan: Plan, tflops: Optional[float] = None,
                 link_gbps: Optional[float] = None) -> DeviceModel:
    """The plan's device section (built-in defaults where it is silent), then the CLI's
    `--tflops` (sustained) and `--link-gbps` (between nodes) where given. Without a device
    section or flags on a machine without CUDA: this CPU's measured FLOP/s and host time
    per op (cpu_probe.py), each rank at its share of the cores when the ranks on one
    machine (all of them, or `device.ranks_per_node`) outnumber them."""
    d, written = plan.device, [k for k in plan.spans if k.startswith("device.")]
    origin = "built-in defaults"
    if written or d != DeviceSpec():
        span = plan.span_of("device")
        origin = (f"plan device section ({span.file}:{span.line}), built-in defaults for "
                  "keys it leaves out")
    flags = [f for f, v in (("--tflops", tflops), ("--link-gbps", link_gbps)) if v is not None]
    if flags:
        origin += "; overridden by " + " ".join(flags)
    flops, op_s, op_backward_s = d.sustained_flops, 0.0, 0.0
    if origin == "built-in defaults" and not torch.cuda.is_available():
        from .cpu_probe import cpu_model  # no accelerator here and none described: this CPU

        cpu = cpu_model()
        # ranks on one machine share its cores (the local launcher starts them all here)
        local = min(plan.mesh.world_size, d.ranks_per_node or plan.mesh.world_size)
        share = max(1.0, local / cores())
        flops, op_s, op_backward_s = (cpu.flops_per_s / share, cpu.op_s * share,
                                      cpu.op_backward_s * share)
        origin = f"{cpu.origin}; built-in link defaults"
        if share > 1:
            origin += (f"; {local} ranks share {cores()} cores: each runs at "
                       f"1/{share:g} of the probe's speed")
    return DeviceModel(
        flops_per_s=tflops * 1e12 if tflops is not None else flops,
        link_bytes_per_s=link_gbps * 1e9 if link_gbps is not None else d.inter_node,
        latency_s=d.latency, tp_link_bytes_per_s=d.intra_node,
        ranks_per_node=d.ranks_per_node, op_s=op_s, op_backward_s=op_backward_s, origin=origin)


def cores() -> int:
    """CPU cores of this machine (what the measured CPU model's ranks share)."""
    return os.cpu_count() or 1


@dataclass(frozen=True)
class Links:
    """Bandwidth of each kind of group of a plan's mesh under a device model (bytes/s)."""

    tp: float
    dp: float  # dp and edp (edp groups lie within the dp group's ranks)
    ep: float
    p2p: float  # the slowest hop between neighbouring pipeline ranks


def mesh_links(plan: Plan, device: DeviceModel) -> Links:
    """Which groups stay inside a node, from the rank layout rank = (pp·dp + dp_i)·tp + tp_i
    (the first group of each kind; the layout repeats it, node boundaries aside)."""
    m = plan.mesh
    per_pp = m.dp * m.cp * m.tp
    rank = lambda p, d, t, c=0: global_rank(m, p, d, t, c)  # noqa: E731
    tp = min(device.link([rank(p, d, t) for t in range(m.tp)], True)
             for p in range(m.pp) for d in range(m.dp))
    dp = min(device.link([rank(p, d, t, c) for d in range(m.dp) for c in range(m.cp)
                          for t in range(m.tp)])
             for p in range(m.pp))
    ep = min(device.link(list(g)) for g in groups(mesh_layout(m), "ep"))
    p2p = min((device.link([g, g + per_pp]) for g in range((m.pp - 1) * per_pp)),
              default=device.link_bytes_per_s)
    return Links(tp=tp, dp=dp, ep=ep, p2p=p2p)
