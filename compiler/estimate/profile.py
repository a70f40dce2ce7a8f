"""Cost files: measured per-stage op times (`pipeplan profile`) and how the compiler uses them.

A cost file is JSON written by `pipeplan profile PLAN -o costs.json` (backends/observe/profiling.py):

    {"version": 1, "plan_sha256": ..., "device": "cpu: x86_64, 2 threads, torch 2.13",
     "schedule": "1f1b", "split_points": ["layers.4"], "warmup_steps": 2,
     "measured_steps": [3, 4, 5], "p2p_latency_s": 0.0003,
     "shape": {"sequences_per_microbatch": 2, "seq_len": 64, "precision": "fp32", "tp": 1},
     "stages": [{"index": 0, "F": 0.01, "B": null, "W": null, "BW": 0.02, "samples": 24,
                 "activation_bytes": 32768}, ...],
     "steps": [{"step": 3, "p2p_latency_s": 0.0004,
                "stages": [{"F": [per microbatch], "B": null, "W": null, "BW": [...]}, ...],
                "delays": [{"F": [per microbatch], "B": null, "BW": [...]}, ...]}, ...]}

Seconds per microbatch, means over the measured (post-warm-up) steps of each
action's slot (compute plus the runtime's work around it: posting its sends and
the next receive, its checks; backends/executor.ActionTiming); p2p_latency_s:
the mean wait beyond the producer's slot (backends/observe.measured_latency); B/W are
null when the schedule ran full backwards (BW), BW null when it split them;
activation_bytes: what the stage sends forward per microbatch; cpu: the same slots'
mean CPU seconds on the rank's own thread (on CPU with one thread per rank, the
compute a slot did without the time it waited for a core: what the per-op time
model predicts for a rank alone, tests/benchmarks/bench_cpu_model.py); shape: the
workload the times hold for (a plan with another microbatch size, sequence
length, precision or tp is refused, naming the file).

A plan names one with `pipeline { profile = "costs.json" }` (relative to the plan
file). Then the op times of the split and the schedule come from it, not from
FLOPs over a device model: each profiled stage's measured F, B and W are spread
over the graph nodes it held in proportion to their FLOPs (B: FLOPs plus
recompute), so any other split is costed too — `split = auto(profile)` balances
those times, and `schedule = auto` (and every cost-aware kind) orders ops by
them; the estimates' timeline and predicted bubble are simulated with them.
A stage profiled with full backwards only splits its BW into B and W by the
same FLOP ratio.

`steps` keeps every measured step's own action times (each microbatch's). The
means above order and split; the predicted bubble and step time replay those
steps instead (`replayed`): the schedule is simulated once per measured step with
each action charged what that action took in that step, and the median step is
the prediction; each transfer is charged the delay its input had in that step
(`delays`: from the producer's end to the consumer's start where the consumer
was blocked on it, else 0). Means alone miss what jitter costs a tight
schedule: a late op makes its consumer wait, an early one saves nothing, and a
few transfers stall for milliseconds while most arrive at once (2-rank zbv, 15
steps: 0.049 simulated from means; replayed with each step's op times and its
mean latency 0.085, with each transfer's own delay 0.092; measured 0.094). Replay needs the plan's
split to be the profiled one; otherwise the means are simulated, and the report
says which.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import asdict, dataclass
from typing import Optional, Sequence

import torch.fx as fx

from ...dsl.ast import Plan
from ...errors import PipeplanError
from .costs import Cost

VERSION = 1
OPS = ("F", "B", "W", "BW")


class ProfileError(PipeplanError):
    """A cost file that cannot be used; the message names the file and the reason."""

    def __init__(self, path: str, reason: str):
        super().__init__(f"{path}: {reason} (write a cost file with `pipeplan profile PLAN -o "
                         f"FILE`)")


@dataclass(frozen=True)
class StageProfile:
    index: int
    F: float
    B: Optional[float]
    W: Optional[float]
    BW: Optional[float]
    samples: int
    activation_bytes: int
    cpu: Optional[dict] = None  # op -> mean CPU seconds of its slots (the rank's thread time:
    # on CPU, what it computed without the time it waited for a core); None: not measured


@dataclass(frozen=True)
class StepSample:
    """One measured step: per stage, per op, each microbatch's slot seconds (None: not run)."""

    step: int
    p2p_latency_s: float
    stages: tuple[dict, ...]  # op -> tuple of seconds indexed by microbatch, or None
    delays: tuple[dict, ...] = ()  # the same per consumer: its input's delay; () = latency


@dataclass(frozen=True)
class Profile:
    plan_sha256: str
    device: str
    schedule: str
    split_points: tuple[str, ...]
    stages: tuple[StageProfile, ...]
    p2p_latency_s: float
    warmup_steps: int
    measured_steps: tuple[int, ...]
    shape: dict  # what per-microbatch times depend on (`workload`); a plan must match it
    version: int = VERSION
    steps: tuple[StepSample, ...] = ()  # each measured step's action times (replay)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1) + "\n"

    @staticmethod
    def from_json(text: str, path: str) -> "Profile":
        try:
            d = json.loads(text)
        except ValueError as e:
            raise ProfileError(path, f"not JSON ({e})") from None
        if not isinstance(d, dict):
            raise ProfileError(path, "not a cost file: expected a JSON object")
        if d.get("version") != VERSION:
            raise ProfileError(path, f"cost file version {d.get('version')!r}, this pipeplan "
                               f"reads version {VERSION}")
        try:
            stages = tuple(_stage(s, path) for s in d["stages"])
            profile = Profile(str(d["plan_sha256"]), str(d["device"]), str(d["schedule"]),
                              tuple(str(p) for p in d["split_points"]), stages,
                              _seconds(d["p2p_latency_s"], "p2p_latency_s", path),
                              int(d["warmup_steps"]), tuple(int(s) for s in d["measured_steps"]),
                              dict(d["shape"]),
                              steps=tuple(_step(x, len(stages), path) for x in d.get("steps", ())))
        except KeyError as e:
            raise ProfileError(path, f"missing key {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise ProfileError(path, f"malformed entry ({e})") from None
        if [s.index for s in stages] != list(range(len(stages))) or not stages:
            raise ProfileError(path, "stages must be listed 0, 1, 2, ... once each")
        if len(profile.split_points) != len(stages) - 1:
            raise ProfileError(path, f"{len(stages)} stages need {len(stages) - 1} split points, "
                               f"it lists {len(profile.split_points)}")
        return profile


def _seconds(v, key: str, path: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise ProfileError(path, f"{key} must be a non-negative number of seconds, got {v!r}")
    return float(v)


def _stage(s: dict, path: str) -> StageProfile:
    if not isinstance(s, dict):
        raise ProfileError(path, f"a stage entry must be an object, got {s!r}")
    i = s["index"]
    ops = {op: None if s.get(op) is None else _seconds(s[op], f"stage {i} {op}", path)
           for op in OPS}
    if ops["F"] is None:
        raise ProfileError(path, f"stage {i} has no F time")
    if ops["BW"] is None and (ops["B"] is None or ops["W"] is None):
        raise ProfileError(path, f"stage {i} needs B and W times, or a BW time")
    cpu = s.get("cpu")
    if cpu is not None and not isinstance(cpu, dict):
        raise ProfileError(path, f"stage {i} cpu must be an object of per-op seconds, got {cpu!r}")
    cpu = None if cpu is None else {op: None if cpu.get(op) is None else
                                    _seconds(cpu[op], f"stage {i} cpu {op}", path) for op in OPS}
    return StageProfile(int(i), ops["F"], ops["B"], ops["W"], ops["BW"], int(s["samples"]),
                        int(s["activation_bytes"]), cpu)


def _step(x: dict, stages: int, path: str) -> StepSample:
    if not isinstance(x, dict) or not isinstance(x.get("stages"), list) \
            or len(x["stages"]) != stages:
        raise ProfileError(path, f"a steps entry needs one object per stage ({stages}), got "
                           f"{str(x)[:80]!r}")
    rows = tuple(_times(st, f"step {x.get('step')} stage {i}", path)
                 for i, st in enumerate(x["stages"]))
    for i, row in enumerate(rows):
        if not row["F"]:
            raise ProfileError(path, f"step {x.get('step')} stage {i} has no F times")
    delays = x.get("delays", [])
    if delays and len(delays) != stages:
        raise ProfileError(path, f"step {x.get('step')}: delays need one object per stage")
    return StepSample(int(x["step"]), _seconds(x["p2p_latency_s"], "p2p_latency_s", path),
                      rows, tuple(_times(d, f"step {x.get('step')} stage {i} delay", path)
                                  for i, d in enumerate(delays)))


def _times(st: dict, where: str, path: str) -> dict:
    if not isinstance(st, dict):
        raise ProfileError(path, f"{where}: expected an object of per-op lists, got {st!r}")
    return {op: None if st.get(op) is None else
            tuple(_seconds(t, f"{where} {op}", path) for t in st[op]) for op in OPS}


def workload(plan: Plan) -> dict:
    """What one microbatch's op times depend on besides the split: its size, the precision,
    the tensor-parallel degree (a cost file measured under other values does not apply)."""
    return {"sequences_per_microbatch": plan.microbatch_size, "seq_len": plan.data.seq_len,
            "precision": plan.train.precision, "tp": plan.mesh.tp}


def load_profile(plan: Plan) -> Optional[Profile]:
    """The plan's cost file (`pipeline.profile`), read and checked (also against the plan's
    workload); None when it names none."""
    if not plan.pipeline.profile:
        return None
    path = plan.resolve_path(plan.pipeline.profile, "pipeline.profile")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ProfileError(path, f"cannot read the plan's cost file ({e.strerror or e})") \
            from None
    profile = Profile.from_json(text, path)
    mine = workload(plan)
    differ = [f"{k} {profile.shape.get(k)!r} (the plan: {v!r})" for k, v in mine.items()
              if profile.shape.get(k) != v]
    if differ:
        raise ProfileError(path, "measured under another workload: " + ", ".join(differ)
                           + "; profile this plan again")
    return profile


def node_times(plan: Plan, model, nodes: list[fx.Node], costs: dict[fx.Node, Cost],
               profile: Profile) -> list[tuple[float, float, float]]:
    """(F, B, W) seconds per compute node: each profiled stage's measured times spread over
    the nodes it held, by FLOPs (B by FLOPs + recompute)."""
    from ..partition import first_positions

    starts = [0, *first_positions(plan, model, nodes, profile.split_points,
                                  "pipeline.profile"), len(nodes)]
    out: list[tuple[float, float, float]] = [(0.0, 0.0, 0.0)] * len(nodes)
    for st, a, b in zip(profile.stages, starts, starts[1:]):
        fl = [costs[n].flops if n in costs else 0.0 for n in nodes[a:b]]
        bw = [f + (costs[n].recompute_flops if n in costs else 0.0)
              for f, n in zip(fl, nodes[a:b])]
        f_sum, b_sum = sum(fl), sum(bw)
        if st.B is not None and st.W is not None:
            t_b, t_w = st.B, st.W
        else:  # full backwards only: split by the FLOP ratio (B: input grads + recompute)
            t_b = st.BW * b_sum / (b_sum + f_sum) if b_sum + f_sum > 0 else st.BW / 2
            t_w = st.BW - t_b
        share = lambda xs, s, k: xs[k] / s if s > 0 else 1.0 / max(1, b - a)  # noqa: E731
        for k in range(b - a):
            out[a + k] = (st.F * share(fl, f_sum, k), t_b * share(bw, b_sum, k),
                          t_w * share(fl, f_sum, k))
    return out


def profiled_costs(split, times: list[tuple[float, float, float]], stages: int,
                   latency: float):
    """The schedule engine's Costs (seconds) of `split` under per-node measured times."""
    from ...schedules.costs import Costs

    table = [[0.0, 0.0, 0.0] for _ in range(stages)]
    for i, t in enumerate(times):
        row = table[split.stage_of(i)]
        for j in range(3):
            row[j] += t[j]
    return Costs(per_stage=tuple(tuple(r) for r in table), latency=latency)


def profile_text(plan: Plan, profile: Profile, replay=None) -> str:
    """How the report names the measured costs it used (and whether it replayed steps)."""
    steps = profile.measured_steps
    span = f"steps {steps[0]}-{steps[-1]}" if len(steps) > 1 else f"step {steps[0]}" \
        if steps else "no steps"
    how = (f"; the median of its {len(profile.steps)} measured steps replayed" if replay
           else "; its mean op times" + ("" if profile.steps else ", no steps to replay")
           + ("" if not profile.steps or replay else " (another split)"))
    return (f"profile {plan.pipeline.profile} (measured on {profile.device}, {profile.schedule}, "
            f"{span}{how})")


def replayed(profile: Profile, schedule, costs, split_points: Sequence[str]):
    """The schedule simulated once per measured step of the profile, each action charged its
    own measured time in that step and each transfer its own measured delay (microbatch k
    beyond the profiled ones: k mod their count); `costs` (the means) give the B:W ratio where only BW was measured, and where
    a profiled stage ran B and W but the schedule runs BW, B + W is charged. Returns
    (simulation of the median step, median makespan), or None when the plan's split is
    not the profiled one or the file holds no steps."""
    if not profile.steps or tuple(split_points) != profile.split_points \
            or schedule.stages != len(profile.stages):
        return None
    return replay_steps(profile.steps, schedule, costs)


def replay_steps(samples: Sequence[StepSample], schedule, costs):
    """(simulation of the median step by bubble, median makespan) over `samples`, each step
    simulated with its own measured slots and transfer delays (`replayed`)."""
    from ...schedules.simulate import simulate

    runs = []
    for sample in samples:
        step_costs = dataclasses.replace(costs, latency=sample.p2p_latency_s)
        runs.append(simulate(schedule, step_costs,
                             durations=_durations(sample, costs, schedule.stages),
                             delays=_delays(sample) if sample.delays else None))
    runs.sort(key=lambda r: r.bubble)
    makespans = sorted(r.makespan for r in runs)
    return runs[(len(runs) - 1) // 2], makespans[(len(makespans) - 1) // 2]


def _delays(sample: StepSample):
    """Each action's input delay in the step (B and BW stand for each other; 0 where the
    profiled run had none)."""
    def delay(a) -> float:
        row = sample.delays[a.stage]
        times = row.get(a.op) or row.get({"B": "BW", "BW": "B"}.get(a.op, a.op))
        return times[a.microbatch % len(times)] if times else 0.0
    return delay


def _durations(sample: StepSample, costs, stages: int):
    table = [costs.per_stage[s] if costs.per_stage else (costs.F, costs.B, costs.W)
             for s in range(stages)]

    def pick(times, mb):
        return times[mb % len(times)]

    def time(a) -> float:
        row, (_, b, w) = sample.stages[a.stage], table[a.stage]
        if a.op == "F":
            return pick(row["F"], a.microbatch)
        if row["B"] and row["W"]:
            if a.op == "BW":
                return pick(row["B"], a.microbatch) + pick(row["W"], a.microbatch)
            return pick(row[a.op], a.microbatch)
        full = pick(row["BW"], a.microbatch)  # measured only full backwards
        if a.op == "BW":
            return full
        share = b / (b + w) if b + w > 0 else 0.5
        return full * (share if a.op == "B" else 1.0 - share)
    return time
