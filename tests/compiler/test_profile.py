"""Cost files (`pipeplan profile`): they round-trip, they re-plan, bad ones are refused.

The re-planning tests write cost files by hand (the measured ones come from a
real run in tests/backends/test_observe.py) and compile the example GPT on the
meta device with `split = auto(profile)` / `schedule = auto`.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeplan.cli import main
from pipeplan.compiler import compile_plan
from pipeplan.compiler.profile import Profile, ProfileError, StageProfile
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
    assert costly.estimates.device_model["profile"].startswith("profile costs.json (measured "
                                                               "on cpu: test, 1f1b, steps 3-5)")


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
