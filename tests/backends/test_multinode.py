"""Multi-node: two torchrun node groups (c10d rendezvous on 127.0.0.1) reach the single-node losses."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).parent.parent.parent

PLAN = f"""
model {{
  source = "{REPO}/examples/models/gpt.py:GPT"
  args = {{ vocab = 64, dim = 32, layers = 4, heads = 4, seq_len = 16 }}
  inputs = {{ input_ids = int64[batch, seq] }}
  capture = fx
}}
data = synthetic(seed = 5, vocab = 64, seq_len = 16)
mesh {{
  pp = 2
  dp = 2
}}
pipeline {{
  schedule = 1f1b
  microbatches = 2
}}
train {{
  steps = 3
  global_batch = 8
  optimizer = adamw(lr = 0.003)
  grad_clip = 1.0
}}
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def losses(path: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in path.read_text().splitlines()]


def torchrun_nodes(plan: Path, *args: str, timeout: float = 240) -> tuple[list[int], list[str]]:
    """Start two torchrun node groups of 2 processes on loopback; (exit codes, outputs)."""
    endpoint = f"127.0.0.1:{free_port()}"
    node = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
            "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
            "--rdzv-id", "pipeplan-test", "-m", "pipeplan", "run", str(plan), *args]
    nodes = [subprocess.Popen(node, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(2)]
    try:
        outs = [n.communicate(timeout=timeout)[0] for n in nodes]
    finally:
        for n in nodes:
            if n.poll() is None:
                n.kill()
    return [n.returncode for n in nodes], outs


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_two_torchrun_nodes_match_single_node(tmp_path):
    plan = tmp_path / "mn.plan"
    plan.write_text(PLAN)
    single = tmp_path / "single.jsonl"
    r = subprocess.run([sys.executable, "-m", "pipeplan", "run", plan, "--metrics", single],
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr

    multi = tmp_path / "multi.jsonl"
    codes, outs = torchrun_nodes(plan, "--metrics", str(multi))
    assert codes == [0, 0], "\n".join(outs)
    assert len(losses(multi)) == 3
    assert losses(multi) == pytest.approx(losses(single), rel=1e-6, abs=1e-7)


@pytest.mark.heavy  # suite time: run with -m heavy
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_failing_rank_stops_both_torchrun_nodes(tmp_path):
    """No pipeplan launcher watches torchrun ranks: the store watchdog stops them."""
    faulty = Path(__file__).parent / "faulty.py"
    plan = tmp_path / "faulty.plan"
    plan.write_text(PLAN.replace(f"{REPO}/examples/models/gpt.py:GPT", f"{faulty}:FaultyGPT")
                    .replace("seq_len = 16 }", "seq_len = 16, fail_layer = 2, fail_after = 3 }")
                    .replace("capture = fx", "capture = fx\n  leaf_modules = [bomb]"))
    codes, outs = torchrun_nodes(plan, "--timeout", "120", timeout=200)
    assert all(c != 0 for c in codes), "\n".join(outs)
    text = "\n".join(outs)
    assert "failed in step 2: F s1 mb1 failed: RuntimeError: injected fault" in text, text
