"""What a local run exposes and how it ends: loopback listeners only, no silent success,
SIGTERM said and cleaned up, a stopped rank found by its heartbeat.

Real local runs through the CLI (2 gloo ranks, a tiny GPT)."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeplan.tests.backends.local_ranks import ranks_of

REPO = Path(__file__).resolve().parents[2]
GPT = f"{REPO / 'examples/models/gpt.py'}:GPT"

PLAN = """
model {{
  source = "{source}"
  args = {{ vocab = 32, dim = 16, layers = 2, heads = 2, seq_len = 8 }}
  capture = fx
}}
data = synthetic(seed = 1, vocab = 32, seq_len = 8)
mesh {{ pp = 2 }}
pipeline {{ schedule = 1f1b  microbatches = 2 }}
train {{ steps = {steps}  global_batch = 2  optimizer = sgd(lr = 0.05) }}
"""


def _plan(tmp_path: Path, steps: int = 2, source: str = GPT) -> Path:
    path = tmp_path / "p.plan"
    path.write_text(PLAN.format(source=source, steps=steps))
    return path


def _start(plan: Path, *args, env=None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pipeplan", "run", str(plan), *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _wait_for_step(proc: subprocess.Popen, text: str, within: float = 200) -> str:
    deadline, seen = time.monotonic() + within, ""
    while text not in seen and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen += line
    assert text in seen, seen + proc.stderr.read()
    return seen


def _address(hexaddr: str) -> str:
    """/proc/net/tcp{,6}'s local address (little-endian 32-bit words) as an IP."""
    raw = bytes.fromhex(hexaddr)
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, raw)


def _listening(pids) -> set[str]:
    """'ip' of every listening TCP socket the processes hold."""
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
        except OSError:
            continue
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            f = row.split()
            if f[3] == "0A" and f[9] in inodes:  # 0A: LISTEN
                out.add(_address(f[1].split(":")[0]))
    return out


@pytest.mark.slow
def test_a_local_run_listens_on_loopback_only(tmp_path):
    proc = _start(_plan(tmp_path, steps=100000))
    try:
        _wait_for_step(proc, " 2/100000")
        seen = set()
        for _ in range(10):
            ranks = ranks_of(proc.pid)
            seen |= _listening([proc.pid, *ranks.values()])
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)
    assert seen, "no listening socket found"
    assert seen <= {"127.0.0.1", "::1", "::ffff:127.0.0.1"}, seen


@pytest.mark.heavy  # suite time: run with -m heavy
@pytest.mark.slow
def test_a_rank_that_exits_0_at_model_import_is_a_failure(tmp_path):
    """Rank 1 ends with a C-level _exit(0) while importing the model (nothing of Python runs
    after it): the run fails at once, naming the rank, its code and where it was."""
    model = tmp_path / "quits.py"
    model.write_text("import ctypes, os\nif os.environ.get('RANK') == '1':\n"
                     "    ctypes.CDLL(None)._exit(0)\n"
                     f"import sys\nsys.path.insert(0, {str(REPO.parent)!r})\n"
                     "from pipeplan.examples.models.gpt import GPT\n")
    proc = _start(_plan(tmp_path, source=f"{model}:GPT"), "--timeout", 60)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 1, out + err
    assert "run failed: rank 1 exited with code 0 during model import and compile without " \
           "reporting that it finished" in err, err


def test_check_refuses_a_model_that_calls_os_exit_at_import(tmp_path):
    """os._exit(0) at import ended `pipeplan check` with 0 and no word."""
    model = tmp_path / "quits.py"
    model.write_text("import os\nos._exit(0)\n")
    r = subprocess.run([sys.executable, "-m", "pipeplan", "check", str(_plan(tmp_path, source=f"{model}:GPT"))],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "calls os._exit(0) at import" in r.stderr, r.stderr


@pytest.mark.slow
def test_sigterm_to_the_launcher_says_what_it_stopped_and_cleans_up(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = _start(_plan(tmp_path, steps=100000), env=dict(os.environ, TMPDIR=str(tmp)))
    try:
        _wait_for_step(proc, " 2/100000")
        ranks = ranks_of(proc.pid)
        assert sorted(ranks) == [0, 1] and list(tmp.glob("pipeplan-errors-*"))  # its beacons
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err
    assert "pipeplan: stopped by SIGTERM: stopped ranks 0, 1" in err, err
    assert "Traceback" not in err and "frame #" not in err, err
    assert list(tmp.glob("pipeplan-*")) == []  # (torch's own caches may stay)
    assert all(not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
               for pid in ranks.values())


def _alive(pid: int) -> bool:
    try:  # a zombie has ended (whoever adopted it may not reap it at once)
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_a_launcher_killed_by_sigkill_leaves_no_rank_behind(tmp_path):
    """The ranks are forked from a fork server, not from the launcher (runtime/forkserver.py):
    no parent-death signal reaches them from it; each watches the launcher itself."""
    proc = _start(_plan(tmp_path, steps=100000))
    ranks: dict = {}
    try:
        _wait_for_step(proc, " 2/100000")
        ranks = ranks_of(proc.pid)
        assert sorted(ranks) == [0, 1]
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 10
        while any(map(_alive, ranks.values())) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(map(_alive, ranks.values())), "a rank outlived its launcher"
    finally:
        for pid in ranks.values():
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


@pytest.mark.slow
def test_a_stopped_rank_is_named_by_its_heartbeat(tmp_path):
    proc = _start(_plan(tmp_path, steps=100000), "--heartbeat", 4)
    try:
        _wait_for_step(proc, " 2/100000")
        victim = ranks_of(proc.pid)[1]
        os.kill(victim, signal.SIGSTOP)
        stopped = time.monotonic()
        out, err = proc.communicate(timeout=120)
        took = time.monotonic() - stopped
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err
    assert "rank 1 stopped responding: no heartbeat for 4 s" in err, err
    assert took < 60, took  # the collective timeout is 300 s (22.8 s seen at load 35)
    assert "frame #" not in err and "Traceback" not in err, err


def test_a_model_larger_than_the_machine_is_refused_at_model_args(tmp_path):
    """model.args that scale the model past this machine's memory: refused at the plan's
    model.args line from the meta trace's estimate, before any rank starts."""
    import math

    from pipeplan.backends.runtime.memory import machine_memory_bytes

    total = machine_memory_bytes()
    dim = 2 * math.ceil(math.sqrt(total / (2 * 12 * 4)) / 64) * 64  # parameters alone > total
    plan = _plan(tmp_path).read_text().replace("dim = 16", f"dim = {dim}")
    (tmp_path / "p.plan").write_text(plan)
    r = subprocess.run([sys.executable, "-m", "pipeplan", "run", str(tmp_path / "p.plan")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "p.plan:4:" in r.stderr and "args = {" in r.stderr, r.stderr  # the line, echoed
    assert "more than this machine's" in r.stderr and "launching" not in r.stdout, r.stderr


_PRELOAD_TOUCHES_NO_DEVICE = """
import sys
DEVICE = {"is_available", "device_count", "_lazy_init", "init", "current_device",
          "get_device_properties", "get_device_capability", "get_device_name", "set_device",
          "mem_get_info", "synchronize", "_cuda_getDeviceCount", "_cuda_init"}
seen = []
def hook(frame, event, arg):
    name = getattr(arg, "__name__", "") if event == "c_call" else frame.f_code.co_name
    where = frame.f_globals.get("__name__", "")
    if event in ("call", "c_call") and name in DEVICE and (
            where.startswith("torch.cuda") or name.startswith("_cuda")):
        seen.append(f"{where}.{name}")
sys.setprofile(hook)
for name in sys.argv[1:]:
    __import__(name)
sys.setprofile(None)
import torch
n = len(seen)
torch.cuda.is_available()  # the hook sees a device call where one happens
sys.setprofile(hook); torch.cuda.is_available(); sys.setprofile(None)
print(seen[:n], len(seen) > n)
"""


def test_the_fork_servers_imports_touch_no_device():
    """The ranks fork from a process that ran forkserver.PRELOAD's imports: a CUDA driver
    initialised there (torch.cuda.is_available() calls cuInit) cannot be used in a forked
    child, so no NCCL rank could start. The imports call none of torch.cuda's device
    functions (checked by a profile hook that does see a call made after them)."""
    from pipeplan.backends.runtime.forkserver import PRELOAD

    out = subprocess.run([sys.executable, "-c", _PRELOAD_TOUCHES_NO_DEVICE, *PRELOAD],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["[]", "True"], out.stdout
