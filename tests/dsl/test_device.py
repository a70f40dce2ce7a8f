"""The `device` section: units, spans, checks with file:line:col, canonical form."""
from __future__ import annotations

import pytest

from pipeplan.dsl import PlanError, format_plan, load_plan, parse_plan
from pipeplan.dsl.ast import DeviceSpec
from pipeplan.dsl.values import write_duration, write_rate

MODEL = 'model { source = "m.py:M" }\n'
DEVICE = MODEL + """\
device {
  name = h100
  flops = 989.5TFLOP/s  # H100 dense bf16
  memory_bandwidth = 3.35TB/s
  intra_node = 900GB/s
  inter_node = 400Gb/s
  latency = 8us
  ranks_per_node = 4
}
"""


def test_device_section_reads_every_unit(pos):
    plan = parse_plan(DEVICE, "d.plan")
    assert plan.device == DeviceSpec(name="h100", flops=989.5e12, memory_bandwidth=3.35e12,
                                     intra_node=900e9,
                                     inter_node=50e9,  # 400 Gb/s is 50 GB/s: bits
                                     latency=8e-6, ranks_per_node=4)
    assert parse_plan(MODEL + "device = a100\n").device == DeviceSpec(name="a100")
    for key, text in (("flops", "989.5TFLOP/s"), ("inter_node", "400Gb/s"), ("latency", "8us")):
        span = plan.span_of(f"device.{key}")
        assert (span.line, span.col) == pos(DEVICE, text)
        assert span.end_col - span.col == len(text)


@pytest.mark.parametrize("text,value", [
    ("1PFLOP/s", 1e15), ("2.5GFLOP/s", 2.5e9), ("7FLOP/s", 7.0), ("1GiB/s", 2.0 ** 30),
    ("3KB/s", 3e3), ("8Mb/s", 1e6), ("100B/s", 100.0)])
def test_rates_in_every_unit(text, value):
    key = "flops" if "FLOP" in text else "intra_node"
    plan = parse_plan(MODEL + f"device {{ {key} = {text} }}")
    assert value in (plan.device.flops, plan.device.intra_node)


@pytest.mark.parametrize("text,seconds", [("1s", 1.0), ("1.5ms", 1.5e-3), ("250ns", 2.5e-7),
                                          ("0us", 0.0)])
def test_durations(text, seconds):
    assert parse_plan(MODEL + f"device {{ latency = {text} }}").device.latency == seconds


def test_units_do_not_change_other_tokens():
    """Names that start with digits and sizes lex as before; a name that would now read as a
    duration is quoted by the formatter."""
    plan = parse_plan(MODEL + "pipeline { schedule = 1f1b  memory_limit = 2GB }\n"
                      'recompute { "10us" = full }\n')
    assert plan.pipeline.schedule == "1f1b" and plan.pipeline.memory_limit.amount == 2e9
    text = format_plan(plan)
    assert '"10us" = full' in text and parse_plan(text) == plan


def test_canonical_form_round_trips_and_keeps_comments():
    plan = parse_plan(DEVICE, "d.plan")
    text = format_plan(plan)
    assert "device {\n  name = h100\n  flops = 989.5TFLOP/s  # H100 dense bf16\n" in text
    assert "  inter_node = 50GB/s\n" in text and "  latency = 8us\n" in text
    assert parse_plan(text, "d.plan") == plan and format_plan(parse_plan(text, "d.plan")) == text
    # without a device section nothing is written; check's full form states the defaults
    bare = parse_plan(MODEL)
    assert "device" not in format_plan(bare)
    full = format_plan(bare, full=True)
    assert "device {}\n" in full  # every key from the profile (or this CPU, measured)
    assert parse_plan(full) == bare


@pytest.mark.parametrize("value", [450e9, 2.0 ** 30, 1e-3, 123456789.123, 3.3e14, 1.0, 0.1])
def test_writers_give_back_the_exact_value(value):
    assert parse_plan(MODEL + f"device {{ flops = {write_rate('flops')(value)} }}"
                      ).device.flops == value
    assert parse_plan(MODEL + f"device {{ inter_node = {write_rate('bytes')(value)} }}"
                      ).device.inter_node == value
    assert parse_plan(MODEL + f"device {{ latency = {write_duration(value)} }}"
                      ).device.latency == value


BAD = MODEL + """\
device {
  flop = 989TFLOP/s
  mfu = 0.5
  intra_node = 450GB
  inter_node = 0GB/s
  latency = 8
  ranks_per_node = 0
  flops = 400GB/s
}
"""


def test_every_bad_value_is_reported_at_its_spot(errors_of, pos):
    found = errors_of(BAD, path="b.plan")
    expected = [
        ("flop", "unknown key 'flop' in device"),
        ("mfu", "device.mfu is gone: the time model predicts MFU from the device's ops "
                "(pipeplan check prints it)"),
        ("450GB", "device.intra_node must be a rate like 450GB/s (or 400Gb/s in bits), got a size"),
        ("0GB/s", "device.inter_node must be above 0, got 0/s"),
        ("8\n", "device.latency must be a duration like 10us, got 8"),
        ("0\n", "device.ranks_per_node must be at least 1, got 0"),
        ("400GB/s", "device.flops must be a rate like 989TFLOP/s, got a byte rate"),
    ]
    assert found == [("b.plan", *pos(BAD, needle), message) for needle, message in expected]
    with pytest.raises(PlanError) as info:
        parse_plan(BAD, "b.plan")
    assert "hint: did you mean 'flops'?" in str(info.value)


def test_mfu_is_refused_with_a_hint():
    with pytest.raises(PlanError) as info:
        parse_plan(MODEL + "device {\n  name = a100\n  mfu = 0.5\n}\n", "m.plan")
    text = str(info.value)
    assert "m.plan:4:3: error: device.mfu is gone" in text
    assert "hint: name a device (device = a100) and override its facts" in text


def test_override_sets_a_device_key(tmp_path):
    path = tmp_path / "p.plan"
    path.write_text(DEVICE)
    plan = load_plan(str(path), ["device.flops=2PFLOP/s", "device.latency=1ms"])
    assert (plan.device.flops, plan.device.latency) == (2e15, 1e-3)
    with pytest.raises(PlanError) as info:
        load_plan(str(path), ["device.inter_node=50"])
    assert "<--set 1>:1:19: error: device.inter_node must be a rate" in str(info.value)
