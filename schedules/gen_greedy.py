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
from functools import partial
from typing import Optional

from .costs import StageCosts
from .greedy_period import PeriodFinder, Skip, exact_times
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


def _located(key: int, backward: bool, live: set, heads: list, te: float) -> tuple[int, Optional[deque]]:
    """A fixed sequence's next action: (key, None) if its input is on the rank, (key, channel)
    if it heads a channel and has arrived by te, else (-1, None)."""
    if key in live:
        return key, None
    code = key if backward else -1 - key
    for dq in heads:
        if dq and dq[0][1] == code and dq[0][0] <= te:
            return key, dq
    return -1, None


def list_schedule(name: str, placement: tuple[int, ...], microbatches: int, table: StageCosts,
                  policy: Policy) -> Schedule:
    """Run the greedy timed simulation; return the per-rank orders it produced (raises Stall)."""
    return timed_run(name, placement, microbatches, table, policy).schedule()


@dataclass(frozen=True)
class TimedRun:
    """One list-scheduling run: its orders as (op, stage, microbatch) rows, and its makespan.

    Without w_fits_gap every action starts as soon as its rank is free and its input has
    arrived, so the makespan is simulate(schedule, costs).makespan (tested): callers that
    compare policies time each run by it and build Actions for the one they keep only.
    `simulated` holds the rows the run stepped through; `skip`, the periods it skipped
    (greedy_period), copied back in by `rows`."""

    name: str
    placement: tuple[int, ...]
    microbatches: int
    simulated: tuple[list[tuple[str, int, int]], ...]
    makespan: float
    skip: Optional[Skip] = None

    @property
    def rows(self) -> tuple[list[tuple[str, int, int]], ...]:
        if self.skip is None:
            return self.simulated
        return tuple(self.skip.rows(row, r) for r, row in enumerate(self.simulated))

    def schedule(self) -> Schedule:
        p, S = max(self.placement) + 1, len(self.placement)
        action = partial(tuple.__new__, Action)  # Action._make without its Python frame (rows are triples)
        return Schedule(self.name, p, S, self.microbatches, self.placement,
                        tuple(tuple(map(action, row)) for row in self.rows))


def timed_run(name: str, placement: tuple[int, ...], microbatches: int, table: StageCosts,
              policy: Policy, give_up_at: Optional[float] = None,
              skip_periods: bool = True) -> Optional[TimedRun]:
    """The list scheduler's run (raises Stall). With give_up_at: None as soon as the makespan is
    sure to reach it (some rank's end plus its remaining work reaches give_up_at + 1e-6, a
    margin for rounding), else the whole run.

    The inner loop is one flat event loop over integers: a stage-microbatch is encoded
    as a key whose integer order is the policy's priority order (backward: oldest
    microbatch, then deepest stage; forward: continuing before entering, then the same),
    ready actions on a rank sit in a lazily-deleted heap of keys, and channel messages
    carry their key (>= 0 for a gradient, -1 - key for an activation). Once the whole state
    recurs (shifted in time and microbatches), greedy_period copies the repeated period
    instead of stepping through it: same rows, a quarter of the work at p=64, m=1024.
    skip_periods=False steps through every action (tests compare the two).
    """
    p = max(placement) + 1
    S, m, lat = len(placement), microbatches, table.latency
    mine = [[s for s in range(S) if placement[s] == r] for r in range(p)]
    share = [1.0 / len(mine[placement[s]]) for s in range(S)]
    first_stage = [min(st) for st in mine]
    split = policy.split
    bwd_op = B if split else BW
    dur_f = [table.time(F, s) for s in range(S)]
    dur_b = [table.time(bwd_op, s) for s in range(S)]
    dur_w = [table.time(W, s) for s in range(S)] if split else None
    limit = [x + EPS for x in policy.limits]
    whole = policy.reserve_whole
    room = [min(1.0, 2 * share[s]) if s == first_stage[placement[s]] else share[s] for s in range(S)]
    mS = m * S
    # key(s, mb) = mb * S + (S - 1 - s); a forward adds m*S when it enters its rank
    enter_off = [mS if s == first_stage[placement[s]] else 0 for s in range(S)]

    heap_f: list[list[int]] = [[] for _ in range(p)]
    heap_b: list[list[int]] = [[] for _ in range(p)]
    live_f: list[set] = [set() for _ in range(p)]
    live_b: list[set] = [set() for _ in range(p)]
    channels: dict[tuple[int, int], deque] = {}
    inbox: list[list[deque]] = [[] for _ in range(p)]
    for s in range(S - 1):
        for a, b in ((placement[s], placement[s + 1]), (placement[s + 1], placement[s])):
            if a != b and (a, b) not in channels:
                channels[(a, b)] = dq = deque()
                inbox[b].append(dq)
    # the channel from stage s's rank to the rank of stage s+1 (activations) and s-1 (gradients)
    ch_up = [channels.get((placement[s], placement[s + 1])) if s + 1 < S else None for s in range(S)]
    ch_down = [channels.get((placement[s], placement[s - 1])) if s > 0 else None for s in range(S)]
    pending_w = [deque() for _ in range(p)]
    reserved = [0.0] * p
    held = [0.0] * p
    next_f = [0] * p
    next_b = [0] * p
    rows: list[list[tuple[str, int, int]]] = [[] for _ in range(p)]
    # work each rank has left (for give_up_at), and the margin that keeps give-ups exact
    left = [m * sum(dur_f[s] + dur_b[s] + (dur_w[s] if split else 0.0) for s in st) for st in mine]
    give_up = None if give_up_at is None else give_up_at + 1e-6
    free_at = [0.0] * p
    total = S * m * (3 if split else 2)
    count = 0
    jitter = policy.jitter
    rng = random.Random(policy.seed) if jitter > 0 else None
    fwd_seq = None if policy.fwd_seq is None else [
        [mb * S + S - 1 - s + enter_off[s] for s, mb in seq] for seq in policy.fwd_seq]
    bwd_seq = None if policy.bwd_seq is None else [[mb * S + S - 1 - s for s, mb in seq] for seq in policy.bwd_seq]
    eager_w, forward_first, w_fits_gap = policy.eager_w, policy.forward_first, policy.w_fits_gap
    heappush, heappop = heapq.heappush, heapq.heappop

    r0 = placement[0]
    for mb in range(m):
        k = mb * S + S - 1 + enter_off[0]
        live_f[r0].add(k)
        heappush(heap_f[r0], k)

    events: list[tuple[float, int]] = [(0.0, r) for r in range(p)]
    heapq.heapify(events)
    skip = None
    finder = None  # skips repeated periods once the state recurs (greedy_period), when exact
    durations = dur_f + dur_b + (dur_w or [])
    if skip_periods and rng is None and fwd_seq is None and bwd_seq is None and \
            exact_times(durations, lat, 2 * (m * sum(durations) + total * lat)):
        finder = PeriodFinder(S, m, events, free_at, held, reserved, live_f, heap_f, live_b, heap_b,
                              list(channels.values()), pending_w, rows, left)
    while events:
        t, r = heappop(events)
        fr = free_at[r]
        if t < fr - EPS:
            continue
        if fr > t:
            t = fr
        te, lim, heads = t + EPS, limit[r], inbox[r]  # a channel's head is ready once it arrived

        # the B/BW to run next: its fixed sequence's next, else oldest microbatch, deepest stage
        bkey, bdq = -1, None
        if bwd_seq is not None:
            seq = bwd_seq[r]
            if next_b[r] < len(seq):
                bkey, bdq = _located(seq[next_b[r]], True, live_b[r], heads, te)
        else:
            hb, lv = heap_b[r], live_b[r]
            while hb and hb[0] not in lv:
                heappop(hb)
            if hb:
                bkey = hb[0]
            for dq in heads:
                if dq:
                    code = dq[0][1]
                    if code >= 0 and (bkey < 0 or code < bkey) and dq[0][0] <= te:
                        bkey, bdq = code, dq

        # the F to run next, if its activations fit the memory gate
        fkey, fdq = -1, None
        if fwd_seq is not None:
            seq = fwd_seq[r]
            if next_f[r] < len(seq):
                want = seq[next_f[r]]
                if held[r] + share[S - 1 - want % S] <= lim:
                    fkey, fdq = _located(want, False, live_f[r], heads, te)
        else:
            hf, lv = heap_f[r], live_f[r]
            while hf and hf[0] not in lv:
                heappop(hf)
            if hf:
                k = hf[0]
                s = S - 1 - k % S
                if (s != first_stage[r] or reserved[r] + 1.0 <= lim) if whole else held[r] + room[s] <= lim:
                    fkey = k
            for dq in heads:
                if dq:
                    code = dq[0][1]
                    if code < 0 and (fkey < 0 or -1 - code < fkey) and dq[0][0] <= te:
                        k = -1 - code
                        s = S - 1 - k % S
                        if (s != first_stage[r] or reserved[r] + 1.0 <= lim) if whole else held[r] + room[s] <= lim:
                            fkey, fdq = k, dq

        # the decision: backward first (forward first if asked), then W, F or wait
        op = None
        if rng is not None and rng.random() < jitter:
            choices = [c for c in ((bwd_op, bkey >= 0), (F, fkey >= 0), (W, bool(pending_w[r]))) if c[1]]
            if choices:
                op = rng.choice(choices)[0]
        if op is None:
            if fkey >= 0 and forward_first:
                op = F
            elif bkey >= 0:
                op = bwd_op
            elif eager_w and pending_w[r]:
                op = W
            elif fkey >= 0:
                op = F
            elif pending_w[r]:
                op = W
                if w_fits_gap:  # hold the W back for a message arriving before it would end
                    s = pending_w[r][0][0]
                    upcoming = [dq[0][0] for dq in inbox[r] if dq and dq[0][0] > te]
                    if upcoming and t + dur_w[s] > min(upcoming) + EPS:
                        heappush(events, (min(upcoming), r))
                        continue
            else:
                continue  # woken again by the next message sent to this rank

        wake = None
        if op == F:
            k = fkey % mS
            s, mb = S - 1 - k % S, k // S
            if fdq is not None:
                fdq.popleft()
            else:
                live_f[r].discard(fkey)
            end = t + dur_f[s]
            if s == first_stage[r]:
                reserved[r] += 1.0
            held[r] += share[s]
            next_f[r] += 1
            if s == S - 1:
                live_b[r].add(mb * S)
                heappush(heap_b[r], mb * S)
            else:
                dq = ch_up[s]
                if dq is None:
                    k = mb * S + S - 2 - s + enter_off[s + 1]
                    live_f[r].add(k)
                    heappush(heap_f[r], k)
                else:
                    dq.append((end + lat, -1 - (mb * S + S - 2 - s + enter_off[s + 1]), F, s + 1, mb))
                    wake = placement[s + 1], end + lat
        elif op == W:
            s, mb = pending_w[r].popleft()
            end = t + dur_w[s]
            held[r] -= share[s]
            reserved[r] -= share[s]
        else:
            s, mb = S - 1 - bkey % S, bkey // S
            if bdq is not None:
                bdq.popleft()
            else:
                live_b[r].discard(bkey)
            end = t + dur_b[s]
            next_b[r] += 1
            if split:
                pending_w[r].append((s, mb))
            else:
                held[r] -= share[s]
                reserved[r] -= share[s]
            if s > 0:
                dq = ch_down[s]
                if dq is None:
                    k = mb * S + S - s
                    live_b[r].add(k)
                    heappush(heap_b[r], k)
                else:
                    dq.append((end + lat, mb * S + S - s, B, s - 1, mb))
                    wake = placement[s - 1], end + lat
        rows[r].append((op, s, mb))
        count += 1
        free_at[r] = end
        if give_up is not None:
            left[r] -= end - t
            if end + left[r] >= give_up:
                return None
        heappush(events, (end, r))
        if wake is not None:
            q, arrive = wake
            if free_at[q] < arrive or arrive <= t or rng is not None:
                heappush(events, (max(arrive, free_at[q]), q))
            # else q's own end event (free_at[q], q), still queued, wakes it then; a second,
            # identical event would only repeat that decision (or draw the jitter twice)
        if finder is not None and op == F and s == 0:
            count += finder.observe(t, mb, count)
            if finder.done:
                skip, finder = finder.skip, None
    if count != total:
        raise Stall(f"{name}: the greedy policy stalled after {count} of {total} actions")
    return TimedRun(name, placement, m, tuple(rows), max(free_at, default=0.0), skip)
