"""The list scheduler behind the zero-bubble family and `auto`: simulate time, pick greedily.

Each rank, whenever it is free, picks one action among those whose inputs have
arrived, by a policy: a backward (B or BW) first, because it is on the critical
path; else a forward, if the activation memory it would hold fits the rank's
limit; else a deferred weight-gradient W (zero-bubble family), which fills gaps
and frees memory; else it waits for the next message. Because the order comes
from a feasible timed run, it cannot deadlock; receives are taken only from the
head of each rank-pair channel, so channel FIFO order holds by construction.

Memory gate: a microbatch entering a rank (the F of its first stage there)
reserves the microbatch's whole share on that rank (1 unit), so the forwards
that continue it can always run; W/BW release it stage by stage.
"""
from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass
from typing import Optional

from .costs import StageCosts
from .ir import B, BW, F, W, Action, Schedule

EPS = 1e-9


class Stall(Exception):
    """The policy left every rank waiting for something no rank will produce."""


@dataclass(frozen=True)
class Policy:
    split: bool  # B and W as separate actions (zero-bubble family) or BW
    limits: tuple[float, ...]  # activation-memory limit per rank, in microbatch units
    eager_w: bool = False  # W right after its B (before forwards) instead of deferred
    fwd_seq: Optional[tuple[tuple[tuple[int, int], ...], ...]] = None  # fixed (stage, mb) order per rank
    bwd_seq: Optional[tuple[tuple[tuple[int, int], ...], ...]] = None
    shallow_first: bool = False  # among forwards, lower stage first (breadth) instead of deeper
    open_limits: Optional[tuple[int, ...]] = None  # per rank: microbatches entered but not yet B'd


class _Local:
    """Actions whose input is on this rank already, in priority order (lazy-deleted heap)."""

    def __init__(self):
        self.heap: list = []
        self.live: set = set()

    def add(self, key, item):
        self.live.add(item)
        heapq.heappush(self.heap, (key, item))

    def top(self):
        while self.heap and self.heap[0][1] not in self.live:
            heapq.heappop(self.heap)
        return self.heap[0][1] if self.heap else None

    def remove(self, item):
        self.live.discard(item)


def list_schedule(name: str, placement: tuple[int, ...], microbatches: int, table: StageCosts,
                  policy: Policy) -> Schedule:
    """Run the greedy timed simulation; return the per-rank orders it produced (raises Stall)."""
    p = max(placement) + 1
    S, m, lat = len(placement), microbatches, table.latency
    mine = [[s for s in range(S) if placement[s] == r] for r in range(p)]
    share = [1.0 / len(mine[placement[s]]) for s in range(S)]
    first_stage = [min(st) for st in mine]
    bwd_op = B if policy.split else BW

    local_f = [_Local() for _ in range(p)]
    local_b = [_Local() for _ in range(p)]
    channels: dict[tuple[int, int], deque] = {}
    inbox = [[] for _ in range(p)]  # channel deques feeding each rank
    for s in range(S - 1):
        for a, b in ((placement[s], placement[s + 1]), (placement[s + 1], placement[s])):
            if a != b and (a, b) not in channels:
                channels[(a, b)] = dq = deque()
                inbox[b].append(dq)
    pending_w = [deque() for _ in range(p)]
    reserved = [0.0] * p
    held = [0.0] * p
    opened = [0] * p
    next_f = [0] * p
    next_b = [0] * p
    orders: list[list[Action]] = [[] for _ in range(p)]
    free_at = [0.0] * p
    total = S * m * (3 if policy.split else 2)
    count = 0

    def f_key(s, mb):
        entering = s == first_stage[placement[s]]
        return (entering, mb, s if policy.shallow_first else -s)

    def b_key(s, mb):
        return (mb, -s)

    for mb in range(m):
        local_f[placement[0]].add(f_key(0, mb), (0, mb))

    def deliver(src_stage, dst_stage, kind, mb, t_done):
        """Hand the output of one action to the stage that consumes it."""
        r_src, r_dst = placement[src_stage], placement[dst_stage]
        if r_src == r_dst:
            if kind == F:
                local_f[r_dst].add(f_key(dst_stage, mb), (dst_stage, mb))
            else:
                local_b[r_dst].add(b_key(dst_stage, mb), (dst_stage, mb))
            return None
        arrive = t_done + lat
        channels[(r_src, r_dst)].append((arrive, kind, dst_stage, mb))
        return r_dst, arrive

    def admissible(r, s):
        if s == first_stage[r]:
            if policy.open_limits is not None and opened[r] >= policy.open_limits[r]:
                return False
            return reserved[r] + 1.0 <= policy.limits[r] + EPS
        return True

    def pick(r, t):
        """Choose the next action for rank r at time t, or None to wait."""
        heads = [dq[0] for dq in inbox[r] if dq and dq[0][0] <= t + EPS]
        seq_f = policy.fwd_seq[r] if policy.fwd_seq else None
        seq_b = policy.bwd_seq[r] if policy.bwd_seq else None
        # backward candidates
        best_b = None
        lb = local_b[r].top()
        if lb is not None:
            best_b = (b_key(*lb), lb, None)
        for h in heads:
            if h[1] == B:
                k = b_key(h[2], h[3])
                if best_b is None or k < best_b[0]:
                    best_b = (k, (h[2], h[3]), h)
        if seq_b is not None:
            best_b = None
            if next_b[r] < len(seq_b):
                want = seq_b[next_b[r]]
                if want in local_b[r].live:
                    best_b = (None, want, None)
                else:
                    for h in heads:
                        if h[1] == B and (h[2], h[3]) == want:
                            best_b = (None, want, h)
        if best_b is not None:
            return bwd_op, best_b[1], best_b[2]
        if policy.eager_w and pending_w[r]:
            return W, pending_w[r][0], None
        # forward candidates
        best_f = None
        if seq_f is not None:
            if next_f[r] < len(seq_f):
                want = seq_f[next_f[r]]
                if held[r] + share[want[0]] <= policy.limits[r] + EPS:
                    if want in local_f[r].live:
                        best_f = (None, want, None)
                    else:
                        for h in heads:
                            if h[1] == F and (h[2], h[3]) == want:
                                best_f = (None, want, h)
        else:
            lf = local_f[r].top()
            if lf is not None and admissible(r, lf[0]):
                best_f = (f_key(*lf), lf, None)
            for h in heads:
                if h[1] == F and admissible(r, h[2]):
                    k = f_key(h[2], h[3])
                    if best_f is None or k < best_f[0]:
                        best_f = (k, (h[2], h[3]), h)
        if best_f is not None:
            return F, best_f[1], best_f[2]
        if pending_w[r]:
            return W, pending_w[r][0], None
        return None

    events: list[tuple[float, int]] = [(0.0, r) for r in range(p)]
    heapq.heapify(events)
    waiting = [False] * p
    while events:
        t, r = heapq.heappop(events)
        if t < free_at[r] - EPS:
            continue
        t = max(t, free_at[r])
        choice = pick(r, t)
        if choice is None:
            waiting[r] = True
            continue
        waiting[r] = False
        op, (s, mb), head = choice
        if head is not None:
            for dq in inbox[r]:
                if dq and dq[0] is head:
                    dq.popleft()
                    break
        elif op == F:
            local_f[r].remove((s, mb))
        elif op in (B, BW):
            local_b[r].remove((s, mb))
        end = t + table.time(op, s)
        orders[r].append(Action(op, s, mb))
        count += 1
        free_at[r] = end
        heapq.heappush(events, (end, r))
        wake = None
        if op == F:
            if s == first_stage[r]:
                reserved[r] += 1.0
                opened[r] += 1
            held[r] += share[s]
            next_f[r] += 1
            if s == S - 1:
                local_b[r].add(b_key(s, mb), (s, mb))
            else:
                wake = deliver(s, s + 1, F, mb, end)
        elif op in (B, BW):
            next_b[r] += 1
            if s == first_stage[r]:
                opened[r] -= 1
            if op == B:
                pending_w[r].append((s, mb))
            else:
                held[r] -= share[s]
                reserved[r] -= share[s]
            if s > 0:
                wake = deliver(s, s - 1, B, mb, end)
        else:
            pending_w[r].popleft()
            held[r] -= share[s]
            reserved[r] -= share[s]
        if wake is not None:
            heapq.heappush(events, (max(wake[1], free_at[wake[0]]), wake[0]))
        # a rank that waited may now have memory freed or local work; same-rank cases are covered
        # by its own end event, other ranks only by messages (pushed above).
    if count != total:
        raise Stall(f"{name}: the greedy policy stalled after {count} of {total} actions")
    return Schedule(name, p, S, m, placement, tuple(tuple(o) for o in orders))
