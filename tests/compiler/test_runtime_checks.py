"""What the runtime would refuse after launch is refused at compile time, at the plan line.

compiler/parallel/checks.py runs inside `compile_plan`, so `pipeplan check` (after
tracing), `compile`, and `run` / `verify` before they spawn a process all
refuse these plans with a PlanError pointing at the line that asks for it.
Each case compiles on the meta device; no process group is ever created.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from pipeplan.compiler import compile_plan
from pipeplan.dsl import PlanError, parse_plan

from .test_parallel_plan_errors import _position

MOE = """\
model {
  source = "pipeplan.examples.models.moe_gpt:MoEGPT"
  args = { vocab = 64, dim = 32, layers = 2, heads = 4, seq_len = 16, num_experts = 4 }
}
data = synthetic(seed = 0, vocab = 64, seq_len = 16)
mesh { pp = 2  dp = 2  ep = 2 }
pipeline { microbatches = 2 }
experts {
  modules = [layers.*.moe]
  num_experts = 4
}
train { global_batch = 8 }
"""
DENSE = """\
model {
  source = "pipeplan.examples.models.gpt:GPT"
  args = { vocab = 64, dim = 32, layers = 2, heads = 4, seq_len = 16 }
}
data = synthetic(seed = 0, vocab = 64, seq_len = 16)
mesh { pp = 2  dp = 2 }
pipeline { microbatches = 2 }
zero = 1
train {
  global_batch = 8
}
"""
CHECKPOINT = DENSE.replace("  global_batch = 8\n", "  global_batch = 8\n"
                           "  checkpoint { every = 1  dir = \"ck\" }\n")
MISSING_DATA = DENSE.replace("data = synthetic(seed = 0, vocab = 64, seq_len = 16)",
                             'data = tokens("no-such-tokens.bin", seq_len = 16)')
ALLGATHER = MOE.replace("  num_experts = 4\n}", "  num_experts = 4\n  dispatcher = allgather\n}")
SHARED = MOE.replace("  num_experts = 4\n}", "  num_experts = 4\n  shared_experts = 1\n}")

# (id, plan text, needle: where the error points ("|" marks the column), message start)
CASES = [
    ("missing-data-file", MISSING_DATA, 'data = tokens(|"no-such', "data file /"),
    ("allgather-dispatcher", ALLGATHER, "dispatcher = |allgather",
     "experts.dispatcher = allgather is not implemented"),
    ("shared-experts", SHARED, "shared_experts = |1", "experts.shared_experts is not implemented"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_runtime_refusal_is_a_plan_error_at_compile_time(case, tmp_path):
    _, text, needle, message = case
    with pytest.raises(PlanError) as info:
        compile_plan(parse_plan(text, str(tmp_path / "t.plan")))
    assert not dist.is_initialized()
    found = [(d.span.line, d.span.col, d.message) for d in info.value.diagnostics]
    line, col = _position(text, needle)
    assert (line, col, message) in [(ln, c, m[:len(message)]) for ln, c, m in found], found


def test_the_unedited_plans_compile(tmp_path):
    assert compile_plan(parse_plan(MOE, str(tmp_path / "t.plan"))).experts
    assert compile_plan(parse_plan(DENSE, str(tmp_path / "t.plan"))).stages
    # checkpoints of ZeRO (and TP, EP) shards are no longer refused (backends/state/checkpoint/)
    assert compile_plan(parse_plan(CHECKPOINT, str(tmp_path / "t.plan"))).stages
    tokens = tmp_path / "tokens.bin"
    tokens.write_bytes(bytes(2 * 17 * 8 * 10))  # 10 steps (the default) of 8 windows
    ok = MISSING_DATA.replace("no-such-tokens.bin", "tokens.bin")
    assert compile_plan(parse_plan(ok, str(tmp_path / "t.plan"))).stages


def test_recompute_writing_its_input_in_place_is_refused(tmp_path):
    """backends/runtime/recompute.py's check, on the compiled stage graphs."""
    text = DENSE.replace("zero = 1\n", "zero = 1\nrecompute { inplace = full }\n").replace(
        "pipeplan.examples.models.gpt:GPT", "pipeplan.tests.compiler.test_runtime_checks:Inplace"
    ).replace("args = { vocab = 64, dim = 32, layers = 2, heads = 4, seq_len = 16 }",
              "args = { vocab = 64 }")
    with pytest.raises(PlanError) as info:
        compile_plan(parse_plan(text, str(tmp_path / "t.plan")))
    (d,) = info.value.diagnostics
    assert (d.span.line, d.span.col) == _position(text, "recompute {")
    assert "modifies its input" in d.message


@pytest.mark.parametrize("command", ["check", "compile", "run", "verify"])
def test_every_command_refuses_before_launch_with_exit_2(command, tmp_path):
    """The CLI: the plan-line message on stderr, exit 2, no traceback, no process started."""
    plan = tmp_path / "t.plan"
    plan.write_text(ALLGATHER)
    args = [command, str(plan)] + (["-o", str(tmp_path / "build")] if command == "compile" else [])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run([sys.executable, "-m", "pipeplan", *args], capture_output=True,
                       text=True, timeout=300, cwd=tmp_path, env=env)
    assert r.returncode == 2, r.stdout + r.stderr
    line, col = _position(ALLGATHER, "dispatcher = |allgather")
    assert f"t.plan:{line}:{col}" in r.stderr and "allgather is not implemented" in r.stderr
    assert "Traceback" not in r.stderr and "launching" not in r.stdout


class Inplace(torch.nn.Module):
    """A model whose block adds to its input in place (a recompute would do it twice)."""

    def __init__(self, vocab: int = 64):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, 8)
        self.inplace = _AddInPlace()
        self.head = torch.nn.Linear(8, vocab)

    def forward(self, input_ids):
        return self.head(self.inplace(self.emb(input_ids)))


class _AddInPlace(torch.nn.Module):
    def forward(self, x):
        return x.add_(1.0) * 2


class LongOnly(torch.nn.Module):
    """A layer that acts only on sequences of `window` tokens or more (DeepseekV4's
    compressor reads its gate_proj only once a sequence fills its window)."""

    def __init__(self, vocab: int = 64, window: int = 32):
        super().__init__()
        self.window = window
        self.emb = torch.nn.Embedding(vocab, 8)
        self.pool = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, vocab)

    def forward(self, input_ids):
        x = self.emb(input_ids)
        if input_ids.shape[1] >= self.window:
            x = x + self.pool(x[:, :self.window]).mean(1, keepdim=True)
        return self.head(x)


@pytest.mark.parametrize("seq_len", [16, 32])
def test_parameters_the_forward_never_reads_are_refused_at_the_model_line(tmp_path, seq_len):
    """No stage holds a parameter the captured graph never reads, so no rank would train or
    save it (verify called the run DIFFERENT: "parameters no rank holds"): refused at the
    model line naming them, unless the plan's inputs reach it."""
    text = DENSE.replace("pipeplan.examples.models.gpt:GPT",
                         "pipeplan.tests.compiler.test_runtime_checks:LongOnly").replace(
        "args = { vocab = 64, dim = 32, layers = 2, heads = 4, seq_len = 16 }",
        "args = { vocab = 64 }").replace("seq_len = 16)", f"seq_len = {seq_len})")
    plan = parse_plan(text, str(tmp_path / "t.plan"))
    if seq_len == 32:
        assert compile_plan(plan).stages
        return
    with pytest.raises(PlanError) as info:
        compile_plan(plan)
    (d,) = info.value.diagnostics
    assert (d.span.line, d.span.col) == _position(text, '"pipeplan.tests')
    assert "never reads 2 of its parameters: pool.weight, pool.bias" in d.message


NORMED = """\
model {
  source = "pipeplan.tests.compiler.models:Normed"
  inputs = { input_ids = int64[batch, seq] }
  capture = CAPTURE
}
data = synthetic(seed = 0, vocab = 16, seq_len = 8)
mesh { pp = 2 }
pipeline { microbatches = 2 }
train {
  global_batch = 8
}
"""


def _tiny(capture: str, model: str = "pipeplan.tests.compiler.models:Normed") -> str:
    """NORMED's plan text with `model` captured by `capture`."""
    return NORMED.replace("CAPTURE", capture).replace(
        "pipeplan.tests.compiler.models:Normed", model)


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_buffers_the_forward_writes_are_refused_where_a_rank_would_update_its_own(
        tmp_path, capture):
    """tests/compiler/models.py's Normed (BatchNorm's running statistics, written in place by
    its forward; fx keeps BatchNorm a leaf module, export inlines it): pp2 compiles; dp2 is
    refused at `mesh.dp` (each rank would update its own copy from its share), a recompute
    rule over a norm at its `recompute` line (the rerun forward updates them twice), naming
    the buffers. A model that writes no buffer (the example GPT) is not refused."""
    text = _tiny(capture)
    assert compile_plan(parse_plan(text, str(tmp_path / "t.plan"))).stages
    for changed, needle, said in (
            (text.replace("mesh { pp = 2 }", "mesh { pp = 2  dp = 2 }"), "pp = 2  dp = |2",
             "each of the 2 data-parallel ranks would update its own copy"),
            (text.replace("train {", "recompute {\n  norms.* = selective\n}\ntrain {"),
             "|recompute {", "recompute (selective) of `norms.0` would run its forward twice")):
        with pytest.raises(PlanError) as info:
            compile_plan(parse_plan(changed, str(tmp_path / "t.plan")))
        (d,) = info.value.diagnostics
        assert (d.span.line, d.span.col) == _position(changed, needle), d
        assert "the model's forward writes its own state in place (norms.0.num_batches_tracked"\
               ", norms.0.running_mean, norms.0.running_var" in d.message, d.message
        assert said in d.message, d.message
    assert compile_plan(parse_plan(DENSE, str(tmp_path / "d.plan"))).stages  # dp2, no buffers


class MaxNormed(torch.nn.Module):
    """An Embedding with max_norm: its forward renormalises the rows it reads, in place, in
    the parameter itself (through `weight.contiguous()`)."""

    def __init__(self, vocab: int = 16):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, 8, max_norm=1.0)
        self.mid, self.head = torch.nn.Linear(8, 8), torch.nn.Linear(8, vocab)

    def forward(self, input_ids):
        return self.head(torch.tanh(self.mid(self.emb(input_ids))))


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_a_parameter_the_forward_writes_is_refused_under_data_parallel(tmp_path, capture):
    """dp2 of an Embedding(max_norm) model verified DIFFERENT after check passed (each
    replica renormalised its rows from its own tokens, and the replicas drifted apart): the
    write is found on the parameter's storage and refused at `mesh.dp`; pp2 compiles."""
    text = _tiny(capture, "pipeplan.tests.compiler.test_runtime_checks:MaxNormed")
    assert compile_plan(parse_plan(text, str(tmp_path / "t.plan"))).stages
    dp2 = text.replace("mesh { pp = 2 }", "mesh { pp = 2  dp = 2 }")
    with pytest.raises(PlanError) as info:
        compile_plan(parse_plan(dp2, str(tmp_path / "t.plan")))
    (d,) = info.value.diagnostics
    assert (d.span.line, d.span.col) == _position(dp2, "pp = 2  dp = |2"), d
    assert "writes its own state in place (emb.weight: buffers or parameters" in d.message


def _refused_at_the_model_line(tmp_path, text: str) -> str:
    """Compiling `text` raises one diagnostic, at the model's source: its message."""
    return _refusal_at_the_model_line(tmp_path, text).message


def _refusal_at_the_model_line(tmp_path, text: str, compile=compile_plan):
    """`compile` (compile_plan, or check's compile_for_check) of `text` raises one
    diagnostic, at the model's source: that diagnostic."""
    with pytest.raises(PlanError) as info:
        compile(parse_plan(text, str(tmp_path / "t.plan")))
    (d,) = info.value.diagnostics
    assert (d.span.line, d.span.col) == _position(text, '"pipeplan.tests'), d
    return d


class SparseEmbedded(MaxNormed):
    """An Embedding asked for sparse gradients."""

    def __init__(self, vocab: int = 16):
        super().__init__(vocab)
        self.emb = torch.nn.Embedding(vocab, 8, sparse=True)


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_a_sparse_gradient_is_refused_at_the_model_line(tmp_path, capture):
    """Embedding(sparse=True) passed check and every rank failed in its first backward (the
    gradient norm of a sparse tensor): refused at the model line, naming the weight."""
    text = _tiny(capture, "pipeplan.tests.compiler.test_runtime_checks:SparseEmbedded")
    said = _refused_at_the_model_line(tmp_path, text)
    assert "asks sparse gradients for emb.weight (an Embedding with sparse=True)" in said


class CountsCalls(MaxNormed):
    """A forward that counts its calls in a plain attribute and scales by it (a warm-up
    inside the model), sets another attribute to the value it already has, and creates a
    third on its first call (one-time setup, as transformers marks its lazily installed
    output-capturing hooks)."""

    def __init__(self, vocab: int = 16):
        super().__init__(vocab)
        self.emb = torch.nn.Embedding(vocab, 8)
        self.calls, self.ready = 0, True

    def forward(self, input_ids):
        self.calls += 1
        self.ready = True
        self.hooked = True
        return super().forward(input_ids) * min(1.0, self.calls / 4)


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_a_forward_changing_its_python_attributes_is_refused_at_the_model_line(
        tmp_path, capture):
    """check passed and verify said DIFFERENT (loss 9e-2 off by step 2): the captured graph
    keeps `calls` at the value it read while capturing. Refused at the model line naming the
    attribute, under export too (which puts the attribute back after tracing)."""
    text = _tiny(capture, "pipeplan.tests.compiler.test_runtime_checks:CountsCalls")
    said = _refused_at_the_model_line(tmp_path, text)
    assert "forward changes its own Python attributes: `calls` (0 -> 1) in one call" \
        in said and "ready" not in said and "hooked" not in said, said
    assert torch.nn.Module.__setattr__ is not None and "watched" not in \
        torch.nn.Module.__setattr__.__qualname__  # put back


class Reparametrised(torch.nn.Module):
    """`mid` reparametrised by one of torch's hook-based utilities (`how`), which keep the
    weight as a plain tensor attribute a forward pre-hook recomputes from a parameter; or
    `how` = "hook": a forward hook scaling the output and a plain mask attribute (no
    parameter behind either)."""

    def __init__(self, vocab: int = 16, how: str = "prune"):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, 8)
        self.mid, self.head = torch.nn.Linear(8, 8), torch.nn.Linear(8, vocab)
        if how == "prune":
            import torch.nn.utils.prune as prune
            prune.l1_unstructured(self.mid, "weight", amount=0.5)
        elif how == "spectral_norm":
            self.mid = torch.nn.utils.spectral_norm(self.mid)
        elif how == "weight_norm":
            import warnings
            with warnings.catch_warnings():  # deprecated for the parametrization
                warnings.simplefilter("ignore")
                self.mid = torch.nn.utils.weight_norm(self.mid)
        else:
            self.mid.register_forward_hook(lambda m, i, o: o * 2.0)
            self.mask = torch.ones(8)

    def forward(self, input_ids):
        return self.head(torch.tanh(self.mid(self.emb(input_ids))))


@pytest.mark.parametrize("how", ["prune", "spectral_norm", "weight_norm", "hook"])
def test_a_weight_recomputed_by_a_pre_hook_is_refused_at_the_model_line(tmp_path, how):
    """torch.nn.utils.prune, spectral_norm and the old weight_norm keep `mid.weight` as a plain
    tensor made from a parameter (computed from it, or its `.data`) that a forward pre-hook
    recomputes: check passed, and every rank failed in setup (a non-leaf tensor cannot be
    deep-copied). Refused at the model line naming the module and the attribute. A forward
    hook and a plain tensor attribute made from no parameter compile."""
    text = _tiny("fx", "pipeplan.tests.compiler.test_runtime_checks:Reparametrised").replace(
        "  inputs", f'  args = {{ how = "{how}" }}\n  inputs')
    if how == "hook":
        assert compile_plan(parse_plan(text, str(tmp_path / "t.plan"))).stages
        return
    assert "module `mid` (Linear) holds `weight`, a tensor made from its parameters" \
        in _refused_at_the_model_line(tmp_path, text)


class ParametrizedNorm(torch.nn.Module):
    """`mid.weight` parametrized by torch.nn.utils.parametrizations.weight_norm (its
    originals computed from the Linear's draw at registration); with `init`, the model's
    `_init_weights` draws them (the hint's remedy)."""

    def __init__(self, vocab: int = 16, init: bool = False):
        super().__init__()
        from torch.nn.utils.parametrizations import weight_norm
        self.emb = torch.nn.Embedding(vocab, 8)
        self.mid, self.head = weight_norm(torch.nn.Linear(8, 8)), torch.nn.Linear(8, vocab)
        if init:
            self._init_weights = self._draw_originals

    def _draw_originals(self, module):
        from torch.nn.utils.parametrize import ParametrizationList
        if isinstance(module, ParametrizationList):
            for p in module.parameters():
                torch.nn.init.normal_(p, 0.0, 0.3)

    def forward(self, input_ids):
        return self.head(torch.tanh(self.mid(self.emb(input_ids))))


def test_a_parametrized_weight_is_refused_naming_the_parametrization(tmp_path):
    """weight_norm of torch.nn.utils.parametrizations: the constructor computes `original0`
    (the norm) from the Linear's own draw, which no per-module rule replays. Refused at the
    model line naming the parametrized tensor, its parametrization and the original; the
    hint (torch's ParametrizationList takes no reset_parameters of the user's) was "give
    ParametrizationList a reset_parameters()". With an `_init_weights` that draws the
    originals, the plan compiles."""
    from pipeplan.compiler import compile_for_check
    text = _tiny("fx", "pipeplan.tests.compiler.test_runtime_checks:ParametrizedNorm")
    d = _refusal_at_the_model_line(tmp_path, text, compile_for_check)
    assert "`mid.weight` is parametrized (_WeightNorm" in d.message, d.message
    assert "original0 of module `mid.parametrizations.weight` was computed" in d.message
    assert "ParametrizationList" in d.hint and "reset_parameters" not in d.hint, d.hint
    text = text.replace("  inputs", "  args = { init = true }\n  inputs")
    assert compile_for_check(parse_plan(text, str(tmp_path / "t.plan"))).stages
