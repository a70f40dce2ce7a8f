"""Built-in device profiles: what one accelerator and its links can do, each value sourced.

A profile is data: peak dense FLOP/s per compute dtype, memory bandwidth and capacity,
NVLink (inside a node) and network (between nodes) bandwidth per GPU in one direction,
latencies, GPUs per node. `device = h100` in a plan names one; the plan's other device keys
override single values (device.py). The three efficiency constants (`Efficiency`: the
fraction of peak GEMMs sustain, of the datasheet memory bandwidth memory-bound kernels get,
of the NVLink bandwidth collectives get) are not datasheet facts: they are fitted by
tests/benchmarks/calibration/fit.py, per family on its calibration set only, and stored in
calibration.json next to this file (the fit's output, never edited by hand): the A100 family
on Narayanan et al. 2021 Table 1, the H100 family (H100 and H200, one GH100 die) on MosaicML's
published H100 table's 2,048-token rows (calibration/mosaic.py). B200 uses the A100 fit (no
published calibration set of its own is in the repo).

Sources (vendor datasheets; "per direction" is half the bidirectional figure NVIDIA quotes):
  A100  NVIDIA A100 Tensor Core GPU datasheet (2021): 312 TFLOP/s dense FP16/BF16 tensor,
        19.5 TFLOP/s FP32; HBM2e 2,039 GB/s (80 GB), HBM2 1,555 GB/s (40 GB); NVLink 3
        600 GB/s bidirectional. DGX A100 datasheet: 8 x 200 Gb/s HDR InfiniBand for compute
        (one per GPU: 25 GB/s), 8 GPUs per node.
  H100  NVIDIA H100 datasheet, SXM5: 989 TFLOP/s dense BF16/FP16 (1,979 with sparsity),
        67 TFLOP/s FP32; HBM3 3.35 TB/s, 80 GB; NVLink 4 900 GB/s bidirectional. DGX H100:
        8 x 400 Gb/s NDR ConnectX-7 (50 GB/s per GPU).
  H200  NVIDIA H200 datasheet, SXM: compute as H100 SXM (989 TFLOP/s dense BF16, 67 FP32);
        HBM3e 4.8 TB/s, 141 GB; NVLink 900 GB/s; DGX H200: 8 x 400 Gb/s ConnectX-7.
  B200  NVIDIA DGX B200 datasheet: 72 PFLOP/s FP8 training for 8 GPUs, i.e. 4.5 PFLOP/s
        dense FP8 and 2.25 PFLOP/s dense BF16 per GPU; 1,440 GB HBM3e (180 GB per GPU),
        64 TB/s (8 TB/s per GPU); NVLink 5 1.8 TB/s bidirectional per GPU; 8 x 400 Gb/s
        ConnectX-7; FP32 (non-tensor) 75 TFLOP/s.
  latency: 5 us inside a node (NVLink p2p, nccl-tests small-message all-reduce ~5-10 us),
        10 us across (InfiniBand ~1-2 us wire + NCCL protocol); an order-of-magnitude figure
        that matters only for small messages.
The measured CPU profile is not here: compiler/cpu_probe.py measures it on this machine.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from typing import Optional

_TB, _GB = 1e12, 1e9


@dataclass(frozen=True)
class Efficiency:
    """The fitted constants of one device family (<= 3; calibration.json)."""

    gemm_peak: float = 0.8  # fraction of peak a large GEMM sustains
    memory: float = 0.8  # fraction of the datasheet memory bandwidth memory-bound kernels get
    link: float = 0.8  # fraction of the datasheet link bandwidth collectives and p2p get
    source: str = "unfitted defaults"


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    flops: dict  # dtype -> peak dense FLOP/s ("bf16", "fp16", "fp32", "fp64")
    memory_bandwidth: float  # bytes/s (HBM)
    memory_bytes: float  # capacity
    intra_node: float  # bytes/s per GPU, one direction (NVLink)
    inter_node: float  # bytes/s per GPU, one direction (its NIC)
    latency: float = 10e-6  # per message / ring step
    ranks_per_node: Optional[int] = 8
    family: str = ""  # which fitted Efficiency applies
    # host seconds per aten op a forward dispatches, and of backward per such op: the measured
    # CPU's (cpu_probe.py); 0 on accelerators (asynchronous launches overlap the kernels)
    op_s: float = 0.0
    op_backward_s: float = 0.0
    efficiency: Efficiency = field(default_factory=Efficiency)
    # fused attention measured per head dimension: ((head dim, forward FLOP/s, backward time
    # over forward), ...) (the measured CPU); empty: a GEMM at the fitted fraction of peak
    attention: tuple = ()
    # host seconds to post one p2p transfer (send or receive) around an action: the measured
    # CPU's gloo (cpu_probe.py); 0 on accelerators (posted asynchronously, under the kernels)
    post_s: float = 0.0
    # host seconds DTensor's dispatch adds per op of a forward, and to backward per such op,
    # in a stage eager tensor parallelism runs on DTensors: the measured CPU's (cpu_probe.py);
    # 0 on accelerators (as op_s)
    dtensor_op_s: float = 0.0
    dtensor_op_backward_s: float = 0.0
    # ... and per tensor the rewrite wraps (forward; the rest of its round trip), per
    # redistribution beyond its collective (cpu_probe.measure_dtensor)
    dtensor_wrap_s: float = 0.0
    dtensor_wrap_backward_s: float = 0.0
    dtensor_redistribute_s: float = 0.0
    # CPU seconds the process's other threads (gloo's workers) spend per ring step of a
    # collective and per p2p message: the measured CPU's (cpu_probe.measure_link); what
    # ranks sharing its cores pay beside their own threads' work. 0 on accelerators
    collective_cpu_s: float = 0.0
    transfer_cpu_s: float = 0.0
    # host seconds each autograd call of a separate W costs beyond the fused backward (one
    # per weight-using op: backends/runtime/split_backward.py): the measured CPU's
    # (cpu_probe.measure_split); 0 on accelerators (as op_s)
    split_call_s: float = 0.0
    # per (optimizer, weight decay on, momentum on): (name, decay, momentum, aten ops a step,
    # ops per tensor) torch's single-tensor optimizer dispatches: the measured CPU's
    # (cpu_probe.count_optimizer_ops); empty on accelerators (host ops are not charged)
    optimizer_ops: tuple = ()
    # host seconds the expert dispatcher adds to one experts call beyond the experts' own
    # ops, ((case, forward, backward), ...) for cpu_probe.DISPATCHES: the measured CPU's
    # (cpu_probe.measure_dispatch); empty on accelerators (as op_s)
    dispatch_s: tuple = ()
    # CPU seconds an action costs beyond its own when its rank resumes on a core another
    # process used meanwhile (ranks outnumbering the cores: each blocking handoff): the
    # measured CPU's (cpu_probe.measure_resume); 0 on accelerators
    resume_s: float = 0.0


DTENSOR_FIELDS = ("dtensor_op_s", "dtensor_op_backward_s", "dtensor_wrap_s",
                  "dtensor_wrap_backward_s", "dtensor_redistribute_s")


PROFILES = {p.name: p for p in (
    DeviceProfile("a100", {"bf16": 312 * _TB, "fp16": 312 * _TB, "fp32": 19.5 * _TB,
                           "fp64": 19.5 * _TB},
                  2039 * _GB, 80 * _GB, 300 * _GB, 25 * _GB, family="a100"),
    DeviceProfile("a100-40gb", {"bf16": 312 * _TB, "fp16": 312 * _TB, "fp32": 19.5 * _TB,
                                "fp64": 19.5 * _TB},
                  1555 * _GB, 40 * _GB, 300 * _GB, 25 * _GB, family="a100"),
    DeviceProfile("h100", {"bf16": 989 * _TB, "fp16": 989 * _TB, "fp32": 67 * _TB,
                           "fp64": 67 * _TB},
                  3350 * _GB, 80 * _GB, 450 * _GB, 50 * _GB, family="h100"),
    DeviceProfile("h200", {"bf16": 989 * _TB, "fp16": 989 * _TB, "fp32": 67 * _TB,
                           "fp64": 67 * _TB},
                  4800 * _GB, 141 * _GB, 450 * _GB, 50 * _GB, family="h100"),
    DeviceProfile("b200", {"bf16": 2250 * _TB, "fp16": 2250 * _TB, "fp32": 75 * _TB,
                           "fp64": 37 * _TB},
                  8000 * _GB, 180 * _GB, 900 * _GB, 50 * _GB, family="a100"),
)}
ALIASES = {"a100-80gb": "a100", "h100-sxm": "h100"}


NAMES = tuple(sorted(PROFILES)) + tuple(sorted(ALIASES))


def calibration_path() -> str:
    return os.path.join(os.path.dirname(__file__), "calibration.json")


def fitted(family: str) -> Efficiency:
    """The stored fit for a device family (calibration.json), else the unfitted defaults."""
    try:
        with open(calibration_path(), encoding="utf-8") as f:
            c = json.load(f)[family]
        return Efficiency(float(c["gemm_peak"]), float(c["memory"]), float(c["link"]),
                          c.get("source", "calibration.json"))
    except (OSError, KeyError, ValueError, TypeError):
        return Efficiency()


def profile(name: str) -> Optional[DeviceProfile]:
    """A built-in profile with its family's fitted efficiency, or None."""
    p = PROFILES.get(ALIASES.get(name, name))
    if p is None:
        return None
    return replace(p, efficiency=fitted(p.family))


def dtype_of(plan) -> str:
    """The compute precision a device's peak is read for (the plan's train.precision)."""
    return {"bf16": "bf16", "fp64": "fp64"}.get(plan.train.precision, "fp32")


def cpu_profile(flops: float, op_s: float, op_backward_s: float, bytes_per_s: float = 0.0,
                attention: tuple = (), link: tuple = (10e-6, 50 * _GB),
                post_s: float = 0.0, dtensor: Optional[dict] = None,
                behind: tuple = (0.0, 0.0), split_call_s: float = 0.0,
                optimizer_ops: tuple = (), dispatch_s: tuple = (),
                resume_s: float = 0.0) -> DeviceProfile:
    """The measured CPU (cpu_probe.py): its matmul FLOP/s for every dtype, memory-bound
    kernels' bandwidth (0: bytes move for free), fused attention per head dimension, host
    time per op (plain, and `dtensor`: the DeviceProfile's dtensor_* fields), and `link`
    (latency s, bytes/s): gloo between its local processes, every group of the plan's ranks
    on it (one machine: no network); `behind`: gloo's own threads' CPU seconds per ring step
    of a collective and per p2p message; `split_call_s`: host seconds per autograd call of a
    separate W; `optimizer_ops`: the optimizers' ops a step and per tensor; `dispatch_s`:
    the expert dispatcher's host seconds per experts call; `resume_s`: an action's CPU on
    resuming a shared core."""
    latency, bandwidth = link
    return DeviceProfile("cpu", {k: flops for k in ("bf16", "fp16", "fp32", "fp64")},
                         bytes_per_s, 0.0, bandwidth, bandwidth, latency, ranks_per_node=None,
                         family="cpu", op_s=op_s, op_backward_s=op_backward_s,
                         efficiency=Efficiency(1.0, 1.0, 1.0, "measured (cpu_probe.py)"),
                         attention=attention, post_s=post_s, collective_cpu_s=behind[0],
                         transfer_cpu_s=behind[1], split_call_s=split_call_s,
                         optimizer_ops=optimizer_ops, dispatch_s=dispatch_s, resume_s=resume_s,
                         **(dtensor or {}))
