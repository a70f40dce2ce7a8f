"""The planner's estimate of a candidate equals `pipeplan check`'s for the plan it writes.

The model is the calibration table's (tests/benchmarks/calibration/megatron_gpt.py: the
unfused attention core and dropout Narayanan et al. 2021 ran, a tied vocabulary split by
tp), at a tiny shape, bf16, on the A100 profile: the model the Table 1 benchmark plans.
Each candidate is written as `pipeplan plan -o` writes it (report.plan_text), read back and
compiled on its own (its own capture at its own microbatch size, its own split and
estimate); step time and peak bytes must agree. The candidates cover every schedule family,
interleaving, sequence parallel, each recompute mode (on every rank, and on the first ranks
only), `auto` under a memory limit, ZeRO 0-3 and microbatch sizes the planner never captured (4, 8: read off its line through sizes 2 and 3).
"""
from __future__ import annotations

import dataclasses
import os

import pytest

from pipeplan.compiler import compile_plan
from pipeplan.compiler.estimate.device import device_model
from pipeplan.dsl.ast import MeshSpec
from pipeplan.dsl.load import load_plan
from pipeplan.planner.cost import predict
from pipeplan.planner.report import plan_text
from pipeplan.planner.search import Ranked, SearchResult
from pipeplan.planner.space import Candidate
from pipeplan.planner.units import measure

HERE = os.path.dirname(os.path.abspath(__file__))
MEGATRON = os.path.join(HERE, "..", "benchmarks", "calibration", "megatron_gpt.py")
PLAN = f"""model {{
  source = "{os.path.abspath(MEGATRON)}:GPT"
  args = {{ vocab = 64, dim = 32, layers = 4, heads = 4, seq_len = 32 }}
  capture = fx
  leaf_modules = ["layers.*.drop1", "layers.*.drop2", "layers.*.attn.drop"]
}}
data = synthetic(seed = 0, vocab = 64, seq_len = 32)
mesh {{ tp = 2 }}
tensor {{
  column = ["layers.*.attn.q", "layers.*.attn.k", "layers.*.attn.v", "layers.*.mlp.up"]
  row = ["layers.*.attn.proj", "layers.*.mlp.down"]
  vocab = ["tok_emb", "lm_head"]
}}
train {{ global_batch = 32  precision = bf16 }}
device {{ name = a100  ranks_per_node = 4 }}
"""
# pp dp tp cp ep schedule virtual mbs microbatches sp recompute zero
CANDIDATES = [
    Candidate(2, 2, 2, 1, 1, "interleaved", 2, 4, 4, True, "full", 1),
    Candidate(2, 2, 2, 1, 1, "zbv", 2, 2, 8, False, "selective", 0),
    Candidate(2, 4, 1, 1, 1, "1f1b", 1, 4, 2, False, "none", 2),
    Candidate(4, 1, 2, 1, 1, "zbh1", 1, 8, 4, True, "none", 0),
    Candidate(2, 2, 2, 1, 1, "dualpipev", 2, 1, 16, False, "full", 3),
    Candidate(1, 4, 2, 1, 1, "gpipe", 1, 8, 1, True, "selective", 1),
    # recompute on the first ranks only (search.recompute_where_it_pays): per-layer rules
    Candidate(4, 1, 2, 1, 1, "1f1b", 1, 2, 16, False, "full", 0, (), 2),
    Candidate(2, 2, 2, 1, 1, "zbv", 2, 2, 8, True, "selective", 1, (), 1),
    # auto under the memory limit the search gives it (the plan's pipeline.memory_limit)
    Candidate(2, 2, 2, 1, 1, "auto", 2, 2, 8, True, "none", 1, (), 0, 2),
    Candidate(4, 1, 2, 1, 1, "auto", 1, 2, 16, False, "full", 0, (), 0, 1),
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = tmp_path_factory.mktemp("agree") / "megatron.plan"
    path.write_text(PLAN)
    plan = load_plan(str(path))
    units = measure(plan, (1, 2), (1,), "layers.*")
    device = device_model(dataclasses.replace(plan, mesh=MeshSpec(pp=1, dp=8)))
    return plan, units, device


def _peak(est) -> int:
    return est.peak_bytes


@pytest.mark.parametrize("cand", CANDIDATES, ids=lambda c: c.label().replace(" ", "-"))
def test_written_plan_is_estimated_as_the_planner_predicted(setup, cand, tmp_path):
    plan, units, device = setup
    p = predict(units, cand, device)
    result = SearchResult([Ranked(dataclasses.replace(cand, split=p.split), p)],
                          units, capacity=1e12, gpus=8)
    out = tmp_path / "best.plan"
    text = plan_text(plan, result, 0, "test", device.flops_per_s)
    assert ("#   pipeline.memory_limit = " in text) == bool(cand.memory_limit)
    out.write_text(text)
    written = load_plan(str(out), world_size=8)
    assert (written.mesh.pp, written.mesh.tp, written.pipeline.schedule,
            written.pipeline.microbatches, written.zero) == \
        (cand.pp, cand.tp, cand.schedule, cand.microbatches, cand.zero)
    limit = written.pipeline.memory_limit
    assert (limit.amount, limit.in_bytes) == (cand.memory_limit, False) if cand.memory_limit \
        else limit is None
    if cand.rc_ranks:  # per-layer rules, on some layers only (the rest run without)
        assert 0 < len(written.recompute) < 4
        assert {r.mode for r in written.recompute} == {cand.recompute}
    est = compile_plan(written).estimates
    assert est.step_time_s == pytest.approx(p.step_time_s, rel=1e-9, abs=0)
    assert _peak(est) == p.peak_bytes
