"""DualPipeV (DeepSeek's DualPipe, V variant): the V placement run as DeepSeek's eight phases.

Rank r holds chunk 0 = stage r and chunk 1 = stage 2p-1-r. DeepSeek overlaps a
forward of one chunk with a backward of the other on one device ("F&B"); the
IR is sequential, so an overlapped pair is written as F then BW. Phases
(rank r, m microbatches): warm-up forwards of chunk 0, F0/F1 pairs, B1-W1-F1
with zero bubble, the main F0 B1 F1 B0 loop, drains of B1 F1 B0 and B1 B0, then
deferred W's. Needs m >= 2p (DeepSeek's own constraint). DeepSeek posts receives
ahead and matches them by tag; under pipeplan's in-order channels an action that
would take another's message is preceded by that action (fifo_repair.early_forwards).
"""
from __future__ import annotations

from collections import deque

from .errors import ScheduleError
from .fifo_repair import early_forwards
from .ir import B, BW, F, W, Action, Schedule, v_placement


def dualpipev(ranks: int, microbatches: int) -> Schedule:
    if microbatches < 2 * ranks:
        raise ScheduleError(f"dualpipev needs microbatches >= 2 x ranks ({2 * ranks}), got {microbatches}")
    reference = Schedule("dualpipev", ranks, 2 * ranks, microbatches, v_placement(ranks),
                         tuple(_rank_order(ranks, r, microbatches) for r in range(ranks)))
    return early_forwards(reference)  # = follow_fifo(reference), in one pass (tested)


def _rank_order(p: int, r: int, m: int) -> tuple[Action, ...]:
    stage = (r, 2 * p - 1 - r)
    f_next, b_next = [0, 0], [0, 0]
    deferred: deque[Action] = deque()
    out: list[Action] = []

    def fwd(c):
        out.append(Action(F, stage[c], f_next[c]))
        f_next[c] += 1

    def bwd(c, zero_bubble=False):
        mb = b_next[c]
        b_next[c] += 1
        if zero_bubble:
            out.append(Action(B, stage[c], mb))
            deferred.append(Action(W, stage[c], mb))
        else:
            out.append(Action(BW, stage[c], mb))

    def weight():
        out.append(deferred.popleft())

    for _ in range((p - r - 1) * 2):  # 1: nF0
        fwd(0)
    for _ in range(r + 1):  # 2: nF0F1
        fwd(0)
        fwd(1)
    for _ in range(p - r - 1):  # 3: nB1W1F1 (zero bubble)
        bwd(1, zero_bubble=True)
        weight()
        fwd(1)
    for _ in range(m - 2 * p + r + 1):  # 4 (main): nF0B1F1B0
        fwd(0)
        bwd(1)
        fwd(1)
        bwd(0)
    for _ in range(p - r - 1):  # 5: nB1F1B0
        bwd(1)
        fwd(1)
        bwd(0)
    steps = r + 1  # 6: nB1B0, the second half with zero bubble
    zero_bubble = False
    for i in range(steps):
        if i == steps // 2 and r % 2 == 1:
            zero_bubble = True
        bwd(1, zero_bubble)
        if i == steps // 2 and r % 2 == 0:
            zero_bubble = True
        bwd(0, zero_bubble)
    for _ in range(p - r - 1):  # 7: nWB0 (zero bubble)
        weight()
        bwd(0, zero_bubble=True)
    while deferred:  # 8: nW
        weight()
    return tuple(out)
