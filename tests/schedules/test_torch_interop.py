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

from pipeplan.schedules import (Costs, ScheduleError, follow_fifo, generate, schedule_from_csv, schedule_to_csv, simulate, verify)

P, M = 4, 8


class StandInStage(_PipelineStageBase):
    def __init__(self, index, num_stages, ranks=None):
        self.stage_index, self.num_stages, self.group_size, self.group_rank = index, num_stages, ranks or P, 0
        self.submod = torch.nn.Identity()

    def _create_grad_recv_info(self, *a, **k):
        return None

    _prepare_backward_infra = _prepare_forward_infra = _create_grad_recv_info


def torch_csv(cls, p: int = P, m: int = M) -> str:
    """torch's own pipeline_order for p ranks and m microbatches, in its CSV spelling."""
    if issubclass(cls, ts.PipelineScheduleSingle):
        schedule = cls(StandInStage(0, p, p), m)
    elif cls in (ts.ScheduleZBVZeroBubble, ts.ScheduleDualPipeV):
        schedule = cls([StandInStage(0, 2 * p, p), StandInStage(2 * p - 1, 2 * p, p)], m)
    else:
        schedule = cls([StandInStage(0, 2 * p, p), StandInStage(p, 2 * p, p)], m)
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


@pytest.mark.parametrize("p,m", [(2, 4), (3, 6), (4, 8), (4, 16), (6, 12), (8, 32), (8, 10)])
def test_zbv_is_torchs_zbv_order_made_in_order(p, m):
    """pipeplan's zbv is torch's ScheduleZBVZeroBubble order, action for action, once its receives
    are put in channel order; at equal costs both take (p-1)F/2 idle per rank (m >= 2p)."""
    theirs = schedule_from_csv(torch_csv(ts.ScheduleZBVZeroBubble, p, m))
    ours = generate("zbv", p, m)
    assert ours.order == follow_fifo(theirs).order
    tagged = simulate(theirs, in_order=False)  # as torch runs it: receives matched by tag
    assert max(tagged.peak_activations) == p
    if m >= 2 * p:
        assert simulate(ours).makespan == pytest.approx(tagged.makespan) == pytest.approx(3 * m + (p - 1) / 2)


def test_tagged_simulation_reproduces_torch_zbv_under_costs():
    """torch's ZBV is not cost-adaptive: with B=1.5, W=0.5 it idles 0.111 of p=4, m=8 (the issue's table)."""
    theirs = schedule_from_csv(torch_csv(ts.ScheduleZBVZeroBubble))
    assert simulate(theirs, Costs(1, 1.5, 0.5), in_order=False).bubble == pytest.approx(1 - 24 / 27)
