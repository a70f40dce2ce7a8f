"""Cross-island traffic and step time of the plan's data-parallel sync mode (DiLoCo).

Every-step data parallelism all-reduces each rank's gradients every step (estimates.py's
dp bytes). DiLoCo all-reduces pseudo-gradients, the same bytes per parameter, once every
H steps per fragment (backends/parallel/diloco/sync.py): per step H times fewer on average; at one sync
a rank sends its share of one fragment (streaming DiLoCo flattens the peak K-fold when
the fragments are of equal size). The predicted step time is the simulated pipeline plus
the amortised dp traffic over the dp group's link (the device model's inter-node
bandwidth unless the dp group lies inside a node), not overlapped.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ...dsl.ast import Plan, SyncSpec


@dataclass(frozen=True)
class SyncEstimate:
    mode: str  # "diloco"
    inner_steps: int
    fragments: int
    every_step_dp_bytes: int  # the busiest rank's dp bytes per step under every-step DP
    dp_bytes_per_step: int  # ... under this mode, averaged over the steps
    peak_sync_bytes: int  # ... at one sync (its largest fragment)
    every_step_time_s: float  # predicted step time under every-step DP
    step_time_s: float  # predicted average step time under this mode


def _fragment_share(plan: Plan, stages, rank: int) -> float:
    """The largest fraction of rank `rank`'s parameters in one fragment."""
    total, by_fragment = 0, {}
    count = plan.mesh.pp * plan.pipeline.virtual
    for st in stages:
        if st.rank != rank:
            continue
        n = sum(p.numel() for p in st.module.parameters()) if st.module is not None else 0
        f = fragment_of_stage(st.index, count, plan.sync.fragments)
        by_fragment[f] = by_fragment.get(f, 0) + n
        total += n
    return max(by_fragment.values(), default=0) / total if total else 1.0


def sync_estimate(plan: Plan, stages, ranks, makespan: float, dp_link: float
                  ) -> Optional[SyncEstimate]:
    """None for every-step sync; for DiLoCo, sets each rank's comm_bytes["dp"] to its
    average per step and returns the comparison."""
    s = plan.sync
    if not s.diloco:
        return None
    every = max((rk.comm_bytes.get("dp", 0) for rk in ranks), default=0)
    per_replica = plan.mesh.dp * plan.mesh.tp
    peak = 0
    for rk in ranks:
        share = _fragment_share(plan, stages, rk.rank // per_replica)
        peak = max(peak, int(rk.comm_bytes.get("dp", 0) * share))
        rk.comm_bytes["dp"] = int(rk.comm_bytes.get("dp", 0) / s.inner_steps)
    per_step = max((rk.comm_bytes["dp"] for rk in ranks), default=0)
    return SyncEstimate("diloco", s.inner_steps, s.fragments, every, per_step, peak,
                        makespan + every / dp_link, makespan + per_step / dp_link)


def sync_line(e: SyncEstimate, human_bytes) -> str:
    ratio = e.every_step_dp_bytes / e.dp_bytes_per_step if e.dp_bytes_per_step else float("inf")
    return (f"sync: diloco(H={e.inner_steps}, K={e.fragments}): cross-island "
            f"{human_bytes(e.dp_bytes_per_step)}/step per rank vs every-step DP "
            f"{human_bytes(e.every_step_dp_bytes)} ({ratio:.3g}x fewer), peak "
            f"{human_bytes(e.peak_sync_bytes)} per sync; predicted step {e.step_time_s:.4g} s "
            f"vs {e.every_step_time_s:.4g} s every step")


def fragment_of_stage(stage: int, stages: int, fragments: int) -> int:
    return stage * fragments // stages


def fragment_offset(fragment: int, inner_steps: int, fragments: int) -> int:
    return fragment * inner_steps // fragments


def syncs_after(n: int, fragment: int, spec: SyncSpec) -> bool:
    """Does `fragment` synchronise after inner step n (1-based)?"""
    offset = fragment_offset(fragment, spec.inner_steps, spec.fragments)
    return n > offset and (n - offset) % spec.inner_steps == 0
