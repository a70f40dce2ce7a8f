"""The list scheduler (gen_greedy.list_schedule) yields exactly the orders of its original
implementation, kept verbatim below as the reference (it shares no code with the fast path:
tuple-keyed heaps, closures, one call per decision), for zbh2, vhalf, vmin, interleaved and
the policies `auto` uses, at unit and non-uniform costs; and its timed makespan is
simulate()'s."""
import heapq
import random
from collections import deque

import pytest

from pipeplan.schedules import Costs, gen_classic, generate, simulate
from pipeplan.schedules.gen_greedy import EPS, Policy, Stall, list_schedule, timed_run
from pipeplan.schedules.gen_zero_bubble import vhalf_limit, vmin_limit, zbh2_limit
from pipeplan.schedules.ir import B, BW, F, W, Action, Schedule, loop_placement, v_placement




COSTS = [Costs(), Costs(1, 1.5, 0.5, latency=0.05), Costs(1, 2, 1, latency=0.1),
         "stages"]  # "stages": first and last stage 2x, the rest a ragged mix


def table_for(costs, placement):
    if costs == "stages":
        n = len(placement)
        per = [(1.0 + 0.25 * (s % 3), 1.5 - 0.125 * (s % 4), 0.5 + 0.1 * (s % 2)) for s in range(n)]
        per[0] = per[-1] = (2.0, 2.0, 2.0)
        costs = Costs(per_stage=tuple(per))
    return costs.stage_table(placement)


def same(name, placement, m, table, policy):
    """Both implementations stall together or give the same orders, action for action."""
    try:
        want = reference_list_schedule(name, placement, m, table, policy)
    except Stall:
        with pytest.raises(Stall):
            list_schedule(name, placement, m, table, policy)
        return None
    run = timed_run(name, placement, m, table, policy)
    got, makespan = run.schedule(), run.makespan
    assert got.order == want.order and got.stage_to_rank == want.stage_to_rank
    if not policy.w_fits_gap:  # every action as soon as possible: the run's makespan is simulate's
        assert makespan == pytest.approx(simulate(got, Costs(per_stage=table.table, latency=table.latency)).makespan,
                                         abs=1e-9)
    return got


KINDS = {"zbh2": (lambda p: loop_placement(p, 1), zbh2_limit),
         "vhalf": (v_placement, vhalf_limit), "vmin": (v_placement, vmin_limit)}


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("costs", range(len(COSTS)))
def test_fixed_kinds_match_reference(kind, costs):
    place, limit = KINDS[kind]
    checked = 0
    for p in range(1, 11):
        placement = place(p)
        for m in sorted({1, 3, p, 2 * p + 1, 4 * p}):
            table = table_for(COSTS[costs], placement)
            for forward_first in (False, True):
                policy = Policy(split=True, limits=(limit(p),) * p, forward_first=forward_first)
                checked += same(kind, placement, m, table, policy) is not None
    assert checked > 50


def test_generated_kinds_are_the_reference_pick():
    """generate() keeps the shorter of the two policies (now timed by the list scheduler itself)."""
    for kind, (place, limit) in KINDS.items():
        for p, m in ((3, 7), (4, 8), (6, 13), (8, 32)):
            placement = place(p)
            table = Costs().stage_table(placement)
            best = None
            for forward_first in (False, True):
                policy = Policy(split=True, limits=(limit(p),) * p, forward_first=forward_first)
                try:
                    s = reference_list_schedule(kind, placement, m, table, policy)
                except Stall:
                    continue
                if best is None or simulate(s).makespan < best[0] - 1e-9:
                    best = (simulate(s).makespan, s)
            assert generate(kind, p, m).order == best[1].order



def test_give_up_only_when_the_run_cannot_end_sooner():
    """timed_run(give_up_at=T) is None only if the whole run ends at T or later; else the same run."""
    for kind, (place, limit) in KINDS.items():
        for p, m in ((3, 7), (4, 8), (8, 32)):
            placement = place(p)
            table = Costs().stage_table(placement)
            for forward_first in (False, True):
                policy = Policy(split=True, limits=(limit(p),) * p, forward_first=forward_first)
                full = timed_run(kind, placement, m, table, policy)
                for give_up_at in (full.makespan - 1.0, full.makespan, full.makespan + 0.5):
                    run = timed_run(kind, placement, m, table, policy, give_up_at=give_up_at)
                    if run is None:
                        assert full.makespan >= give_up_at
                    else:
                        assert run == full
                assert timed_run(kind, placement, m, table, policy, give_up_at=full.makespan - 1.0) is None
                assert timed_run(kind, placement, m, table, policy, give_up_at=full.makespan + 0.5) == full

def test_interleaved_matches_reference(monkeypatch):
    sizes = ((2, 4, 2), (4, 8, 2), (4, 12, 3), (3, 7, 2), (8, 16, 2))
    fast = [gen_classic.interleaved(p, m, v).order for p, m, v in sizes]
    monkeypatch.setattr(gen_classic, "list_schedule", reference_list_schedule)
    assert fast == [gen_classic.interleaved(p, m, v).order for p, m, v in sizes]


@pytest.mark.parametrize("costs", range(len(COSTS)))
def test_auto_policies_match_reference(costs):
    """Every option `auto` sets: BW, eager W, W only in gaps, loose reserve, jitter, fixed sequences."""
    for p, m in ((2, 5), (4, 8), (5, 11)):
        for placement in (loop_placement(p, 1), loop_placement(p, 2), v_placement(p)):
            table = table_for(COSTS[costs], placement)
            for lim in (1.0, float(p), 2.0 * p):
                policies = [Policy(split=split, limits=(lim,) * p, eager_w=eager, w_fits_gap=fits,
                                   forward_first=ff, reserve_whole=whole)
                            for split in (True, False) for eager in (False, True) for fits in (False, True)
                            for ff in (False, True) for whole in (True, False)]
                policies += [Policy(split=True, limits=(lim,) * p, reserve_whole=whole, jitter=j, seed=seed)
                             for whole in (True, False) for j in (0.1, 0.5) for seed in range(3)]
                for policy in policies:
                    same("auto", placement, m, table, policy)


def test_fixed_sequences_match_reference():
    """fwd_seq / bwd_seq: each rank's forwards and backwards in a given order (a 1F1B's here)."""
    for p, m in ((2, 4), (4, 8), (3, 9)):
        for placement in (loop_placement(p, 1), v_placement(p)):
            base = reference_list_schedule("x", placement, m, Costs().stage_table(placement),
                                           Policy(split=True, limits=(float(p),) * p))
            fwd = tuple(tuple((a.stage, a.microbatch) for a in o if a.op == F) for o in base.order)
            bwd = tuple(tuple((a.stage, a.microbatch) for a in o if a.op == B) for o in base.order)
            for costs in range(len(COSTS)):
                table = table_for(COSTS[costs], placement)
                for lim in (1.0, float(p)):
                    for policy in (Policy(split=True, limits=(lim,) * p, fwd_seq=fwd, bwd_seq=bwd),
                                   Policy(split=True, limits=(lim,) * p, fwd_seq=fwd),
                                   Policy(split=True, limits=(lim,) * p, bwd_seq=bwd, eager_w=True)):
                        same("seq", placement, m, table, policy)


# ---- the original implementation, verbatim (the reference) ----

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


def reference_list_schedule(name, placement, microbatches, table, policy):
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
        raise Stall("reference stalled")
    return Schedule(name, p, S, m, placement, tuple(tuple(o) for o in orders))
