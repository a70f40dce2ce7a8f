"""A stopped rank under torchrun (no pipeplan launcher watches it) is named by the store
heartbeat (backends/runtime/heartbeat.py) within the --heartbeat bound, not after the
300 s collective timeout: two torchrun node groups of 2 ranks on loopback, rank 1 SIGSTOPped
mid-run."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from .test_multinode import PLAN, free_port


def _children(parents: set[int]) -> dict[int, int]:
    """rank -> pid of the processes the torchrun agents started (from /proc)."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[1]) not in parents:
                continue
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        out.update({int(kv[5:]): int(pid) for kv in env if kv.startswith(b"RANK=")})
    return out


class _Lines:
    """Every line a process prints, collected by a thread, with when it came."""

    def __init__(self, proc: subprocess.Popen):
        self.lines: list[tuple[float, str]] = []
        threading.Thread(target=self._read, args=(proc,), daemon=True).start()

    def _read(self, proc):
        for line in proc.stdout:
            self.lines.append((time.monotonic(), line))

    def first(self, text: str):
        return next((t for t, line in list(self.lines) if text in line), None)

    def text(self) -> str:
        return "".join(line for _, line in list(self.lines))


@pytest.mark.heavy
@pytest.mark.timeout(400)
def test_a_stopped_rank_under_torchrun_is_named_by_the_store_heartbeat(tmp_path):
    plan = tmp_path / "mn.plan"
    plan.write_text(PLAN.replace("steps = 3", "steps = 100000"))
    endpoint = f"127.0.0.1:{free_port()}"
    node = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
            "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
            "--rdzv-id", "pipeplan-heartbeat", "-m", "pipeplan", "run", str(plan),
            "--heartbeat", "4"]
    nodes = [subprocess.Popen(node, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(2)]
    out = [_Lines(n) for n in nodes]
    victim = None
    try:
        deadline = time.monotonic() + 240
        while not any(o.first(" 2/100000") for o in out) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert any(o.first(" 2/100000") for o in out), "\n".join(o.text() for o in out)
        victim = _children({n.pid for n in nodes})[1]
        os.kill(victim, signal.SIGSTOP)
        stopped = time.monotonic()
        message = "rank 1 stopped responding: no heartbeat for 4 s"
        while not any(o.first(message) for o in out) and time.monotonic() < stopped + 120:
            time.sleep(0.5)
        named = min((t for t in (o.first(message) for o in out) if t), default=None)
        for n in nodes:
            n.wait(timeout=120)
    finally:
        if victim is not None:
            try:
                os.kill(victim, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for n in nodes:
            if n.poll() is None:
                n.kill()
    text = "\n".join(o.text() for o in out)
    assert named is not None, text
    assert named - stopped < 60, named - stopped  # 4 s + ticks; the collective timeout is 300 s
    assert "(last seen in step " in text and "noticed by rank 0" in text, text
    assert all(n.returncode != 0 for n in nodes), text
    assert "frame #" not in text, text  # no C++ frames: the ranks stop through the store
