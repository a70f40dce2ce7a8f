"""Local search over per-rank orders, guided by the critical path (auto's last phase).

The schedule is re-encoded as one int per action with flat arrays (duration, producer,
channel, memory delta), so one evaluation (validity + timing) is a few linear passes.

A move takes an action X on the critical path that started as soon as its rank was free
(its input had arrived earlier: the rank, not the data, held it back) and runs it up to
MAX_SHIFT positions earlier on its rank; only such moves can shorten that path. A move is
kept when the order stays valid (same-rank prerequisites first, each rank pair's messages
received in the order sent, no deadlock, activations within the limit until W frees them)
and (makespan, sum of rank finish times) does not grow, so the walk crosses plateaus.
Moves are drawn from seeded generators and capped by evaluations: the result is a pure
function of the inputs. Several walks share the budget by successive halving (search()). A
move that move_valid accepts is evaluated by timing alone. It stops at `target` (a lower
bound: nothing shorter exists).
"""
from __future__ import annotations

import random
from bisect import bisect_left
from typing import Optional

from .costs import Costs
from .ir import B, BW, F, W, Action, Schedule
from .memory import stage_share

MAX_SHIFT = 8
EPS = 1e-9


class _Problem:
    """Flat arrays over action ids for one placement, microbatch count and cost table."""

    def __init__(self, schedule: Schedule, costs: Costs):
        self.schedule = schedule
        table = costs.stage_table(schedule.stage_to_rank)
        s2r, S = schedule.stage_to_rank, schedule.stages
        share = stage_share(schedule)
        self.actions: list[Action] = [a for row in schedule.order for a in row]
        ident = {(a.op, a.stage, a.microbatch): k for k, a in enumerate(self.actions)}
        n = len(self.actions)
        self.dur = [table.time(a.op, a.stage) for a in self.actions]
        self.mem = [share[a.stage] if a.op == F else (-share[a.stage] if a.op in (W, BW) else 0.0)
                    for a in self.actions]
        self.rank = [s2r[a.stage] for a in self.actions]
        self.prod = [-1] * n  # the action whose output this one consumes
        self.lat = [0.0] * n
        self.chan = [-1] * n  # channel id (src rank * p + dst rank) of a cross-rank input
        self.pre = [()] * n  # same-rank actions that must come earlier (inputs and prerequisites)
        p = schedule.ranks
        for k, a in enumerate(self.actions):
            s, mb, r = a.stage, a.microbatch, self.rank[k]
            need = []
            if a.op == F:
                src = ident.get((F, s - 1, mb)) if s > 0 else None
            elif a.op == W:
                src, need = None, [ident[(B, s, mb)]]
            else:
                need = [ident[(F, s, mb)]]
                src = None
                if s + 1 < S:
                    src = ident.get((B, s + 1, mb), ident.get((BW, s + 1, mb)))
            if src is not None:
                self.prod[k] = src
                if self.rank[src] != r:
                    self.lat[k] = table.latency
                    self.chan[k] = self.rank[src] * p + r
                else:
                    need.append(src)
            self.pre[k] = tuple(need)
        self.out = [-1] * n  # channel id the action's output is sent on, -1 when consumed locally
        self.dependents = [[] for _ in range(n)]  # same-rank actions listing this one in `pre`
        for k in range(n):
            if self.chan[k] >= 0:
                self.out[self.prod[k]] = self.chan[k]
            for q in self.pre[k]:
                self.dependents[q].append(k)

    def move_valid(self, row: list[int], i: int, j: int, limit: Optional[float]) -> bool:
        """Would running row[i] at position j keep this rank's prerequisites, channel order and
        memory valid? (Only this rank changes; a deadlock shows up in the timing.)"""
        k = row[i]
        passed = row[j:i] if j < i else row[i + 1:j + 1]
        blocked = set(self.pre[k]) if j < i else set(self.dependents[k])
        chan, out = self.chan[k], self.out[k]
        for x in passed:
            if x in blocked or (chan >= 0 and self.chan[x] == chan) or (out >= 0 and self.out[x] == out):
                return False
        if limit is None or self.mem[k] == 0.0:
            return True
        moved = row[:]
        moved.insert(j, moved.pop(i))
        held, mem = 0.0, self.mem
        for x in moved:
            held += mem[x]
            if held > limit + EPS:
                return False
        return True

    def encode(self, schedule: Schedule) -> list[list[int]]:
        ident = {a: k for k, a in enumerate(self.actions)}
        return [[ident[a] for a in row] for row in schedule.order]

    def decode(self, rows: list[list[int]], name: str) -> Schedule:
        s = self.schedule
        return Schedule(name, s.ranks, s.stages, s.microbatches, s.stage_to_rank,
                        tuple(tuple(self.actions[k] for k in row) for row in rows))

    def evaluate(self, rows, limit: Optional[float], soft: bool = False, checked: bool = False,
                 since=None):
        """(makespan, sum of finish times), start and end per action id; None when the order is invalid.

        soft: memory above the limit is not refused but counted, the key becomes (excess, makespan, sum)
        (a start holding too much is walked down to the limit first). checked: the order is a
        valid one with one move that move_valid accepted, so only the timing (and its deadlock
        check) is left; the peaks are then not recomputed (None). since: (rank, the moved
        positions' first and last, the order's timing before the move): the timing resumes
        there (_time)."""
        if checked:
            timed = self._time(rows, since)
            return None if timed is None else (((0.0,) if soft else ()) + timed[0], timed[1], timed[2], None)
        n = len(self.dur)
        index = [0] * n
        for row in rows:
            for i, k in enumerate(row):
                index[k] = i
        pre, prod, chan, mem = self.pre, self.prod, self.chan, self.mem
        last_sent: dict[int, int] = {}
        excess = 0.0
        peaks = []  # (peak, position) per rank
        for row in rows:
            held, peak, at = 0.0, 0.0, -1
            for i, k in enumerate(row):
                for q in pre[k]:
                    if index[q] > i:
                        return None
                c = chan[k]
                if c >= 0:
                    sent = index[prod[k]]
                    if sent < last_sent.get(c, -1):
                        return None
                    last_sent[c] = sent
                held += mem[k]
                if held > peak + EPS:
                    peak, at = held, i
            if limit is not None and peak > limit + EPS:
                if not soft:
                    return None
                excess += peak - limit
            peaks.append((peak, at))
        timed = self._time(rows)
        if timed is None:
            return None
        key = ((round(excess, 9),) if soft else ()) + timed[0]
        return key, timed[1], timed[2], peaks

    def _time(self, rows, since=None):
        """Each rank runs its row in order, an action starting when its rank is free and its
        input has arrived. since = (rank r, positions i..j, start, end): rows differ from a
        timed order only on rank r at positions i..j; every action that started before the first
        of those did (t0) keeps its times -- its rank predecessor and producer ended before
        t0, so by induction none of them moved -- and the walk resumes from there. The result
        is the same floats a full pass gives (the same operations on the same values)."""
        n, p = len(self.dur), len(rows)
        prod, lat, dur = self.prod, self.lat, self.dur
        ptr = [0] * p
        free = [0.0] * p
        if since is None:
            end = [-1.0] * n
            start = [0.0] * n
        else:
            r0, i0, i1, start0, end0 = since
            t0 = min(start0[k] for k in rows[r0][i0:i1 + 1])
            start, end = start0[:], end0[:]
            for r, row in enumerate(rows):
                i = bisect_left(row, t0, hi=i0 if r == r0 else len(row), key=start0.__getitem__)
                ptr[r] = i
                if i:
                    free[r] = end0[row[i - 1]]
                for k in row[i:]:
                    end[k] = -1.0
        waiter = [-1] * n  # the rank blocked on this action's output
        stack = list(range(p - 1, -1, -1))
        while stack:
            r = stack.pop()
            row, i, t_free = rows[r], ptr[r], free[r]
            size = len(row)
            while i < size:
                k = row[i]
                q = prod[k]
                t = t_free
                if q >= 0:
                    e = end[q]
                    if e < 0:
                        waiter[q] = r
                        break
                    e += lat[k]
                    if e > t:
                        t = e
                start[k] = t
                t_free = end[k] = t + dur[k]
                if waiter[k] >= 0:
                    stack.append(waiter[k])
                i += 1
            ptr[r], free[r] = i, t_free
        if sum(ptr) != n:
            return None  # deadlock
        return (round(max(free), 9), round(sum(free), 9)), start, end

    def slack_moves(self, rows, start, end) -> list[tuple[int, int]]:
        """(rank, position) of critical-path actions held back by their rank, not their input."""
        index = [0] * len(self.dur)
        for row in rows:
            for j, k in enumerate(row):
                index[k] = j
        r = max((q for q in range(len(rows)) if rows[q]), key=lambda q: end[rows[q][-1]])
        i = len(rows[r]) - 1
        out = []
        while i >= 0:
            k = rows[r][i]
            q = self.prod[k]
            if q >= 0 and end[q] + self.lat[k] >= start[k] - EPS:  # its input set its start
                r, i = self.rank[q], index[q]
            elif i > 0 and end[rows[r][i - 1]] >= start[k] - EPS:  # its rank was busy
                out.append((r, i))
                i -= 1
            else:
                break
        return out


WALKS = 8  # independent walks (seeds); successive halving keeps the better half each round


def search(schedule: Schedule, costs: Costs, limit: Optional[float], evaluations: int,
           target: float = 0.0, seed: int = 0, walks: int = WALKS) -> Schedule:
    """The best order found from `schedule` within `evaluations` evaluated moves.

    `walks` seeded walks start from `schedule`; in rounds, each walk still running gets an
    equal share of the round's evaluations and then the worse half stops (successive halving),
    so the budget goes to the walks that are getting somewhere, not to one seed's luck. Each
    round has the same budget (the evaluations split over log2(walks) + 1 rounds).

    A start above the memory limit is walked down first: the key is (activations above the
    limit, makespan, sum of finish times), so memory moves (a forward before a rank's peak run
    later, a W after it run earlier) win until the excess is 0. Returns `schedule` itself when
    nothing valid and shorter was found."""
    prob = _Problem(schedule, costs)
    first = _Walk(prob, prob.encode(schedule), limit, seed * 1_000_003)
    if first.key is None:
        return schedule
    initial = first.key
    alive = [first] + [_Walk(prob, prob.encode(schedule), limit, seed * 1_000_003 + k)
                       for k in range(1, max(1, walks))]
    rounds = max(1, len(alive).bit_length())
    for _ in range(rounds):
        share = evaluations // rounds // len(alive)
        for walk in alive:
            walk.run(share, target)
        alive.sort(key=lambda w: (w.best_key, w.seed))
        if alive[0].done(target):
            break
        alive = alive[:max(1, len(alive) // 2)]
    best = alive[0]
    if best.best_key[0] > EPS or best.best_key >= initial:
        return schedule
    return prob.decode(best.best_rows, schedule.name)


class _Walk:
    """One seeded walk: its current order and key, and the best it has seen."""

    def __init__(self, prob: _Problem, rows, limit: Optional[float], seed: int):
        self.prob, self.rows, self.limit, self.seed = prob, rows, limit, seed
        self.rng = random.Random(seed)
        found = prob.evaluate(rows, limit, soft=True)
        self.key = None
        if found is not None:
            self.key, self.start, self.end, self.peaks = found
            self.moves = prob.slack_moves(rows, self.start, self.end)
            self.best_key, self.best_rows = self.key, [list(r) for r in rows]

    def done(self, target: float) -> bool:
        return self.best_key[0] <= EPS and self.best_key[1] <= target + EPS

    def run(self, evaluations: int, target: float) -> None:
        prob, rows, limit = self.prob, self.rows, self.limit
        used = 0
        for _ in range(8 * evaluations):  # moves refused by the cheap check cost no evaluation
            if used >= evaluations or self.done(target):
                break
            if self.key[0] > EPS:
                move = _memory_move(prob, rows, self.peaks, limit, self.rng)
            else:
                move = _critical_move(rows, self.moves, self.rng)
            if move is None:
                break
            r, i, j = move
            row = rows[r]
            if self.key[0] <= EPS and not prob.move_valid(row, i, j, limit):
                continue
            row.insert(j, row.pop(i))
            used += 1
            checked = self.key[0] <= EPS
            since = (r, min(i, j), max(i, j), self.start, self.end) if checked else None
            trial = prob.evaluate(rows, limit, soft=True, checked=checked, since=since)
            if trial is not None and trial[0] <= self.key:
                self.key, self.start, self.end = trial[:3]
                if not checked:
                    self.peaks = trial[3]
                self.moves = prob.slack_moves(rows, self.start, self.end)
                if self.key < self.best_key:
                    self.best_key, self.best_rows = self.key, [list(x) for x in rows]
            else:
                row.insert(i, row.pop(j))


def _critical_move(rows, moves, rng):
    """A critical-path action held back by its rank, run up to MAX_SHIFT positions earlier."""
    if not moves:
        return None
    r, i = moves[rng.randrange(len(moves))]
    d = rng.randint(1, min(MAX_SHIFT, i))
    if rng.random() < 0.5:
        return r, i, i - d  # X earlier, past the d actions before it
    return r, i - d, min(len(rows[r]) - 1, i + rng.randint(0, MAX_SHIFT))  # one of them after X


def _memory_move(prob: _Problem, rows, peaks, limit: float, rng):
    """On a rank above the limit: a forward before its peak later, or a W after it earlier."""
    over = [r for r, (peak, _) in enumerate(peaks) if peak > limit + EPS]
    r = over[rng.randrange(len(over))]
    at, row = peaks[r][1], rows[r]
    if rng.random() < 0.5:
        forwards = [i for i in range(max(0, at - 4 * MAX_SHIFT), at + 1) if prob.actions[row[i]].op == F]
        if forwards:
            i = forwards[rng.randrange(len(forwards))]
            return r, i, min(len(row) - 1, at + rng.randint(1, MAX_SHIFT))
    frees = [i for i in range(at + 1, min(len(row), at + 4 * MAX_SHIFT)) if prob.mem[row[i]] < 0]
    if not frees:
        return None
    i = frees[rng.randrange(len(frees))]
    return r, i, max(0, at - rng.randint(0, MAX_SHIFT))
