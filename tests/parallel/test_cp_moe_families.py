"""transformers MoE families under context parallel, verified as a user would (`-m heavy`,
minutes each): `pipeplan check` then `pipeplan verify --steps 2` (float64) on tiny configs
whose attention builds no mask tensor (families.CAUSAL_SDPA) and which take their
positions from the data, so the experts, routers and RoPE decide (cp_rows.py, cp_rules.py):

* Mixtral cp2 ring and Qwen3-MoE cp2 Ulysses (the sort-free batched_mm experts verify
  runs in float64): EQUAL in float64;
* DeepSeek-V3 cp2 ring (router group mask by `scatter_`, router in float32 on purpose):
  EQUAL under the stated fp32-island rule, which names the float32 nodes that set it;
* Llama 4 text cp2 ring (complex RoPE: view_as_complex / view_as_real): EQUAL in float64.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

PLAN = """\
model {{
  source = "pipeplan.tests.parallel.families:{factory}"
  args = {{ layers = 2 }}
  inputs = {{ input_ids = int64[batch, seq], position_ids = int64[batch, seq] }}
  capture = export
}}
data = synthetic(seed = 7, vocab = 64, seq_len = 16, inputs = {{ position_ids = positions }})
mesh {{ cp = 2 }}
context {{ method = {method} }}
pipeline {{ schedule = 1f1b, microbatches = 2 }}
train {{ steps = 2, global_batch = 4, grad_clip = 0.5, optimizer = adamw(lr = 0.003, weight_decay = 0.1), seed = 11 }}
"""


def pipeplan(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "pipeplan", *args], capture_output=True,
                          text=True, timeout=1500, env={**os.environ})
    said = done.stdout + done.stderr
    assert done.returncode == 0 and "Traceback" not in said, said
    return said


@pytest.mark.heavy
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("factory, method, rule", [
    ("mixtral_causal", "ring", "(fp64)"),
    ("qwen3_moe_causal", "ulysses", "(fp64)"),
    ("deepseek_v3", "ring", "(fp32-island)"),
    ("llama4_text_causal", "ring", "(fp64)"),
])
def test_moe_family_under_cp_verifies_equal(factory, method, rule, tmp_path):
    path = tmp_path / f"{factory}.plan"
    path.write_text(PLAN.format(factory=factory, method=method))
    pipeplan("check", str(path))
    said = pipeplan("verify", str(path), "--steps", "2")
    assert f"EQUAL to single-process training {rule}" in said, said
    if rule == "(fp32-island)":  # the judge says which float32 nodes set the tolerance
        assert "rule fp32-island" in said and "narrows to float32 at" in said, said


@pytest.mark.heavy
@pytest.mark.parametrize("factory", ["mixtral_causal", "qwen3_moe_causal"])
def test_default_grouped_mm_experts_pass_the_locality_check(factory):
    """fp32 plans keep transformers' default grouped_mm experts: sort the slots by expert,
    gather rows, grouped matmul by the sorted keys' counts, inverse permutation -- proven
    per token (compile_plan accepts cp2; the float64 path above runs batched_mm)."""
    from pipeplan.compiler import compile_plan
    from pipeplan.dsl import parse_plan

    text = PLAN.format(factory=factory, method="ring").replace(", seed = 11 }",
                                                                 ", seed = 11, precision = fp32 }")
    compiled = compile_plan(parse_plan(text, "moe.plan"))
    names = {str(n.target) for s in compiled.stages for n in s.module.graph.nodes}
    assert any("grouped_mm" in t for t in names) and any("sort" in t for t in names), names
