"""A lower bound on the makespan of any schedule of one placement, costs and memory limit.

`makespan_bound(placement, m, table, limit)` is the larger of
  * the chain of one microbatch: every F, every B, then W of stage 0, with
    latency on each rank change (no schedule can finish a microbatch sooner), and
  * for each rank r:  work_r + front_idle_r + tail_idle_r.

Proof of the per-rank part. Let T be the makespan of any schedule with this
placement whose held activations never exceed `limit` on any rank (memory.py's
accounting: F adds 1/n on a rank with n stages, W or BW frees it). Rank r is
busy exactly work_r (BW costs B+W, so split or not does not matter) inside
[0, T], so T = work_r + its idle time in [0, T]. Two disjoint windows give idle:

Front window [0, t1], t1 = the earliest a backward (B or BW) of any stage on r
can start (the chain F(0..S-1), B(S-1..s+1) with latency). Before t1 rank r runs
only forwards, so
  (a) no W/BW has finished, nothing is freed, so at most N = floor(limit * n)
      forwards start before t1, and the work in [0, t1] is at most the N
      costliest forwards of r (at most m per stage);
  (b) forwards arrive at a bounded rate: the k-th F of stage s to start (in time
      order) starts no earlier than e[s][k] = max(e[s][k-1] + F_s,
      e[s-1][k] + F_{s-1} + c_{s-1,s}), e[0][k] = k F_0, because F(s) ops run one
      at a time on one rank and the k-th F(s) needs k+1 microbatches through
      F(s-1) (induction on s). A single machine with these release times
      processes by t1 at most what the work-conserving order does (any other
      order idles at least as long), so the idle in [0, t1] is at least that
      order's idle.
  front_idle = max(t1 - capped work, idle of the work-conserving order by t1).

Tail window [T - tau, T], tau = min over r's backward stages s of d_s, the time
that must follow the input-gradient part of backward(s): d_0 = W_0 (stage 0's
own weight gradient after its B, or BW's W part), d_s = c_{s,s-1} + B_{s-1} +
d_{s-1}. Each backward's B part ends by T - tau, so only weight-gradient work
(W ops or the W part of a running BW) falls in the window. At T - tau every F of
r is done, so the activations still held, at most `limit`, bound the pending
weight gradients to N ops: work there is at most the N costliest W of r, and
  tail_idle = max(0, tau - that work).
The windows are disjoint: t1 <= start of r's first backward < end of its last
B part <= T - tau.

And the memory's lanes: a microbatch's activations of stage s are held from the start
of its F(s) to the end of its W(s) (or BW), at least occ_s = the chain F(s..S-1),
B(S-1..s), W(s) with latency. At any instant the rank holds what it held right after
the last F it started (what freed since only lowers it), at most N stage-microbatches,
so the m x n holding intervals, all inside [t0, T] (t0: the earliest any F of r can
start), pack into N lanes: T >= t0 + m x sum(occ_s) / N. With a small limit this is the
whole story (limit 1 on a loop: every microbatch waits for the one before to come back).

With no limit, N covers every op and only the rate, latency and lane terms remain.
The bound is placement-specific: auto takes the minimum over the placements it
searches for a bound on every schedule it could return.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np

from .costs import StageCosts

EPS = 1e-9


def makespan_bound(placement: Sequence[int], microbatches: int, table: StageCosts,
                   memory_limit: Optional[float] = None) -> float:
    S, m = len(placement), microbatches
    f = [row[0] for row in table.table]
    b = [row[1] for row in table.table]
    w = [row[2] for row in table.table]

    def lat(s1: int, s2: int) -> float:
        return table.latency if placement[s1] != placement[s2] else 0.0

    head_f = [0.0] * S
    for s in range(1, S):
        head_f[s] = head_f[s - 1] + f[s - 1] + lat(s - 1, s)
    head_b = [0.0] * S
    head_b[S - 1] = head_f[S - 1] + f[S - 1]
    for s in range(S - 2, -1, -1):
        head_b[s] = head_b[s + 1] + b[s + 1] + lat(s + 1, s)
    chain = head_b[0] + b[0] + w[0]

    after_b = [w[0]] * S  # d_s: time that must follow the B part of backward(s)
    for s in range(1, S):
        after_b[s] = lat(s, s - 1) + b[s - 1] + after_b[s - 1]

    release = _forward_releases(f, lat, S, m)
    best = chain
    stages_of: dict[int, list[int]] = {}
    for s, r in enumerate(placement):  # linear in stages (a file may name thousands of ranks)
        stages_of.setdefault(r, []).append(s)
    for mine in stages_of.values():
        n = len(mine)
        work = m * sum(f[s] + b[s] + w[s] for s in mine)
        cap = m * n if memory_limit is None else min(m * n, math.floor(memory_limit * n + EPS))
        t1 = min(head_b[s] for s in mine)
        capped_f = _costliest([f[s] for s in mine], m, cap)
        # the forwards released before t1 (the rest never count), in release order
        greedy_idle = _work_conserving_idle(sorted(
            (rel, f[s]) for s in mine
            for rel in release[s][:int(np.searchsorted(release[s], t1))].tolist()), t1)
        front = max(t1 - capped_f, greedy_idle, 0.0)
        tau = min(after_b[s] for s in mine)
        tail = max(0.0, tau - _costliest([w[s] for s in mine], m, cap))
        occupied = sum(head_b[s] - head_f[s] + b[s] + w[s] for s in mine)
        lanes = min(head_f[s] for s in mine) + m * occupied / cap if cap > 0 else 0.0
        best = max(best, work + front + tail, lanes)
    return best


def _forward_releases(f, lat, S: int, m: int) -> list[np.ndarray]:
    """e[s][k]: earliest start of the k-th F of stage s to start (see the module proof, (b)).

    The recurrence e[s][k] = max(e[s][k-1] + F_s, e[s-1][k] + F_{s-1} + c) unrolls to
    k F_s + max over j <= k of (e[s-1][j] + F_{s-1} + c - j F_s): a running maximum (numpy's,
    elementwise in the same order of float operations as the loop it replaces)."""
    k = np.arange(m, dtype=np.float64)
    e = [k * f[0]]
    for s in range(1, S):
        a, fs = f[s - 1] + lat(s - 1, s), f[s]
        e.append(k * fs + np.maximum.accumulate(e[-1] + a - k * fs))
    return e  # each row nondecreasing (a running maximum plus k F_s)


def _costliest(costs: list[float], per_stage: int, count: int) -> float:
    """Total of the `count` costliest ops when each stage has `per_stage` ops of its cost."""
    total = 0.0
    for c in sorted(costs, reverse=True):
        take = min(per_stage, count)
        total += take * c
        count -= take
        if count <= 0:
            break
    return total


def _work_conserving_idle(jobs: list[tuple[float, float]], until: float) -> float:
    """Idle time in [0, until] of one machine running (release, length) jobs whenever one is released."""
    idle, t = 0.0, 0.0
    for rel, length in jobs:
        if rel >= until:
            break
        if rel > t:
            idle += rel - t
            t = rel
        t += length
        if t >= until:
            return idle
    return idle + max(0.0, until - t)
