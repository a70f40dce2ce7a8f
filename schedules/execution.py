"""The executor model: what running `schedule.order` under pipeplan's runtime semantics means.

Each rank runs its list strictly in order. An action whose input comes from
another rank posts a blocking receive first; an action whose output another
rank needs posts a non-blocking send after it. Each ordered rank pair is a FIFO
channel: the k-th receive matches the k-th send. Same-rank hand-overs are in
memory. `analyze` proves a schedule runs under these rules and returns a
dependency-respecting global order (which the simulator times), or raises a
ScheduleError naming the rank, the action and the dependency that fails.

Positions are encoded as one int, rank * stride + index, so every pass is a
flat loop (linear in the number of actions). The structure, resolve and channel
checks run first as one bulk pass over flat integer columns (`_bulk`, numpy);
only when it declines do the per-action passes run, to name the first fault.
The deadlock walk is sequential by nature and always runs.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import Optional

import numpy as np

from .errors import ScheduleError
from .ir import CACHE_ATTR, B, BW, F, W, Action, Schedule

_OP_CODE = {F: 0, B: 1, W: 2, BW: 3}
NONE = -1


@dataclass(frozen=True)
class Execution:
    """Per action (encoded position): the producer of its input and its same-rank prerequisite."""

    schedule: Schedule
    stride: int  # position = rank * stride + index
    producer: tuple[list[int], ...]  # per rank, per index: encoded producer position or NONE
    topo: list[int]  # every position once, each after its producer and its rank predecessor

    def pos(self, code: int) -> tuple[int, int]:
        return divmod(code, self.stride)

    def action(self, code: int):
        r, i = divmod(code, self.stride)
        return self.schedule.order[r][i]


def analyze(schedule: Schedule, in_order: bool = True) -> Execution:
    """Prove the schedule runs; the proof is kept on the (immutable) schedule object.

    in_order=False models tag-matched receives (torch.distributed.pipelining's runtime): the
    rank-pair FIFO check is skipped, everything else (each op once, dependencies, no deadlock)
    holds. pipeplan's runtime is in-order; the tagged model only times other runtimes' orders.
    """
    attr = CACHE_ATTR if in_order else CACHE_ATTR + "_tagged"
    ex = schedule.__dict__.get(attr)
    if ex is None:
        ex = _analyze(schedule, in_order)
        object.__setattr__(schedule, attr, ex)
    return ex


def _fail(msg: str):
    raise ScheduleError(msg)


def _analyze(schedule: Schedule, in_order: bool = True) -> Execution:
    _check_shape(schedule)
    stride = max(len(o) for o in schedule.order) + 1
    producer = _bulk(schedule, stride, in_order)
    if producer is None:  # some check fails: the per-action passes name the first fault
        producer = _resolve(schedule, _check_structure(schedule, stride), stride)
        if in_order:
            _check_channels(schedule, producer, stride)
    topo = _walk(schedule, producer, stride)
    return Execution(schedule, stride, producer, topo)


def _check_shape(schedule: Schedule) -> None:
    p, S, m = schedule.ranks, schedule.stages, schedule.microbatches
    for name, value in (("ranks", p), ("stages", S), ("microbatches", m)):
        if type(value) is not int or value < 1:
            _fail(f"{name} must be an integer >= 1, got {value!r}")
    if len(schedule.stage_to_rank) != S:
        _fail(f"stage_to_rank has {len(schedule.stage_to_rank)} entries for {S} stages")
    for s, r in enumerate(schedule.stage_to_rank):
        if type(r) is not int or not 0 <= r < p:
            _fail(f"stage {s} is placed on rank {r!r}, outside 0..{p - 1}")
    if len(schedule.order) != p:
        _fail(f"order has {len(schedule.order)} action lists for {p} ranks")


def _bulk(schedule: Schedule, stride: int, in_order: bool) -> Optional[tuple[list[int], ...]]:
    """The producers, if the structure, resolve and channel passes would all pass; else None.

    The same checks as those passes, column-wise over flat integer arrays (numpy) instead
    of per action; never raises. A valid schedule is proved here; an invalid one is handed
    to the per-action passes, which find its first fault in rank order and name it."""
    S, m, p, order = schedule.stages, schedule.microbatches, schedule.ranks, schedule.order
    sm = S * m
    lengths = [len(o) for o in order]
    n_total = sum(lengths)
    actions = tuple(chain.from_iterable(order))
    if not actions or set(map(type, actions)) != {Action}:
        return None
    ops, stages, mbs = zip(*actions)
    if not set(ops) <= _OP_CODE.keys() or set(map(type, stages)) != {int} or set(map(type, mbs)) != {int}:
        return None
    try:
        st, mb = np.fromiter(stages, np.int64, n_total), np.fromiter(mbs, np.int64, n_total)
    except (OverflowError, ValueError):
        return None
    rank = np.repeat(np.arange(p, dtype=np.int64), lengths)
    if st.min() < 0 or st.max() >= S or mb.min() < 0 or mb.max() >= m \
            or (np.array(schedule.stage_to_rank, np.int64)[st] != rank).any():
        return None
    codes = (np.fromiter(map(_OP_CODE.__getitem__, ops), np.int64, n_total) * S + st) * m + mb
    starts = np.cumsum([0] + lengths)
    pos = np.arange(n_total, dtype=np.int64) + np.repeat(np.arange(p, dtype=np.int64) * stride - starts[:-1], lengths)
    # structure: each op once; every F; per (stage, mb) either BW or both B and W
    where = np.full(4 * sm, NONE, np.int64)
    where[codes] = pos
    has = (where != NONE).reshape(4, sm)
    if int(has.sum()) != n_total or not has[0].all() or (has[1] != has[2]).any() \
            or (has[1] & has[3]).any() or not (has[1] | has[3]).all():
        return None
    # resolve: the producer of each input; same-rank prerequisites and inputs come earlier
    op, k = codes // sm, codes % sm
    s = k // m
    prod = np.full(n_total, NONE, np.int64)
    pre = np.full(n_total, NONE, np.int64)
    sel = (op == 0) & (s > 0)
    prod[sel] = where[k[sel] - m]
    sel = op == 2
    pre[sel] = where[sm + k[sel]]
    back = (op == 1) | (op == 3)
    pre[back] = where[k[back]]
    sel = back & (s + 1 < S)
    nxt = k[sel] + m
    prod[sel] = np.where(where[3 * sm + nxt] != NONE, where[3 * sm + nxt], where[sm + nxt])
    if (((pre > pos) & (pre // stride == rank)) | ((prod > pos) & (prod // stride == rank))).any():
        return None
    # channels: on each rank pair, the receiver's receives in the sender's order
    if in_order:
        cross = (prod != NONE) & (prod // stride != rank)
        pair = (prod[cross] // stride) * p + rank[cross]
        by_pair = np.argsort(pair, kind="stable")
        dep, pair = prod[cross][by_pair], pair[by_pair]
        if ((dep[1:] < dep[:-1]) & (pair[1:] == pair[:-1])).any():
            return None
    flat, bounds = prod.tolist(), starts.tolist()
    return tuple(flat[bounds[r]:bounds[r + 1]] for r in range(p))


def _check_structure(schedule: Schedule, stride: int) -> list[int]:
    """Raise naming the first malformed, misplaced, repeated or missing action (rank order)."""
    S, m, s2r = schedule.stages, schedule.microbatches, schedule.stage_to_rank
    where = [NONE] * (4 * S * m)
    for r, actions in enumerate(schedule.order):
        base = r * stride
        for i, a in enumerate(actions):
            try:
                oc, s, mb = _OP_CODE[a.op], a.stage, a.microbatch
            except (AttributeError, KeyError, TypeError):
                _bad_action(schedule, r, i, a)
            if type(s) is not int or type(mb) is not int or not 0 <= s < S or not 0 <= mb < m:
                _bad_action(schedule, r, i, a)
            if s2r[s] != r:
                _fail(f"rank {r}, position {i}: {a.describe()} is on rank {r} but stage {s} "
                      f"is placed on rank {s2r[s]}")
            code = (oc * S + s) * m + mb
            if where[code] != NONE:
                q, j = divmod(where[code], stride)
                _fail(f"rank {r}, position {i}: {a.describe()} appears twice (also rank {q}, position {j})")
            where[code] = base + i
    fb, bb, wb, bwb = 0, S * m, 2 * S * m, 3 * S * m
    for s in range(S):
        r = s2r[s]
        for mb in range(m):
            k = s * m + mb
            has_b, has_w, has_bw = where[bb + k] != NONE, where[wb + k] != NONE, where[bwb + k] != NONE
            if where[fb + k] == NONE:
                _fail(f"rank {r}: F(stage {s}, mb {mb}) is missing")
            if has_bw and (has_b or has_w):
                _fail(f"rank {r}: stage {s} mb {mb} has both BW and a split B/W backward")
            if not has_bw and not (has_b and has_w):
                missing = "W" if has_b else ("B" if has_w else "BW (or B and W)")
                _fail(f"rank {r}: {missing} of stage {s} mb {mb} is missing")
    return where


def _bad_action(schedule: Schedule, r: int, i: int, a) -> None:
    where = f"rank {r}, position {i}"
    op = getattr(a, "op", None)
    if not isinstance(op, str) or op not in _OP_CODE:
        _fail(f"{where}: {a!r} is not an action with op in F, B, W, BW")
    s, mb = getattr(a, "stage", None), getattr(a, "microbatch", None)
    if type(s) is not int or not 0 <= s < schedule.stages:
        _fail(f"{where}: {op}(stage {s!r}) names a stage outside 0..{schedule.stages - 1}")
    _fail(f"{where}: {op}(stage {s}, mb {mb!r}) names a microbatch outside 0..{schedule.microbatches - 1}")


def _resolve(schedule: Schedule, where: list[int], stride: int) -> tuple[list[int], ...]:
    """Producer of each action's input; same-rank inputs and prerequisites must come earlier."""
    S, m = schedule.stages, schedule.microbatches
    sm = S * m
    producer = []
    for r, actions in enumerate(schedule.order):
        row = []
        base = r * stride
        for i, a in enumerate(actions):
            op, s, mb = a.op, a.stage, a.microbatch
            k = s * m + mb
            if op == F:
                prod, pre = (where[k - m] if s > 0 else NONE), NONE
            elif op == W:
                prod, pre = NONE, where[sm + k]
            else:
                prod, pre = NONE, where[k]
                if s + 1 < S:
                    prod = where[3 * sm + k + m]
                    if prod == NONE:
                        prod = where[sm + k + m]
            here = base + i
            for dep, why in ((pre, "needs"), (prod, "consumes the output of")):
                if dep > here and dep // stride == r:
                    _fail(f"rank {r}: {a.describe()} at position {i} {why} "
                          f"{_name(schedule, dep, stride)}, which comes later at position {dep - base}")
            row.append(prod)
        producer.append(row)
    return tuple(producer)


def _name(schedule: Schedule, code: int, stride: int) -> str:
    r, i = divmod(code, stride)
    return schedule.order[r][i].describe()


def _check_channels(schedule: Schedule, producer, stride: int) -> None:
    """On each rank pair, receives must be posted in the order the sender sends (increasing index)."""
    last: dict[tuple[int, int], int] = {}
    for r, row in enumerate(producer):
        for dep in row:
            if dep != NONE:
                q = dep // stride
                if q != r:
                    if dep < last.get((q, r), -1):
                        _channel_error(schedule, producer, stride, q, r)
                    last[(q, r)] = dep


def _channel_error(schedule: Schedule, producer, stride: int, src: int, dst: int) -> None:
    received = [d for d in producer[dst] if d != NONE and d // stride == src]
    sent = sorted(received)
    k = next(k for k, (a, b) in enumerate(zip(sent, received)) if a != b)
    _fail(f"channel rank {src} -> rank {dst} out of order: message {k} sent is the output of "
          f"{_name(schedule, sent[k], stride)} but rank {dst}'s receive {k} waits for the output of "
          f"{_name(schedule, received[k], stride)} (sends on a rank pair must follow the receiver's order)")


def _walk(schedule: Schedule, producer, stride: int) -> list[int]:
    """Run every rank's list under blocking receives; raise on deadlock. Linear time.

    An action (q, j) is done exactly when rank q's pointer has passed j (done[q * stride + j]).
    """
    p = schedule.ranks
    lengths = [len(o) for o in schedule.order]
    ptr = [0] * p
    done = bytearray(p * stride)
    waiter = [NONE] * (p * stride)  # the rank blocked on this position's output
    topo: list[int] = []
    stack = list(range(p - 1, -1, -1))
    while stack:
        r = stack.pop()
        row, n, base = producer[r], lengths[r], r * stride
        i = ptr[r]
        while i < n:
            dep = row[i]
            if dep != NONE and not done[dep]:
                waiter[dep] = r
                break
            code = base + i
            done[code] = 1
            topo.append(code)
            if waiter[code] != NONE:
                stack.append(waiter[code])
            i += 1
        ptr[r] = i
    if len(topo) != sum(lengths):
        _fail(_deadlock_message(schedule, producer, stride, ptr, lengths))
    return topo


def _deadlock_message(schedule: Schedule, producer, stride: int, ptr, lengths) -> str:
    """Follow the wait-for chain from the first blocked rank until it repeats."""
    r = next(r for r in range(schedule.ranks) if ptr[r] < lengths[r])
    seen, chain = set(), []
    while r not in seen:
        seen.add(r)
        dep = producer[r][ptr[r]]
        q = dep // stride
        chain.append(f"rank {r} blocks at {schedule.order[r][ptr[r]].describe()} waiting for "
                     f"{_name(schedule, dep, stride)} on rank {q}")
        r = q
    return "deadlock: " + "; ".join(chain) + " (circular wait)"
