"""The runtime's overhead removals (issue 13) keep their safety rules.

Bitwise equality of whole runs with the runtime before them: test_runtime_bitwise.py.
"""
from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path

import torch

from pipeplan.backends.runtime.comm import Direction, Transfer
from pipeplan.backends.runtime.executor import RecvBuffers
from pipeplan.compiler.compiled import ValueSpec

ROOT = Path(__file__).resolve().parents[2]


def test_a_receive_buffer_is_reused_only_once_nothing_else_holds_it():
    pool = RecvBuffers(torch.device("cpu"))
    t = Transfer(Direction.ACTIVATION, 0, 0, 1, (ValueSpec("h", (2, 4), "float32"),))
    a = pool.get(t, 0)
    assert pool.get(t, 0) is not a  # still referenced here
    lin = torch.nn.Linear(4, 4)
    x = a.detach().requires_grad_(True)  # as a stage takes its input
    y = lin(x).sum()
    del a, x
    b = pool.get(t, 0)
    assert b is not pool._pool[(Direction.ACTIVATION, 0, 0)][0]  # the graph saved it
    del y
    view = pool._pool[(Direction.ACTIVATION, 0, 0)][0][1:]  # a view passed on
    del b
    assert pool.get(t, 0) is not pool._pool[(Direction.ACTIVATION, 0, 0)][0]
    del view
    first = pool._pool[(Direction.ACTIVATION, 0, 0)][0]
    fresh = len(pool._pool[(Direction.ACTIVATION, 0, 0)])
    del first
    assert pool.get(t, 0) is pool._pool[(Direction.ACTIVATION, 0, 0)][0]  # idle: reused
    assert len(pool._pool[(Direction.ACTIVATION, 0, 0)]) == fresh


REPLAY = """
import pickle, sys
from pipeplan.backends.runtime.agreement import fingerprint
from pipeplan.compiler.capture.analysis import Propagation
from pipeplan.compiler.driver import compile_plan
from pipeplan.dsl.load import load_plan
plan = load_plan(sys.argv[1])
with Propagation.replay(pickle.load(open(sys.argv[2], "rb"))):
    compiled = compile_plan(plan)
print("torch._dynamo" in sys.modules, sorted(fingerprint(plan, compiled).items()))
"""


def test_a_rank_replaying_rank_0s_propagation_compiles_the_same_without_dynamo(tmp_path):
    """What every rank but 0 does at start-up (agreement.compile_shared): no meta run, no
    torch._dynamo import, and the fingerprint the ranks compare is rank 0's."""
    from pipeplan.backends.runtime.agreement import fingerprint
    from pipeplan.compiler.capture.analysis import Propagation
    from pipeplan.compiler.driver import compile_plan
    from pipeplan.dsl.load import load_plan
    path = str(ROOT / "examples" / "gpt_pp4_1f1b.plan")
    plan = load_plan(path)
    with Propagation.record() as recorded:
        compiled = compile_plan(plan)
    assert recorded.table
    (tmp_path / "table.pkl").write_bytes(pickle.dumps(recorded.table))
    out = subprocess.run([sys.executable, "-c", REPLAY, path, str(tmp_path / "table.pkl")],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    assert out.strip() == f"False {sorted(fingerprint(plan, compiled).items())}"
