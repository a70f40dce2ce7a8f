"""`pipeplan run` / `pipeplan verify` end to end: real local processes through the CLI."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).parent
REPO = HERE.parent.parent

PLAN = """
model {{
  source = "{source}"
  args = {{ vocab = 64, dim = 32, layers = 4, heads = 4, seq_len = 16{extra} }}
  inputs = {{ input_ids = int64[batch, seq] }}
  capture = fx{leaf}
  loss = cross_entropy
}}
data = synthetic(seed = 1, vocab = 64, seq_len = 16)
mesh {{
  pp = 2
  dp = {dp}
}}
pipeline {{
  schedule = {schedule}
  microbatches = 2
  split = [layers[0:2], layers[2:4]]
}}
train {{
  steps = 3
  global_batch = {batch}
  optimizer = sgd(lr = 0.05, momentum = 0.9)
  grad_clip = 0.5
  seed = 0{train_extra}
}}
"""


def write_plan(tmp_path: Path, *, source=None, extra="", leaf="", dp=1, schedule="1f1b",
               train_extra="", name="tiny.plan") -> Path:
    source = source or str(REPO / "examples/models/gpt.py") + ":GPT"
    text = PLAN.format(source=source, extra=extra, leaf=leaf, dp=dp, schedule=schedule,
                       batch=4 * dp, train_extra=train_extra)
    path = tmp_path / name
    path.write_text(text)
    return path


def pipeplan(*args, timeout=180, env=None):
    return subprocess.run([sys.executable, "-m", "pipeplan", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, env=env)


def processes_mentioning(marker: str) -> list[int]:
    """Live processes whose command line contains `marker` (leftovers of a run)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if marker in cmd:
            found.append(int(pid))
    return found


@pytest.mark.slow
def test_verify_reports_equal(tmp_path):
    plan = write_plan(tmp_path, dp=2, schedule="gpipe")
    r = pipeplan("verify", plan, "--steps", 3)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "EQUAL to single-process training (fp64)" in r.stdout
    assert "rule fp64: every element within rtol=1e-09, atol=1e-12" in r.stdout
    assert "max |param - reference param|" in r.stdout
    assert "max |grad - reference grad|" in r.stdout and "after step 1" in r.stdout


@pytest.mark.slow
def test_run_build_dir_writes_metrics_and_trace(tmp_path):
    """`pipeplan compile` then `pipeplan run BUILD/`: the reference's losses, metrics, a trace."""
    from pipeplan.backends.verify.reference import train_reference
    from pipeplan.dsl.load import load_plan

    plan = write_plan(tmp_path)
    r = pipeplan("compile", plan, "-o", tmp_path / "build")
    assert r.returncode == 0, r.stdout + r.stderr
    trace, costs, run_dir = tmp_path / "t.json", tmp_path / "costs.json", tmp_path / "logs"
    metrics = run_dir / "metrics.jsonl"  # train.log_dir receives the metrics (no --metrics)
    r = pipeplan("run", tmp_path / "build", "--trace", trace,
                 "--set", f"train.log_dir=\"{run_dir}\"", "--profile-out", costs)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert all(row["tokens_per_s"] > 0 for row in rows)
    reference = train_reference(load_plan(str(plan)), 3).losses
    assert [row["loss"] for row in rows] == pytest.approx(reference, rel=1e-5, abs=1e-6)
    assert "step 3/3" in r.stdout and "measured" in r.stdout and "predicted" in r.stdout
    events = json.loads(trace.read_text())["traceEvents"]
    actions = {(e["pid"], e["name"]) for e in events if e["ph"] == "X"}
    # 1f1b, 2 microbatches: each rank runs F and BW of its stage for both, every step
    assert {(0, "F0.0"), (0, "BW0.1"), (1, "F1.1"), (1, "BW1.0")} <= actions  # the IR's names
    compute = [e for e in events if e["ph"] == "X" and e["pid"] < 1000 and e["tid"] == 0]
    assert len(compute) == 3 * 2 * 2 * 2
    _check_trace_profile_and_report(events, rows, costs, run_dir, plan, tmp_path)


def _check_trace_profile_and_report(events, rows, costs, run_dir, plan, tmp_path):
    """The same run's measured trace (µs, every lane, the planned track), its cost file (read
    back and compiled with) and `pipeplan report` on its run directory."""
    from html.parser import HTMLParser
    from xml.etree import ElementTree as ET

    from pipeplan.cli import main
    from pipeplan.compiler import compile_plan
    from pipeplan.compiler.estimate.profile import Profile
    from pipeplan.dsl.load import load_plan

    measured = [e for e in events if e["ph"] == "X" and e["pid"] < 1000]
    kinds = {(e["pid"], e["tid"], e["cat"]) for e in measured}
    for pid in (0, 1):  # every rank: compute, receive waits/sends, gradient sync, optimizer
        assert {(pid, 1, "send"), (pid, 1, "send wait"), (pid, 2, "grad sync"),
                (pid, 2, "optimizer")} <= kinds
    assert (1, 1, "recv wait") in kinds  # rank 1's first F waits for rank 0's activations
    # µs: step 3 on rank 0, first action to optimizer end, is about the step time printed
    step3 = [e for e in measured if e["pid"] == 0 and e["args"].get("step") == 3]
    span_us = max(e["ts"] + e["dur"] for e in step3) - min(e["ts"] for e in step3)
    assert 0.5 < span_us / (rows[2]["step_time_s"] * 1e6) < 1.5
    planned = [e for e in events if e["ph"] == "X" and 1000 <= e["pid"] < 2000]
    assert {e["pid"] for e in planned} == {1000, 1001} and len(planned) == 3 * 2 * 2 * 2
    predicted = [e for e in events if e["ph"] == "X" and e["pid"] >= 2000]  # check's model
    assert {e["pid"] for e in predicted} == {2000, 2001} and len(predicted) == len(planned)

    profile = Profile.from_json(costs.read_text(), str(costs))
    assert profile.split_points == ("layers.2",) and profile.measured_steps == (2, 3)
    # an op's cost is its mean slot over the measured steps: the compute slice plus the
    # runtime lane's slices of the same action (posting receives and sends, checks)
    slots: dict = {}
    for e in measured:
        if e["tid"] in (0, 3) and e["args"].get("step") in (2, 3):
            a = e["args"]
            key = (a["op"], a["stage"], a["microbatch"], a["step"])
            slots[key] = slots.get(key, 0.0) + e["dur"] / 1e6
    assert (0, 3, "runtime") in kinds and (1, 3, "runtime") in kinds
    for st in profile.stages:
        for op, value in (("F", st.F), ("BW", st.BW)):
            mine = [v for k, v in slots.items() if k[:2] == (op, st.index)]
            assert len(mine) == 4 and value == pytest.approx(sum(mine) / 4, rel=1e-6, abs=1e-7)
    assert all(s.F > 0 and s.BW > 0 and s.B is None and s.samples == 2 * 2
               for s in profile.stages)
    # each slot's CPU time on the rank's one thread: measured, and never more than its wall
    for st in profile.stages:
        assert st.cpu is not None and st.cpu["B"] is None and st.cpu["W"] is None
        for op, wall in (("F", st.F), ("BW", st.BW)):
            assert 0 < st.cpu[op] <= wall * 1.001 + 1e-5, (st.index, op, st.cpu, wall)
    assert profile.stages[0].activation_bytes == 2 * 16 * 32 * 4  # [2, 16, 32] fp32 per mb
    replanned = tmp_path / "replanned.plan"
    replanned.write_text(plan.read_text().replace("microbatches = 2",
                                                  f'microbatches = 2\n  profile = "{costs}"'))
    estimates = compile_plan(load_plan(str(replanned))).estimates
    sim = estimates.simulation
    for st, row in zip(profile.stages, sim.costs.per_stage):  # F and B + W = the measured BW
        assert row[0] == pytest.approx(st.F, rel=1e-9)
        assert row[1] + row[2] == pytest.approx(st.BW, rel=1e-9)
    # each measured step kept action by action (the trace's slots), and replayed: the
    # prediction is the median step's simulation, under that step's latency
    assert [k.step for k in profile.steps] == [2, 3]
    for k in profile.steps:
        for st in range(2):
            for op in ("F", "BW"):
                assert k.stages[st][op] == pytest.approx(
                    [slots[(op, st, mb, k.step)] for mb in range(2)], rel=1e-6, abs=1e-7)
        assert k.delays[0]["F"] == (0.0, 0.0) and k.delays[1]["BW"] == (0.0, 0.0)
    assert sim.costs.latency in {k.p2p_latency_s for k in profile.steps}
    assert "the median of its 2 measured steps replayed" in estimates.device_model["profile"]

    assert main(["report", str(run_dir)]) == 0
    page = (run_dir / "report.html").read_text()
    tags = []

    class Tags(HTMLParser):
        def handle_starttag(self, tag, attrs):
            tags.append((tag, dict(attrs)))
    Tags().feed(page)
    assert page.startswith("<!DOCTYPE html>") and "http" not in page.replace(
        "http://www.w3.org/2000/svg", "")  # self-contained: nothing fetched
    assert [t for t, _ in tags].count("svg") == 4  # loss, step time, timeline, memory
    svgs = [ET.fromstring("<svg" + part[:part.index("</svg>") + 6])
            for part in page.split("<svg")[1:]]
    ns = "{http://www.w3.org/2000/svg}"
    loss, step_time = svgs[0], svgs[1]
    points = loss.find(ns + "polyline").get("points").split()
    assert len(points) == 3 and loss.get("data-name") == "loss"
    assert len(step_time.find(ns + "polyline").get("points").split()) == 3
    rows_drawn = [t.text for t in svgs[2].iter(ns + "text") if t.get("x") == "4"][1:]  # 0: title
    assert rows_drawn == ["rank 0 (pp 0) measured", "pp 0 planned", "rank 1 (pp 1) measured",
                          "pp 1 planned"]
    parts = [r.get("data-part") for r in svgs[3].iter(ns + "rect") if r.get("class") == "part"]
    assert parts.count("peak") == 2 and parts.count("param_bytes") == 2


@pytest.mark.slow
def test_rank_failure_stops_every_rank(tmp_path):
    plan = write_plan(tmp_path, source=str(HERE / "faulty.py") + ":FaultyGPT",
                      extra=", fail_layer = 2, fail_after = 3", leaf="\n  leaf_modules = [bomb]")
    start = time.monotonic()
    r = pipeplan("run", plan, "--timeout", 60)
    assert r.returncode == 1, r.stdout + r.stderr
    # layer 2 sits in stage 1 on rank 1; its 4th forward is step 2's microbatch 1
    assert "run failed: rank 1 failed in step 2: F s1 mb1 failed: RuntimeError: injected fault" \
        in r.stderr, r.stderr
    assert time.monotonic() - start < 60
    assert processes_mentioning(str(plan)) == []


def test_bad_plan_is_a_one_line_error(tmp_path):
    text = (REPO / "examples/moe_pp2_ep2_zbv.plan").read_text()
    plan = tmp_path / "moe_allgather.plan"  # a dispatcher not implemented: refused at the plan line
    plan.write_text(text.replace("dispatcher = alltoall", "dispatcher = allgather", 1))
    (tmp_path / "models").symlink_to(REPO / "examples/models")
    r = pipeplan("run", plan, timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"{plan}:" in r.stderr and "dispatcher = allgather is not implemented" in r.stderr
    assert "^" in r.stderr
    assert "Traceback" not in r.stderr and "launching" not in r.stdout
    r = pipeplan("run", tmp_path / "missing.plan", timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr


UNRULED = """\
import torch
from torch import nn


class Scaled(nn.Module):  # a drawn parameter and no reset_parameters()
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(8))

    def forward(self, x):
        return x * self.scale


class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.mid, self.head = nn.Embedding(16, 8), Scaled(), nn.Linear(8, 16)

    def forward(self, input_ids):
        return self.head(self.mid(self.emb(input_ids)))
"""


@pytest.mark.parametrize("command", ["run", "verify"])
def test_run_and_verify_refuse_what_check_refuses_before_launching(tmp_path, command):
    """A module whose drawn parameter no init rule writes is refused by `check` at the model
    line; `run` and `verify` refused it only once every rank had started, in their setup
    ("was not initialised"): they now make check's every refusal before launching."""
    (tmp_path / "m.py").write_text(UNRULED)
    plan = tmp_path / "p.plan"
    plan.write_text('model {\n  source = "m.py:M"\n  inputs = { input_ids = int64[batch, seq] }'
                    '\n}\ndata = synthetic(seed = 0, vocab = 16, seq_len = 8)\nmesh { pp = 2 }'
                    '\npipeline { microbatches = 2 }\ntrain {\n  steps = 1\n  global_batch = 4\n}\n')
    r = pipeplan(command, plan, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"{plan}:2:12: error: module `mid` (Scaled) owns parameters scale" in r.stderr, r.stderr
    assert "launching" not in r.stdout and "Traceback" not in r.stderr, r.stdout + r.stderr


@pytest.mark.slow
@pytest.mark.heavy  # (37 s; CI runs the example as the README writes it, with --trace)
def test_moe_example_trains(tmp_path):
    """The MoE example as written (pp=2 x dp=2, expert parallel ep=2, zbv): its loss falls."""
    metrics = tmp_path / "moe.jsonl"
    r = pipeplan("run", REPO / "examples/moe_pp2_ep2_zbv.plan", "--metrics", metrics, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    losses = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
    assert len(losses) == 20  # train.steps
    assert losses[-1] < 0.8 * losses[0], losses  # ~5.6 (ln 256) -> ~3.6 on the synthetic stream


def test_tampered_build_schedule_is_refused_before_launch(tmp_path):
    """A build whose schedule.json fails the verifier never starts a process."""
    plan = write_plan(tmp_path)
    r = pipeplan("compile", plan, "-o", tmp_path / "build", timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    path = tmp_path / "build" / "schedule.json"
    schedule = json.loads(path.read_text())
    last = schedule["order"][1]
    last[0], last[1] = last[1], last[0]  # rank 1 runs a backward before its forward
    path.write_text(json.dumps(schedule))
    r = pipeplan("run", tmp_path / "build", timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "launching" not in r.stdout and "Traceback" not in r.stderr
    assert "rank 1" in r.stderr


@pytest.mark.heavy  # ~1 min of two CLI launches; exact resume stays in the default suite
def test_checkpoint_resume_continues_exactly(tmp_path):  # (test_resume_paths, sharded, cp)
    """Stop after step 4 (checkpoints at 2 and 4), resume to 6: the same losses as one run."""
    ckpt = tmp_path / "ckpt"
    straight = write_plan(tmp_path, dp=2, name="straight.plan")
    text = (straight.read_text().replace("steps = 3", "steps = 6")
            .replace("sgd(lr = 0.05, momentum = 0.9)", "adamw(lr = 0.01)\n  lr_schedule = cosine(warmup = 2)"))
    straight.write_text(text)
    resumed = tmp_path / "resumed.plan"
    resumed.write_text(text.replace("seed = 0", f'seed = 0\n  checkpoint {{ every = 2  dir = "{ckpt}"  keep = 1 }}'))
    m1, m2 = tmp_path / "straight.jsonl", tmp_path / "resumed.jsonl"
    for args in ((straight, "--metrics", m1), (resumed, "--steps", 4, "--metrics", m2),
                 (resumed, "--metrics", m2)):
        r = pipeplan("run", *args)
        assert r.returncode == 0, r.stdout + r.stderr
    assert "resumed from" in r.stdout
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_000006"]  # keep = 1
    one = [json.loads(line)["loss"] for line in m1.read_text().splitlines()]
    two = [json.loads(line)["loss"] for line in m2.read_text().splitlines()]
    assert len(one) == len(two) == 6
    assert two == pytest.approx(one, rel=1e-6, abs=1e-7)


@pytest.mark.slow
def test_a_hung_rank_times_out_and_is_named(tmp_path):
    """Rank 1 hangs in F s1 mb1: rank 0's receive times out (--timeout), naming whom it waited for."""
    plan = write_plan(tmp_path, source=str(HERE / "faulty.py") + ":FaultyGPT",
                      extra=", fail_layer = 2, fail_after = 3, hang = true",
                      leaf="\n  leaf_modules = [bomb]")
    start = time.monotonic()
    r = pipeplan("run", plan, "--timeout", 8, timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    assert ("BW s0 mb1 (waiting for the input gradients of stage 1 mb1 from pipeline rank 1)"
            in r.stderr), r.stderr
    assert time.monotonic() - start < 60
    assert processes_mentioning(str(plan)) == []
