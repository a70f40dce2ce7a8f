"""JSON schema and torch CSV round trips; malformed files give one-line errors."""
import json

import pytest

from pipeplan.schedules import (KINDS, ScheduleError, generate, schedule_from_csv, schedule_from_json, schedule_to_csv, schedule_to_json, simulate, verify)


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "auto"])
def test_json_round_trip_keeps_every_field(kind):
    s = generate(kind, 4, 8)
    r = simulate(s)
    text = schedule_to_json(s, r.metrics())
    data = json.loads(text)
    assert set(data) == {"schedule", "ranks", "stages", "microbatches", "stage_to_rank", "order", "metrics"}
    assert data["order"][0][0] == {"op": s.order[0][0].op, "stage": s.order[0][0].stage, "mb": 0}
    assert set(data["metrics"]) == {"makespan", "bubble", "span_bubble", "peak_activations", "lower_bound"}
    assert schedule_from_json(text) == s


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "interleaved", "zbh1", "zbv", "dualpipev"])
def test_csv_round_trip_in_torch_spelling(kind):
    s = generate(kind, 4, 8)
    text = schedule_to_csv(s)
    if s.splits_backward():
        assert "I" in text and "W" in text  # torch's I is our B
    else:
        assert "B" in text and "I" not in text  # torch's B is our full backward
    back = schedule_from_csv(text, name=kind)
    assert back.order == s.order and back.stage_to_rank == s.stage_to_rank
    verify(back)


def test_csv_skips_torch_non_compute_entries_and_expands_overlap():
    text = "0F0,(0F1;0B0)OVERLAP_F_B,0B1,0REDUCE_GRAD\n"
    s = schedule_from_csv(text)
    assert [str(a) for a in s.order[0]] == ["F0.0", "F0.1", "BW0.0", "BW0.1"]
    verify(s)


@pytest.mark.parametrize("text,pattern", [
    ("", "no rows"),
    ("0F0,0X0\n", r"'0X0' is not \{stage\}"),
    ("0F0,0B0\n0F1,0B1\n", "stage 0 appears on ranks 0 and 1"),
    ("0F0,0B0\n2F0,2B0\n", "stage 1 has no actions"),
    ("0F0,0B0,0F5\n", "out of range"),
])
def test_malformed_csv(text, pattern):
    with pytest.raises(ScheduleError, match=pattern) as info:
        schedule_from_csv(text)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("text,pattern", [
    ("{", "malformed schedule JSON"),
    ("[]", "top level must be an object"),
    ('{"ranks": 1}', "missing key 'stages'"),
    ('{"ranks": "a", "stages": 1, "microbatches": 1, "stage_to_rank": [0], "order": [[]]}', "'ranks' must be an integer"),
    ('{"ranks": 1, "stages": 1, "microbatches": 1, "stage_to_rank": [0], "order": [[{"op": "Q", "stage": 0, "mb": 0}]]}',
     "rank 0 action 0 must be"),
    ('{"ranks": 1, "stages": 1, "microbatches": 1, "stage_to_rank": [0], "order": [[]]}',
     "needs at least 2 actions"),
    ('{"ranks": 1, "stages": 1, "microbatches": 1, "stage_to_rank": [0], "order": '
     '[[{"op": "W", "stage": 0, "mb": 0}, {"op": "B", "stage": 0, "mb": 0}]]}', None),
])
def test_malformed_json(text, pattern):
    if pattern is None:  # parses, then the verifier names what is missing
        with pytest.raises(ScheduleError, match=r"F\(stage 0, mb 0\) is missing"):
            verify(schedule_from_json(text))
        return
    with pytest.raises(ScheduleError, match=pattern) as info:
        schedule_from_json(text)
    assert "\n" not in str(info.value)
