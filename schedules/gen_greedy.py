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
that continue it can always run; W/BW release it stage by stage. A looser gate
(reserve_whole=False) only keeps room for one more stage, warming up more
microbatches at the risk of a Stall.
"""
from __future__ import annotations

import heapq
import random
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
    w_fits_gap: bool = False  # an idle-filling W only if it ends before the next message arrives
    forward_first: bool = False  # a ready forward (within memory) before a ready backward
    reserve_whole: bool = True  # an entering microbatch reserves its whole share (never stalls);
    # False: it needs room for itself and one more stage only, so more microbatches warm up
    # (may Stall; callers skip such policies)
    jitter: float = 0.0  # chance, per decision, of taking a random ready kind (F, B or W) instead
    seed: int = 0  # of the jitter's random choices (a policy is a pure function of its fields)


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
    next_f = [0] * p
    next_b = [0] * p
    orders: list[list[Action]] = [[] for _ in range(p)]
    free_at = [0.0] * p
    total = S * m * (3 if policy.split else 2)
    count = 0
    rng = random.Random(policy.seed) if policy.jitter > 0 else None

    def f_key(s, mb):
        entering = s == first_stage[placement[s]]
        return (entering, mb, -s)

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
        if policy.reserve_whole:
            return s != first_stage[r] or reserved[r] + 1.0 <= policy.limits[r] + EPS
        room = min(1.0, 2 * share[s]) if s == first_stage[r] else share[s]
        return held[r] + room <= policy.limits[r] + EPS

    def best_backward(r, heads):
        """The B/BW to run next on rank r: its fixed sequence's next, else oldest microbatch, deepest stage."""
        if policy.bwd_seq is not None:
            seq = policy.bwd_seq[r]
            if next_b[r] >= len(seq):
                return None
            want = seq[next_b[r]]
            if want in local_b[r].live:
                return want, None
            return next(((want, h) for h in heads if h[1] == B and (h[2], h[3]) == want), None)
        best = None
        lb = local_b[r].top()
        if lb is not None:
            best = (b_key(*lb), lb, None)
        for h in heads:
            if h[1] == B and (best is None or b_key(h[2], h[3]) < best[0]):
                best = (b_key(h[2], h[3]), (h[2], h[3]), h)
        return best[1:] if best else None

    def best_forward(r, heads):
        """The F to run next on rank r, if its activations fit the memory gate."""
        if policy.fwd_seq is not None:
            seq = policy.fwd_seq[r]
            if next_f[r] >= len(seq):
                return None
            want = seq[next_f[r]]
            if held[r] + share[want[0]] > policy.limits[r] + EPS:
                return None
            if want in local_f[r].live:
                return want, None
            return next(((want, h) for h in heads if h[1] == F and (h[2], h[3]) == want), None)
        best = None
        lf = local_f[r].top()
        if lf is not None and admissible(r, lf[0]):
            best = (f_key(*lf), lf, None)
        for h in heads:
            if h[1] == F and admissible(r, h[2]) and (best is None or f_key(h[2], h[3]) < best[0]):
                best = (f_key(h[2], h[3]), (h[2], h[3]), h)
        return best[1:] if best else None

    def deferred_w(r, t):
        """The oldest pending W, unless policy holds it back for a message arriving sooner."""
        w = pending_w[r][0]
        if policy.w_fits_gap:
            upcoming = [dq[0][0] for dq in inbox[r] if dq and dq[0][0] > t + EPS]
            if upcoming and t + table.time(W, w[0]) > min(upcoming) + EPS:
                return "wait", min(upcoming), None
        return W, w, None

    def pick(r, t):
        """Choose the next action for rank r at time t, None to wait for a message, or ("wait", until)."""
        heads = [dq[0] for dq in inbox[r] if dq and dq[0][0] <= t + EPS]
        bwd = best_backward(r, heads)
        fwd = best_forward(r, heads)
        if rng is not None and rng.random() < policy.jitter:
            ready = [c for c in ((bwd_op, bwd), (F, fwd), (W, (pending_w[r][0], None) if pending_w[r] else None))
                     if c[1] is not None]
            if ready:
                op, (item, head) = rng.choice(ready)
                return op, item, head
        if fwd is not None and policy.forward_first:
            return F, fwd[0], fwd[1]
        if bwd is not None:
            return bwd_op, bwd[0], bwd[1]
        if policy.eager_w and pending_w[r]:
            return W, pending_w[r][0], None
        if fwd is not None:
            return F, fwd[0], fwd[1]
        if pending_w[r]:
            return deferred_w(r, t)
        return None

    events: list[tuple[float, int]] = [(0.0, r) for r in range(p)]
    heapq.heapify(events)
    while events:
        t, r = heapq.heappop(events)
        if t < free_at[r] - EPS:
            continue
        t = max(t, free_at[r])
        choice = pick(r, t)
        if choice is None:  # woken again by the next message sent to this rank
            continue
        if choice[0] == "wait":  # hold the W back until the expected message arrives
            heapq.heappush(events, (choice[1], r))
            continue
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
            held[r] += share[s]
            next_f[r] += 1
            if s == S - 1:
                local_b[r].add(b_key(s, mb), (s, mb))
            else:
                wake = deliver(s, s + 1, F, mb, end)
        elif op in (B, BW):
            next_b[r] += 1
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
    if count != total:
        raise Stall(f"{name}: the greedy policy stalled after {count} of {total} actions")
    return Schedule(name, p, S, m, placement, tuple(tuple(o) for o in orders))
