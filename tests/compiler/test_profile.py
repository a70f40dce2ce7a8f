"""Cost files (`pipeplan profile`): they round-trip, they re-plan, bad ones are refused.

The re-planning tests write cost files by hand (the measured ones come from a
real run in tests/backends/test_observe.py) and compile the example GPT on the
meta device with `split = auto(profile)` / `schedule = auto`.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from pipeplan.cli import main
from pipeplan.compiler import compile_plan
from pipeplan.compiler.estimate.profile import Profile, ProfileError, StageProfile, StepSample
from pipeplan.dsl import load_plan

REPO = Path(__file__).resolve().parents[2]
GPT = REPO / "examples" / "models" / "gpt.py"


def _plan(tmp_path: Path, pipeline: str, name: str = "p.plan") -> Path:
    path = tmp_path / name
    path.write_text(f"""model {{
  source = "{GPT}:GPT"
  args = {{ vocab = 64, dim = 32, layers = 8, heads = 2, seq_len = 16 }}
  inputs = {{ input_ids = int64[batch, seq] }}
  loss = cross_entropy
}}
data = synthetic(seed = 0, vocab = 64, seq_len = 16)
mesh {{ pp = 2 }}
pipeline {{
  microbatches = 4
{pipeline}
}}
train {{ steps = 1
  global_batch = 8
  optimizer = adamw(lr = 0.01) }}
""")
    return path


SHAPE = {"sequences_per_microbatch": 2, "seq_len": 16, "precision": "fp32", "tp": 1}


def _profile(stages, points=("layers.4",), latency=1e-4, shape=SHAPE) -> Profile:
    return Profile("0" * 64, "cpu: test", "1f1b", tuple(points),
                   tuple(StageProfile(i, *t, samples=8, activation_bytes=4096)
                         for i, t in enumerate(stages)), latency, 2, (3, 4, 5), dict(shape))


def _write(tmp_path: Path, profile: Profile, name: str = "costs.json") -> Path:
    (tmp_path / name).write_text(profile.to_json())
    return tmp_path / name


def test_cost_file_round_trips():
    p = _profile([(0.01, None, None, 0.02), (0.03, 0.02, 0.04, None)])
    assert Profile.from_json(p.to_json(), "x.json") == p
    assert json.loads(p.to_json())["version"] == 1
    cpu = {"F": 0.008, "B": None, "W": None, "BW": 0.015}  # the slots' CPU time, optional
    q = dataclasses.replace(p, stages=(dataclasses.replace(p.stages[0], cpu=cpu),
                                       p.stages[1]))
    assert Profile.from_json(q.to_json(), "x.json") == q
    bad = json.loads(q.to_json())
    bad["stages"][0]["cpu"]["F"] = -1
    with pytest.raises(ProfileError, match="stage 0 cpu F must be a non-negative number"):
        Profile.from_json(json.dumps(bad), "x.json")


def _steps(*slow_f: float) -> tuple[StepSample, ...]:
    """Measured steps of a 2-stage, 2-microbatch run with full backwards: every F 1 s,
    every BW 2 s, but stage 0's F of microbatch 1 took `slow` s in that step."""
    return tuple(StepSample(3 + i, 0.0, ({"F": (1.0, slow), "B": None, "W": None,
                                          "BW": (2.0, 2.0)},
                                         {"F": (1.0, 1.0), "B": None, "W": None,
                                          "BW": (2.0, 2.0)}))
                 for i, slow in enumerate(slow_f))


def test_cost_file_with_measured_steps_round_trips():
    p = dataclasses.replace(_profile([(0.01, None, None, 0.02)] * 2), steps=_steps(3.0, 1.0))
    assert Profile.from_json(p.to_json(), "x.json") == p
    bad = json.loads(p.to_json())
    bad["steps"][0]["stages"] = bad["steps"][0]["stages"][:1]
    with pytest.raises(ProfileError, match="a steps entry needs one object per stage"):
        Profile.from_json(json.dumps(bad), "x.json")


def test_prediction_replays_the_median_measured_step(tmp_path):
    """1F1B, 2 ranks, 2 microbatches; in two of three measured steps stage 0's F of
    microbatch 1 took 3 s (F 1 s, BW 2 s otherwise). By hand: rank 0 runs F0 [0,1],
    F1 [1,4], BW0 [4,6] (after rank 1's BW0 [2,4]), BW1 [7,9] (after rank 1's F1 [4,5] and
    BW1 [5,7]): makespan 9, busy 8 + 6, bubble 1 - 14/18. The mean times (stage 0's F
    (1 + 7/3)/2) would predict something else; another split falls back to them."""
    shape = {**SHAPE, "sequences_per_microbatch": 4}
    means = [(1.0 + 7.0 / 3.0) / 2, None, None, 2.0], [1.0, None, None, 2.0]
    _write(tmp_path, dataclasses.replace(_profile(means, latency=0.0, shape=shape),
                                         steps=_steps(3.0, 1.0, 3.0)))
    plan = _plan(tmp_path, '  schedule = 1f1b\n  split = ["layers.4"]\n'
                 '  profile = "costs.json"')
    plan.write_text(plan.read_text().replace("microbatches = 4", "microbatches = 2"))
    e = compile_plan(load_plan(str(plan))).estimates
    assert e.simulation.makespan == pytest.approx(9.0, rel=1e-12)
    assert e.bubble == pytest.approx(1 - 14 / 18, rel=1e-12)
    assert e.step_time_s == pytest.approx(9.0, rel=1e-12)
    assert "the median of its 3 measured steps replayed" in e.device_model["profile"]
    plan.write_text(plan.read_text().replace('"layers.4"', '"layers.3"'))
    e = compile_plan(load_plan(str(plan))).estimates
    assert e.bubble != pytest.approx(1 - 14 / 18, rel=1e-3)
    assert "its mean op times (another split)" in e.device_model["profile"]


def test_replay_charges_each_transfer_its_own_delay(tmp_path):
    """F 1 s, BW 2 s everywhere; in the measured step stage 1's input for F mb0 arrived 1 s
    after stage 0 sent it (every other transfer at once). By hand (1F1B, 2 ranks, 2
    microbatches): rank 1 runs F0 [2,3], BW0 [3,5], F1 [5,6], BW1 [6,8]; rank 0 F0 [0,1],
    F1 [1,2], BW0 [5,7], BW1 [8,10]: makespan 10, bubble 1 - 12/20. Without the delays
    (the step's mean latency 0 on every transfer): makespan 9."""
    shape = {**SHAPE, "sequences_per_microbatch": 4}
    even = {"F": (1.0, 1.0), "B": None, "W": None, "BW": (2.0, 2.0)}
    none = {"F": (0.0, 0.0), "B": None, "W": None, "BW": (0.0, 0.0)}
    late = dataclasses.replace(_profile([(1.0, None, None, 2.0)] * 2, latency=0.0, shape=shape),
                               steps=(StepSample(3, 0.0, (even, even),
                                                 (none, {**none, "F": (1.0, 0.0)})),))
    assert Profile.from_json(late.to_json(), "x.json") == late
    plan = _plan(tmp_path, '  schedule = 1f1b\n  split = ["layers.4"]\n'
                 '  profile = "costs.json"')
    plan.write_text(plan.read_text().replace("microbatches = 4", "microbatches = 2"))
    for profile, makespan in ((late, 10.0), (dataclasses.replace(
            late, steps=(dataclasses.replace(late.steps[0], delays=()),)), 9.0)):
        _write(tmp_path, profile)
        e = compile_plan(load_plan(str(plan))).estimates
        assert e.simulation.makespan == pytest.approx(makespan, rel=1e-12)
    _write(tmp_path, late)
    assert compile_plan(load_plan(str(plan))).estimates.bubble == pytest.approx(0.4, rel=1e-12)


def test_heavy_last_stage_gets_fewer_layers(tmp_path):
    """auto(profile) balances measured times: a last stage measured 3x slower than its FLOPs
    say gives up layers; an even profile keeps the FLOP-balanced cut."""
    def split_for(last: float) -> tuple[str, ...]:
        _write(tmp_path, _profile([(0.01, 0.01, 0.01, None), (0.01 * last, 0.01 * last,
                                                              0.01 * last, None)]))
        plan = _plan(tmp_path, '  schedule = 1f1b\n  split = auto(profile)\n'
                     '  profile = "costs.json"')
        return compile_plan(load_plan(str(plan))).split_points

    even, heavy = split_for(1.0), split_for(3.0)
    layer = lambda pts: int(pts[0].split(".")[1])  # noqa: E731
    # an even profile keeps the profiled cut; stage 1 measured 3x heavier starts later
    # (per layer 3x: 4 + 4 layers -> 5 + 3 balances 0.05 | 0.07 best)
    assert (layer(even), layer(heavy)) == (4, 5)


def test_costly_w_moves_w_placement_and_costs_are_the_profiles(tmp_path):
    """schedule = auto orders ops by the profile: a costly W is placed differently; with the
    profiled split the simulated per-stage costs are exactly the measured ones."""
    def compiled_for(w: float):
        _write(tmp_path, _profile([(0.01, 0.01, w, None), (0.01, 0.01, w, None)]))
        plan = _plan(tmp_path, '  schedule = auto\n  split = ["layers.4"]\n'
                     '  profile = "costs.json"')
        return compile_plan(load_plan(str(plan)))

    cheap, costly = compiled_for(0.001), compiled_for(0.03)
    w_at = lambda c: [[i for i, a in enumerate(row) if a.op == "W"]  # noqa: E731
                      for row in c.schedule.order]
    assert w_at(cheap) != w_at(costly)
    sim = costly.estimates.simulation
    for row in sim.costs.per_stage:  # the measured times, summed back from the nodes
        assert row == pytest.approx((0.01, 0.01, 0.03), rel=1e-12)
    assert sim.costs.latency == 1e-4
    assert costly.estimates.device_model["profile"] == (
        "profile costs.json (measured on cpu: test, 1f1b, steps 3-5; its mean op times, no "
        "steps to replay)")


@pytest.mark.parametrize("content,reason", [
    ("{not json", "not JSON"),
    ('{"version": 7}', "cost file version 7"),
    ('{"version": 1, "plan_sha256": "", "device": "", "schedule": "", "split_points": [],'
     ' "p2p_latency_s": 0, "warmup_steps": 0, "measured_steps": []}', "missing key 'stages'"),
    ('{"version": 1, "plan_sha256": "", "device": "", "schedule": "", "split_points": [],'
     ' "p2p_latency_s": -1, "warmup_steps": 0, "measured_steps": [], "stages": [],'
     ' "shape": {}}',
     "p2p_latency_s must be a non-negative number"),
])
def test_bad_cost_files_name_the_file_and_the_reason(tmp_path, capsys, content, reason):
    (tmp_path / "costs.json").write_text(content)
    plan = _plan(tmp_path, '  schedule = 1f1b\n  profile = "costs.json"')
    assert main(["check", str(plan)]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'costs.json'}: " in err and reason in err and "Traceback" not in err


def test_a_missing_cost_file_and_a_foreign_split_point(tmp_path, capsys):
    plan = _plan(tmp_path, '  schedule = 1f1b\n  profile = "nowhere.json"')
    assert main(["check", str(plan)]) == 2
    assert "nowhere.json: cannot read the plan's cost file" in capsys.readouterr().err
    _write(tmp_path, _profile([(0.01, 0.01, 0.01, None)] * 2, points=("blocks.9",)))
    plan = _plan(tmp_path, '  schedule = 1f1b\n  profile = "costs.json"')
    assert main(["check", str(plan)]) == 2
    err = capsys.readouterr().err
    assert "no module named 'blocks.9'" in err and "profile" in err
    # measured with 4 sequences per microbatch; the plan runs 2
    _write(tmp_path, _profile([(0.01, 0.01, 0.01, None)] * 2,
                              shape={**SHAPE, "sequences_per_microbatch": 4}))
    assert main(["check", str(plan)]) == 2
    assert "measured under another workload: sequences_per_microbatch 4 (the plan: 2)" in \
        capsys.readouterr().err
    with pytest.raises(ProfileError):
        Profile.from_json(json.dumps({**json.loads(_profile([(1, 1, 1, None)] * 2).to_json()),
                                      "split_points": []}), "x.json")
