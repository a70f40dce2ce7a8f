"""What the time model assumes about the hardware: a device profile with the plan's overrides
(`DeviceModel`, from the plan's `device` section, CLI flags, or this CPU's measured speed),
and which link each kind of group of the mesh crosses (`mesh_links`)."""
from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Iterable, Optional

import torch

from ...dsl.ast import DeviceSpec, Plan
from ...dsl.errors import PlanError
from ...dsl.values import did_you_mean
from .devices import NAMES, DeviceProfile, cpu_profile, profile
from ...dsl.layout import global_rank, groups, mesh_layout


@dataclass(frozen=True)
class DeviceModel:
    """What the time model assumes about one accelerator and its links: a device profile
    (devices.py: datasheet facts and fitted efficiencies) with the plan's overrides, and the
    figures the rest of the estimate reads off it. `device_model(plan)` builds it."""

    flops_per_s: float = 989e12  # peak dense FLOP/s in the plan's compute precision
    link_bytes_per_s: float = 50e9  # between nodes (p2p, dp, ep), per GPU, one direction
    latency_s: float = 10e-6
    tp_link_bytes_per_s: float = 450e9  # inside a node, as collectives get it (x link fit)
    ranks_per_node: Optional[int] = None  # None: tp inside a node, other groups across
    op_s: float = 0.0  # host seconds per aten op (the measured CPU; 0 on accelerators)
    op_backward_s: float = 0.0
    origin: str = "built-in defaults"  # where the numbers came from, for the report
    profile: str = ""  # op times and p2p latency measured instead: the cost file (profile.py)
    hardware: Optional[DeviceProfile] = None  # what ops are costed on (optime.py)

    def link(self, ranks: Iterable[int], inside_by_default: bool = False) -> float:
        """Bandwidth per rank of a group of global ranks: inside a node when all share one
        (ranks are numbered node by node; without ranks_per_node, `inside_by_default`).
        Across nodes NCCL runs one ring per NIC, each crossing the network once per node and
        NVLink otherwise, so a group with g members in each node gets g NICs' bandwidth
        (at most NVLink's): min(intra, g x inter)."""
        ranks = list(ranks)
        if self.ranks_per_node is None:
            if inside_by_default:
                return self.tp_link_bytes_per_s
            return self.link_bytes_per_s
        per_node: dict[int, int] = {}
        for g in ranks:
            per_node[g // self.ranks_per_node] = per_node.get(g // self.ranks_per_node, 0) + 1
        if len(per_node) <= 1:
            return self.tp_link_bytes_per_s
        return min(self.tp_link_bytes_per_s, min(per_node.values()) * self.link_bytes_per_s)


_OVERRIDES = (("memory_bandwidth", "memory_bandwidth"), ("intra_node", "intra_node"),
              ("inter_node", "inter_node"), ("latency", "latency"),
              ("ranks_per_node", "ranks_per_node"))


def device_model(plan: Plan, tflops: Optional[float] = None,
                 link_gbps: Optional[float] = None) -> DeviceModel:
    """The plan's device: its named profile (devices.py) with each key it writes overriding
    the profile's value, then the CLI's `--tflops` (peak) and `--link-gbps` (between nodes).
    No name and no key: on a machine without CUDA, this CPU's measured FLOP/s and host time
    per op (cpu_probe.py), each rank at its share of the cores when the ranks on one machine
    (all of them, or `device.ranks_per_node`) outnumber them; with CUDA, h100."""
    d = plan.device
    if d == DeviceSpec() and not torch.cuda.is_available():
        hw, origin = _this_cpu(plan)
    else:
        hw = profile(d.name or "h100")
        if hw is None:
            raise PlanError.at(plan, "device.name" if d.name else "device",
                               f"unknown device '{d.name}'", did_you_mean(d.name or "", NAMES))
        origin = f"profile {hw.name} (devices.py; fit: {hw.efficiency.source})"
        if d != DeviceSpec():
            span = plan.span_of("device")
            origin += f"; plan device section ({span.file}:{span.line})"
        hw = replace(hw, **{f: getattr(d, k) for k, f in _OVERRIDES if getattr(d, k) is not None})
        if d.flops is not None:
            hw = replace(hw, flops={**hw.flops, dtype_of(plan): d.flops})
    if tflops is not None:
        hw = replace(hw, flops={**hw.flops, dtype_of(plan): tflops * 1e12})
    if link_gbps is not None:
        hw = replace(hw, inter_node=link_gbps * 1e9)
    flags = [f for f, v in (("--tflops", tflops), ("--link-gbps", link_gbps)) if v is not None]
    if flags:
        origin += "; overridden by " + " ".join(flags)
    return model_of(plan, hw, origin)


def model_of(plan: Plan, hw: DeviceProfile, origin: str = "") -> DeviceModel:
    """The DeviceModel of a profile (what a planner calls with a profile of its own)."""
    return DeviceModel(
        flops_per_s=hw.flops[dtype_of(plan)], link_bytes_per_s=hw.inter_node,
        latency_s=hw.latency, tp_link_bytes_per_s=hw.intra_node * hw.efficiency.link,
        ranks_per_node=hw.ranks_per_node, op_s=hw.op_s, op_backward_s=hw.op_backward_s,
        origin=origin or hw.name, hardware=hw)


def dtype_of(plan: Plan) -> str:
    """The compute precision a device's peak is read for."""
    return {"bf16": "bf16", "fp64": "fp64"}.get(plan.train.precision, "fp32")


def _this_cpu(plan: Plan) -> tuple[DeviceProfile, str]:
    from .cpu_probe import cpu_model  # no accelerator here and none described: this CPU
    # ranks on one machine share it (the local launcher starts them all here): each runs at
    # the speed that many processes measured together get
    local = plan.mesh.world_size
    cpu = cpu_model(local)
    share = cpu.contention
    origin = cpu.origin
    if local > 1:
        origin += (f"; {local} ranks share {cores()} cores: each runs {share:g}x slower than "
                   f"alone (measured)")
    return cpu_profile(cpu.flops_per_s / share, cpu.op_s * share, cpu.op_backward_s * share,
                       cpu.bytes_per_s / share,
                       tuple((d, r / share, back) for d, r, back in cpu.attention),
                       (cpu.link_latency_s * share, cpu.link_bytes_per_s / share)), origin


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
