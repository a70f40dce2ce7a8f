"""Make a reference order consistent with pipeplan's FIFO rank-pair channels.

Some published orders (DualPipeV) post receives ahead of time and match them by
tag, so run as-is under blocking in-order receives they would take a message
meant for a later action. `follow_fifo` keeps each rank's reference order but,
when the message at the head of the channel an action waits on belongs to a
later action of the same rank, runs that later action first (if its own
same-rank prerequisite is done). Ranks otherwise wait; the result is verified
by the caller.
"""
from __future__ import annotations

from collections import deque

from .errors import ScheduleError
from .ir import B, BW, F, W, Action, Schedule


def follow_fifo(schedule: Schedule) -> Schedule:
    p, S = schedule.ranks, schedule.stages
    s2r = schedule.stage_to_rank
    backward = {(a.stage, a.microbatch): a.op for row in schedule.order for a in row if a.op in (B, BW)}

    def source(a: Action):
        """(producing rank, message key) of the input a receives from another rank, or None."""
        if a.op == F and a.stage > 0 and s2r[a.stage - 1] != s2r[a.stage]:
            return s2r[a.stage - 1], ("act", a.stage - 1, a.microbatch)
        if a.op in (B, BW) and a.stage + 1 < S and s2r[a.stage + 1] != s2r[a.stage]:
            return s2r[a.stage + 1], ("grad", a.stage + 1, a.microbatch)
        return None

    def local_ready(a: Action, done: set) -> bool:
        if a.op == F:
            return a.stage == 0 or s2r[a.stage - 1] != s2r[a.stage] or (F, a.stage - 1, a.microbatch) in done
        if a.op == W:
            return (B, a.stage, a.microbatch) in done
        if (F, a.stage, a.microbatch) not in done:
            return False
        nxt = a.stage + 1
        return nxt == S or s2r[nxt] != s2r[a.stage] or (backward.get((nxt, a.microbatch)), nxt, a.microbatch) in done

    consumer = {}  # message key -> the action that receives it
    for row in schedule.order:
        for a in row:
            src = source(a)
            if src:
                consumer[src[1]] = a
    channels: dict[tuple[int, int], deque] = {}
    rows = [list(row) for row in schedule.order]
    head = [0] * p  # rows[r][:head[r]] are all run; later ones may have run early (in `done`)
    out: list[list[Action]] = [[] for _ in range(p)]
    done: set = set()
    stack = list(range(p - 1, -1, -1))  # ranks that may make progress (a message arrived)
    queued = [True] * p
    while stack:
        r = stack.pop()
        queued[r] = False
        row = rows[r]
        while True:
            while head[r] < len(row) and (row[head[r]].op, row[head[r]].stage, row[head[r]].microbatch) in done:
                head[r] += 1
            if head[r] == len(row):
                break
            a = row[head[r]]
            src = source(a)
            run = None
            if src is None:
                run = a if local_ready(a, done) else None
            else:
                q = channels.get((src[0], r))
                if q:
                    want = consumer[q[0]]
                    if want == a or local_ready(want, done):  # want is r's and not yet run
                        run = want
                        q.popleft()
            if run is None:
                break
            out[r].append(run)
            done.add((run.op, run.stage, run.microbatch))
            for dst in _send(run, s2r, S, channels):
                if not queued[dst]:
                    queued[dst] = True
                    stack.append(dst)
    if sum(map(len, out)) != sum(map(len, rows)):
        raise ScheduleError(f"{schedule.name}: the order cannot be made consistent with in-order channels")
    return Schedule(schedule.name, p, S, schedule.microbatches, s2r, tuple(tuple(o) for o in out))


def _send(a: Action, s2r, S: int, channels) -> tuple[int, ...]:
    """Post a's output on its channel, if another rank consumes it; returns that rank."""
    if a.op == F and a.stage + 1 < S and s2r[a.stage + 1] != s2r[a.stage]:
        channels.setdefault((s2r[a.stage], s2r[a.stage + 1]), deque()).append(("act", a.stage, a.microbatch))
        return (s2r[a.stage + 1],)
    if a.op in (B, BW) and a.stage > 0 and s2r[a.stage - 1] != s2r[a.stage]:
        channels.setdefault((s2r[a.stage], s2r[a.stage - 1]), deque()).append(("grad", a.stage, a.microbatch))
        return (s2r[a.stage - 1],)
    return ()


def early_forwards(schedule: Schedule) -> Schedule:
    """follow_fifo's result for V orders whose only conflict is the first gradient, in one pass.

    On a V, the channel rank r-1 -> rank r carries chunk-0 activations and chunk-1 gradients.
    Rank r's first chunk-1 backward can only be received after every chunk-0 activation rank
    r-1 sent before it; so rank r runs that many chunk-0 forwards before it, the missing ones
    taken (in order) from later in its list. Ranks are repaired from 0 upwards (rank r-1's
    count is taken on its repaired list). Callers check the result equals what follow_fifo
    gives (tests) and verify it; this is the linear-time path for large p and m.
    """
    p, S = schedule.ranks, schedule.stages
    rows, sent = [], 0
    for r, row in enumerate(schedule.order):
        first = next((i for i, a in enumerate(row) if a.op != F and a.op != W and a.stage == S - 1 - r), len(row))
        head = list(row[:first])
        have = sum(1 for a in head if a.op == F and a.stage == r)
        need = sent - have if r else 0
        moved, rest = [], []
        for a in row[first:]:
            if need > 0 and a.op == F and a.stage == r:
                moved.append(a)
                need -= 1
            else:
                rest.append(a)
        new = head + moved + rest
        rows.append(tuple(new))
        sent = have + len(moved)
    return Schedule(schedule.name, p, S, schedule.microbatches, schedule.stage_to_rank, tuple(rows))


def delay_senders(schedule: Schedule) -> Schedule:
    """The other repair: keep every receiver's order and reorder the senders instead.

    On each rank pair whose receiver takes messages in another order than they are sent, the
    sender runs the forward it sent too early just after the action the receiver wants first
    (or, when that early message is a gradient, runs the wanted backward before it). A forward
    run later holds its activations for less time, so no rank's peak memory grows (unlike
    follow_fifo, which makes the receiver run forwards early). One fix per rank per round;
    raises ScheduleError when the rounds run out (the caller skips the candidate).
    """
    S, s2r = schedule.stages, schedule.stage_to_rank
    rows = [list(row) for row in schedule.order]
    for _ in range(4 * sum(map(len, rows)) // max(1, schedule.ranks) + 8):
        where = {a: (r, i) for r, row in enumerate(rows) for i, a in enumerate(row)}
        backward = {(a.stage, a.microbatch): a for a in where if a.op in (B, BW)}
        received: dict[tuple[int, int], list[int]] = {}  # (sender, receiver) -> send positions, receive order
        for r, row in enumerate(rows):
            for a in row:
                if a.op == F and a.stage > 0 and s2r[a.stage - 1] != r:
                    src = where[Action(F, a.stage - 1, a.microbatch)]
                elif a.op in (B, BW) and a.stage + 1 < S and s2r[a.stage + 1] != r:
                    src = where[backward[(a.stage + 1, a.microbatch)]]
                else:
                    continue
                received.setdefault((src[0], r), []).append(src[1])
        fixes: dict[int, tuple[int, int]] = {}
        for (q, _), got in received.items():
            early = next(((x, y) for x, y in zip(sorted(got), got) if x != y), None)
            if early is not None and q not in fixes:
                fixes[q] = early
        if not fixes:
            return Schedule(schedule.name, schedule.ranks, S, schedule.microbatches, s2r,
                            tuple(tuple(row) for row in rows))
        for q, (sent, wanted) in fixes.items():
            row = rows[q]
            if row[sent].op == F:
                row.insert(wanted, row.pop(sent))  # the early forward runs right after the wanted send
            else:
                row.insert(sent, row.pop(wanted))  # the wanted backward runs before the early one
    raise ScheduleError(f"{schedule.name}: the senders could not be put in their receivers' order")
