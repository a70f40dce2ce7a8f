"""The schedule engine: one IR that is exactly what runs, generators, a verifier and a simulator.

    from pipeplan.schedules import generate, verify, simulate
    s = generate("zbv", ranks=4, microbatches=8)
    r = simulate(s)            # r.bubble is whole-iteration idle/total
"""
from .costs import Costs, parse_costs
from .errors import ScheduleError
from .fifo_repair import follow_fifo
from .generate import KINDS, generate
from .ir import OPS, Action, Schedule, loop_placement, v_placement
from .memory import peak_per_rank
from .render import ascii_timeline, chrome_trace, metrics_table, svg_gantt
from .serialize import (schedule_from_csv, schedule_from_dict, schedule_from_json, schedule_to_csv, schedule_to_dict, schedule_to_json)
from .simulate import Idle, SimResult, simulate
from .verify import verify

__all__ = [
    "Action", "Schedule", "Costs", "ScheduleError", "generate", "verify", "simulate", "KINDS", "OPS",
    "SimResult", "Idle", "parse_costs", "loop_placement", "v_placement", "peak_per_rank",
    "schedule_to_json", "schedule_from_json", "schedule_to_dict", "schedule_from_dict",
    "schedule_to_csv", "schedule_from_csv", "follow_fifo",
    "metrics_table", "ascii_timeline", "chrome_trace", "svg_gantt",
]
