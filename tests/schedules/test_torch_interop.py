"""torch.distributed.pipelining's schedule classes, exported to CSV, load into pipeplan.

The classes are built with stand-in stages (no process group): their
constructors only read stage_index, num_stages, group_size, group_rank.
"""
import csv
import io

import pytest
import torch
import torch.distributed.pipelining.schedules as ts
from torch.distributed.pipelining.stage import _PipelineStageBase

from pipeplan.schedules import ScheduleError, follow_fifo, schedule_from_csv, schedule_to_csv, simulate, verify

P, M = 4, 8


class StandInStage(_PipelineStageBase):
    def __init__(self, index, num_stages):
        self.stage_index, self.num_stages, self.group_size, self.group_rank = index, num_stages, P, 0
        self.submod = torch.nn.Identity()

    def _create_grad_recv_info(self, *a, **k):
        return None

    _prepare_backward_infra = _prepare_forward_infra = _create_grad_recv_info


def torch_csv(cls) -> str:
    if issubclass(cls, ts.PipelineScheduleSingle):
        schedule = cls(StandInStage(0, P), M)
    elif cls in (ts.ScheduleZBVZeroBubble, ts.ScheduleDualPipeV):
        schedule = cls([StandInStage(0, 2 * P), StandInStage(2 * P - 1, 2 * P)], M)
    else:
        schedule = cls([StandInStage(0, 2 * P), StandInStage(P, 2 * P)], M)
    buf = io.StringIO()
    writer = csv.writer(buf)
    for rank in sorted(schedule.pipeline_order):
        writer.writerow(schedule.pipeline_order[rank])
    return buf.getvalue()


@pytest.mark.parametrize("cls,bubble", [
    (ts.ScheduleGPipe, 3 / 11),
    (ts.ScheduleInterleaved1F1B, 3 / 19),
    (ts.ScheduleLoopedBFS, 3 / 19),
    (ts.ScheduleInterleavedZeroBubble, 1.5 / 25.5),
])
def test_torch_orders_load_verify_and_simulate(cls, bubble):
    s = schedule_from_csv(torch_csv(cls), name=cls.__name__)
    verify(s)
    assert simulate(s).bubble == pytest.approx(bubble)
    assert schedule_from_csv(schedule_to_csv(s)).order == s.order  # and back to torch's format


@pytest.mark.parametrize("cls", [ts.ScheduleZBVZeroBubble, ts.ScheduleDualPipeV])
def test_tag_matched_torch_orders_are_reordered_for_in_order_channels(cls):
    s = schedule_from_csv(torch_csv(cls), name=cls.__name__)
    with pytest.raises(ScheduleError, match="out of order"):
        verify(s)  # as written, rank 1 would take an activation for a gradient
    adapted = follow_fifo(s)
    verify(adapted)
    assert simulate(adapted).bubble == pytest.approx(1.5 / 25.5)
    assert sorted(map(str, sum(adapted.order, ()))) == sorted(map(str, sum(s.order, ())))


def test_torch_1f1b_printed_order_is_caught():
    # torch's Schedule1F1B.pipeline_order lists F1..F8 on the last rank (its executed loop is right).
    with pytest.raises(ScheduleError, match=r"rank 3 action \d+: F\(stage 3, mb 8\) is out of range"):
        schedule_from_csv(torch_csv(ts.Schedule1F1B))
