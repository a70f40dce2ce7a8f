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
from .devices import DTENSOR_FIELDS, NAMES, DeviceProfile, cpu_profile, dtype_of, profile
from ...dsl.layout import groups, mesh_layout


SHARING_ROUNDS = 5  # busy ranks and shared stage times depend on each other (a collective's
# wait leaves the cores to others, and lengthens with the loaded latency): this many rounds
# of timeline -> busy -> speeds settle them; they oscillate, damped (on the example hybrid
# with the probe of stop 42 each round's error is ~-0.27 of the last: 34%, 8%, 2.5%, 0.6%,
# 0.15% off the fixed point)


@dataclass(frozen=True)
class Sharing:
    """Ranks that share one machine's cores (the local launcher on the measured CPU): each runs
    max(1, busy x replicas / cores) slower than alone (the fair share; what each action pays
    beyond it on resuming a core another process used is per action, `resume`), where `busy` is
    how many pipeline ranks compute at once while one does, on the simulated timeline
    (SimResult.concurrency: a rank waiting in a bubble leaves its core to the others), and
    `replicas` the copies of that pipeline (dp x cp x tp) running the same timeline. A
    message's latency goes from the idle pair's (`latency`) to what a pair measured with all
    `ranks` busy (`loaded_latency`: the scheduler's wait) as the busy ranks go from `cores`
    to `ranks`. A rank never runs faster than alone, so the speeds alone bound every shared
    step from below (what the planner's bounds read)."""

    ranks: int
    cores: int
    replicas: int = 1
    latency: float = 0.0
    loaded_latency: float = 0.0

    def factor(self, busy: float) -> float:
        """How much slower than alone a rank runs: the fair share of the cores, waiting for
        one (what CPU times measured under sharing, as the ring probe's posting, still wait
        for)."""
        return max(1.0, busy * self.replicas / self.cores)

    @property
    def resume(self) -> bool:
        """Do the ranks outnumber the cores, so that each action resumes on a core another
        process used while its rank waited (predict.resume_s)?"""
        return self.ranks > self.cores

    def message_latency(self, busy: float) -> float:
        over = (busy * self.replicas - self.cores) / max(self.ranks - self.cores, 1)
        share = min(max(over, 0.0), 1.0)
        return max(self.latency * self.factor(busy),
                   self.latency + share * (self.loaded_latency - self.latency))


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
    sharing: Optional[Sharing] = None  # the ranks share this machine: speeds are alone
    shared_at: Optional[tuple] = None  # (Sharing, busy): speeds as `shared(busy)` made them

    @property
    def ring_step_s(self) -> float:
        """Seconds per ring step of a collective (a message each rank sends): the message
        latency, or on the measured CPU what gloo's own threads compute per step where that
        is longer (small collectives there are CPU-bound: cpu_probe.measure_link)."""
        return max(self.latency_s, self.hardware.collective_cpu_s if self.hardware else 0.0)

    def shared(self, busy: float) -> "DeviceModel":
        """This machine's speeds when `busy` of the plan's ranks compute at once (see
        Sharing); itself when nothing is shared."""
        if self.sharing is None:
            return self
        k = self.sharing.factor(busy)
        hw = self.hardware
        latency = self.sharing.message_latency(busy)
        scaled = replace(hw, flops={d: f / k for d, f in hw.flops.items()},
                         memory_bandwidth=hw.memory_bandwidth / k,
                         intra_node=hw.intra_node / k, inter_node=hw.inter_node / k,
                         latency=latency, op_s=hw.op_s * k,
                         op_backward_s=hw.op_backward_s * k,
                         post_s=hw.post_s * k,  # measured shared: the fair share's wait
                         collective_cpu_s=hw.collective_cpu_s * k,
                         transfer_cpu_s=hw.transfer_cpu_s * k,
                         split_call_s=hw.split_call_s * k,
                         dispatch_s=tuple((c, f * k, b * k) for c, f, b in hw.dispatch_s),
                         resume_s=hw.resume_s * k,
                         **{f: getattr(hw, f) * k for f in DTENSOR_FIELDS},
                         attention=tuple((d, r / k, b) for d, r, b in hw.attention))
        s = self.sharing
        at_once = busy * s.replicas
        origin = (f"{self.origin}; {s.ranks} ranks share {s.cores} cores, {at_once:.2f} of "
                  f"them computing at once: each runs {k:.3g}x slower than alone "
                  f"(max(1, {at_once:.2f} / {s.cores}))"
                  + (f", each action {self.hardware.resume_s * 1e6:.0f} us more on resuming its "
                     f"core (measured)" if s.resume and self.hardware.resume_s else ""))
        return replace(self, flops_per_s=self.flops_per_s / k,
                       link_bytes_per_s=self.link_bytes_per_s / k, latency_s=latency,
                       tp_link_bytes_per_s=self.tp_link_bytes_per_s / k, op_s=self.op_s * k,
                       op_backward_s=self.op_backward_s * k, hardware=scaled, origin=origin,
                       sharing=None, shared_at=(s, busy))

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
    per op (cpu_probe.py), at the speeds alone, with how the plan's ranks share the machine
    (`sharing`: applied once the schedule's timeline is known, `DeviceModel.shared`); with
    CUDA, h100."""
    d, sharing = plan.device, None
    if d == DeviceSpec() and not torch.cuda.is_available():
        hw, origin, sharing = _this_cpu(plan)
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
    return replace(model_of(plan, hw, origin), sharing=sharing)


def model_of(plan: Plan, hw: DeviceProfile, origin: str = "") -> DeviceModel:
    """The DeviceModel of a profile (what a planner calls with a profile of its own)."""
    return DeviceModel(
        flops_per_s=hw.flops[dtype_of(plan)], link_bytes_per_s=hw.inter_node,
        latency_s=hw.latency, tp_link_bytes_per_s=hw.intra_node * hw.efficiency.link,
        ranks_per_node=hw.ranks_per_node, op_s=hw.op_s, op_backward_s=hw.op_backward_s,
        origin=origin or hw.name, hardware=hw)


def _this_cpu(plan: Plan) -> tuple[DeviceProfile, str]:
    from .cpu_probe import cpu_model  # no accelerator here and none described: this CPU
    # ranks on one machine share it (the local launcher starts them all here): the speeds
    # alone, and how many processes busy at once slow each other (DeviceModel.shared)
    local = plan.mesh.world_size
    cpu = cpu_model(local)
    sharing = Sharing(local, cores(),
                      local // plan.mesh.pp, cpu.link_latency_s, cpu.loaded_latency_s) \
        if local > 1 else None
    return cpu_profile(cpu.flops_per_s, cpu.op_s, cpu.op_backward_s, cpu.bytes_per_s,
                       cpu.attention, (cpu.link_latency_s, cpu.link_bytes_per_s),
                       cpu.post_s, {k: getattr(cpu, k) for k in DTENSOR_FIELDS},
                       (cpu.collective_cpu_s, cpu.transfer_cpu_s), cpu.split_call_s,
                       cpu.optimizer_ops, cpu.dispatch_s, cpu.resume_s), \
        cpu.origin, sharing


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
    """Each axis's bandwidth per rank: the slowest of its groups in the rank layout
    rank = ((pp_i·dp + dp_i)·cp + cp_i)·tp + tp_i (dsl/layout.global_rank), by which of
    them stay inside a node (DeviceModel.link)."""
    m = plan.mesh
    per_pp = m.dp * m.cp * m.tp
    # ep: every group of one rank has the same link (no two nodes); else each group's
    ep = device.link((0,)) if m.ep == 1 else \
        min(device.link(list(g)) for g in groups(mesh_layout(m), "ep"))
    rpn = device.ranks_per_node
    if rpn is None:  # no nodes: tp inside one by default, the rest across
        return Links(tp=device.tp_link_bytes_per_s, dp=device.link_bytes_per_s, ep=ep,
                     p2p=device.link_bytes_per_s)
    # a tp group is the block of tp ranks from global_rank(p, d, 0) = j cp tp (j < pp dp), a
    # dp group the block of a pipeline stage's per_pp ranks from p per_pp, a p2p pair
    # (g, g + per_pp): each group's bandwidth depends only on its first rank modulo the
    # node size (a shift by whole nodes keeps its ranks per node), and j k mod rpn repeats
    # within rpn steps of j: so each minimum is over at most rpn groups, whatever the size
    tp = min(device.link(range(s, s + m.tp), True) for s in _starts(m.cp * m.tp, m.pp * m.dp, rpn))
    dp = min(device.link(range(s, s + per_pp)) for s in _starts(per_pp, m.pp, rpn))
    p2p = min((device.link((s, s + per_pp)) for s in _starts(1, (m.pp - 1) * per_pp, rpn)),
              default=device.link_bytes_per_s)
    return Links(tp=tp, dp=dp, ep=ep, p2p=p2p)


def _starts(step: int, count: int, rpn: int) -> list[int]:
    """{j x step mod rpn : j < count}, in order of first appearance."""
    return list(dict.fromkeys(j * step % rpn for j in range(min(count, rpn))))
