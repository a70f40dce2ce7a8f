"""Pretrained weights in (`model.weights`), trained weights out (`pipeplan export`).

The weights are transformers' own: a tiny LlamaForCausalLM with tied embeddings
(its checkpoint omits `lm_head.weight`) drawn under another seed and written by
`save_pretrained`, once as one file and once in six shards with an index. The
references share no code with pipeplan: transformers' `from_pretrained` in
float64 and torch's cross entropy.

* One 2-process pp2 run (sharded folder, fp64, AdamW, a checkpoint after the
  last step) shows: step 1's loss equals the unpipelined model's on the same
  weights; each rank opened the safetensors files for exactly the tensors of
  its own stage (the tied embedding is read by both ranks that hold it, under
  its stored name); `pipeplan export` of the checkpoint loads with
  `from_pretrained` and gives the logits of the run's final parameters. In the
  same processes, a tp2 run from the single file: each rank read (recorded at
  `get_slice`) exactly its half of every column/row-parallel weight, never the
  whole tensor, and its first loss equals the same reference.
* `pipeplan verify`'s reference (`build_model`) starts from the file too.
* Bad weights stop `pipeplan check` with exit 2, the file and tensor named, a
  caret under the plan line, no traceback.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pipeplan.cli import main

from .conftest import spawn

ARGS = {"vocab": 64, "dim": 32, "layers": 2, "tie": True}
TOL = dict(rtol=1e-9, atol=1e-12)
STEPS = 3

MODEL = """\
model {{
  source = "pipeplan.tests.compiler.models:tiny_llama"
  args = {{ vocab = 64, dim = 32, layers = 2, tie = true }}
  capture = export
  weights = "{weights}"
}}
data = synthetic(seed = 3, vocab = 64, seq_len = 16)
"""
PLAN = MODEL + """\
mesh {{ pp = 2 }}
pipeline {{ schedule = 1f1b, microbatches = 4 }}
train {{
  steps = {steps}
  global_batch = 8
  precision = fp64
  optimizer = adamw(lr = 0.01)
  checkpoint {{ every = {steps}, dir = "ckpt" }}
}}
"""


def hf_llama(seed: int = 123):
    from pipeplan.tests.compiler.models import tiny_llama

    torch.manual_seed(seed)  # not pipeplan's per-module seeds: loading must show
    return tiny_llama(**ARGS)


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> Path:
    """A folder with `single/` (model.safetensors) and `sharded/` (index + 6 shards)."""
    root = tmp_path_factory.mktemp("pretrained")
    model = hf_llama()
    model.save_pretrained(root / "single")
    model.save_pretrained(root / "sharded", max_shard_size="20KB")
    assert len(list((root / "sharded").glob("*.safetensors"))) > 2
    assert (root / "sharded" / "model.safetensors.index.json").is_file()
    return root


# tp2: Megatron's column/row pairs (the tied embedding and head stay whole)
COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW = ("o_proj", "down_proj")
TP_PLAN = MODEL + """\
mesh {{ tp = 2 }}
pipeline {{ schedule = gpipe, microbatches = 2 }}
tensor {{
  column = [model.layers.*.self_attn.q_proj, model.layers.*.self_attn.k_proj,
            model.layers.*.self_attn.v_proj, model.layers.*.mlp.gate_proj,
            model.layers.*.mlp.up_proj]
  row = [model.layers.*.self_attn.o_proj, model.layers.*.mlp.down_proj]
}}
train {{
  steps = 1
  global_batch = 8
  precision = fp64
  optimizer = adamw(lr = 0.01)
}}
"""


def write_plan(folder: Path, weights: str, steps: int = STEPS, text: str = PLAN,
               name: str = "w.plan") -> Path:
    path = folder / name
    path.write_text(text.format(weights=weights, steps=steps))
    return path


def file_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in folder.glob("*.safetensors"):
        out.update(load_file(f))
    return out


# --------------------------------------------------------- one pp2 run, several checks
def _recording_safe_open(log: list):
    """safetensors.safe_open, recording every read through it: (stored name, None) for a
    whole tensor, (stored name, ((start, stop) per indexed dim), shape read) for a slice."""
    import safetensors

    real = safetensors.safe_open

    class Piece:
        def __init__(self, name, piece):
            self._name, self._piece = name, piece

        def __getitem__(self, index):
            got = self._piece[index]
            log.append((self._name, tuple((s.start, s.stop) for s in index), tuple(got.shape)))
            return got

    class Handle:
        def __init__(self, *a, **k):
            self._h = real(*a, **k)

        def get_tensor(self, name):
            log.append((name, None))
            return self._h.get_tensor(name)

        def get_slice(self, name):
            return Piece(name, self._h.get_slice(name))

    return Handle


def _train_and_checkpoint(rank, world, plan_path, tp_plan_path):
    """The pp2 run (3 steps, a checkpoint), then, in the same processes, one tp2 step."""
    import safetensors

    from pipeplan.backends.state.checkpoint import Checkpointer
    from pipeplan.backends.runtime.trainer import PipelineTrainer
    from pipeplan.backends.verify.run import rank_result
    from pipeplan.dsl.load import load_plan

    real = safetensors.safe_open
    plan = load_plan(str(plan_path)).with_resolved_paths()
    read: list = []
    safetensors.safe_open = _recording_safe_open(read)
    trainer = PipelineTrainer.for_plan(plan)
    own = sorted(trainer.parameters_by_name())
    losses = [trainer.step(t).loss for t in range(STEPS)]
    Checkpointer(plan, trainer).save(STEPS)
    out = dict(rank_result(losses, trainer, None), read=[name for name, *_ in read], own=own)
    tp_read: list = []
    safetensors.safe_open = _recording_safe_open(tp_read)
    tp = PipelineTrainer.for_plan(load_plan(str(tp_plan_path)).with_resolved_paths())
    safetensors.safe_open = real
    return dict(out, tp_loss=tp.step(0).loss, tp_read=tp_read)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_pretrained_pp2_first_loss_rank_reads_and_export_round_trip(pretrained, tmp_path):
    from transformers import LlamaForCausalLM

    from pipeplan.backends.runtime import data
    from pipeplan.dsl.load import load_plan

    plan_path = write_plan(tmp_path, str(pretrained / "sharded"))
    tp_plan = write_plan(tmp_path, str(pretrained / "single"), text=TP_PLAN, name="tp.plan")
    results = spawn(_train_and_checkpoint, 2, plan_path, tp_plan, timeout=360)
    plan = load_plan(str(plan_path))

    # 1. step 1's loss is the unpipelined model's on the same weights (float64)
    ref = LlamaForCausalLM.from_pretrained(pretrained / "sharded", dtype=torch.float64)
    batch = data.global_batch(plan, 0)
    with torch.no_grad():
        logits = ref(batch.input_ids).logits
    expected = float(F.cross_entropy(logits.flatten(0, 1), batch.targets.flatten()))
    got = results[0]["losses"][0]
    assert got == pytest.approx(expected, rel=TOL["rtol"], abs=TOL["atol"])
    assert results[1]["losses"] == results[0]["losses"]

    # 2. each rank read exactly the stored tensors of its own stage, each once per name
    stored = file_tensors(pretrained / "sharded")
    tied = {"lm_head.weight": "model.embed_tokens.weight"}  # what the checkpoint omits
    for r in results:
        want = {tied.get(n, n) for n in r["own"]}
        assert set(r["read"]) == want
        assert want <= set(stored)
    assert set(results[0]["read"]) | set(results[1]["read"]) == set(stored)
    assert set(results[0]["read"]) & set(results[1]["read"]) == {"model.embed_tokens.weight"}
    assert "model.layers.1.mlp.up_proj.weight" not in results[0]["read"]
    assert "model.layers.0.mlp.up_proj.weight" not in results[1]["read"]

    # 2b. tp2 from the single file: each rank read its own rows (column-parallel weights)
    # or columns (row-parallel weights) of every split weight, never the whole tensor;
    # the replicated ones (norms, tied embedding) whole; the same first loss
    for rank, r in enumerate(results):
        assert r["tp_loss"] == pytest.approx(expected, rel=TOL["rtol"], abs=TOL["atol"])
        want = set()
        for name, full in stored.items():
            half = full.shape[0] // 2 if full.dim() else 0
            mine = (rank * half, (rank + 1) * half)
            if name.rsplit(".", 2)[-2] in COLUMN:
                want.add((name, (mine,), (half, full.shape[1])))
            elif name.rsplit(".", 2)[-2] in ROW:
                half = full.shape[1] // 2
                mine = (rank * half, (rank + 1) * half)
                want.add((name, ((None, None), mine), (full.shape[0], half)))
            else:
                want.add((name, None))
        assert set(r["tp_read"]) == want, rank
        assert len(r["tp_read"]) == len(want), rank  # each read once (the head is tied)
        assert sum(len(w) == 3 for w in want) == 2 * 7  # 7 split weights per layer

    # 3. export the checkpoint: from_pretrained gives the final pipelined parameters' logits
    out = tmp_path / "exported"
    assert main(["export", str(tmp_path / "ckpt"), "--plan", str(plan_path),
                 "-o", str(out)]) == 0
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    exported = LlamaForCausalLM.from_pretrained(out, dtype=torch.float64)
    final = {}
    for r in results:
        final.update(r["params"])
    twin = hf_llama(seed=0).double()
    state = {k: final[k] if k in final else final["lm_head.weight"] for k in twin.state_dict()}
    twin.load_state_dict(state, strict=True)  # the run's own final parameters
    x = data.global_batch(plan, STEPS).input_ids
    with torch.no_grad():
        a, b = exported(x).logits, twin(x).logits
    torch.testing.assert_close(a, b, **TOL)
    for name, t in exported.state_dict().items():  # trained: not the pretrained values
        if name in stored and "norm" not in name:
            assert not torch.equal(t.float(), stored[name]), name


# --------------------------------------------------------- in process
def test_the_reference_starts_from_the_file(pretrained, tmp_path):
    """`pipeplan verify`'s reference (`build_model`) holds the file's values, not the init;
    a single file (relative to the plan file) and a sharded folder give the same model."""
    import dataclasses
    import os

    from pipeplan.backends.state.model import build_model
    from pipeplan.dsl.load import load_plan

    stored = file_tensors(pretrained / "single")
    for weights in (os.path.relpath(pretrained / "single", tmp_path), str(pretrained / "sharded")):
        plan = load_plan(str(write_plan(tmp_path, weights)))
        model = build_model(plan)
        for name, p in model.named_parameters(remove_duplicate=False):
            key = "model.embed_tokens.weight" if name == "lm_head.weight" else name
            assert torch.equal(p, stored[key]), name
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    init = build_model(dataclasses.replace(plan, model=dataclasses.replace(plan.model,
                                                                           weights=None)))
    key = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(init.get_parameter(key), stored[key])


def test_a_slice_reads_only_that_part(pretrained):
    from pipeplan.backends.state.weights import WeightSource
    from pipeplan.compiler.weights import catalogue

    model = hf_llama()
    source = WeightSource(catalogue(str(pretrained / "sharded")), model)
    full = model.get_parameter("model.layers.1.mlp.down_proj.weight")
    part = source.read("model.layers.1.mlp.down_proj.weight", (slice(None), slice(16, 32)))
    assert torch.equal(part, full[:, 16:32]) and part.shape == (32, 16)
    assert torch.equal(source["lm_head.weight"], model.lm_head.weight)  # via its tied name
    assert source.names_read == ["model.layers.1.mlp.down_proj.weight",
                                 "model.embed_tokens.weight"]


def test_fill_reads_a_shard_from_the_source_in_the_target_dtype(pretrained):
    """`fill` with a source: an EP-like block of rows and a TP-like block of columns, each
    read as that part (no init drawn, no `values`), cast to the target's float64."""
    from pipeplan.backends.state.materialize import FlatTarget, Slice, fill, sliced_parameter
    from pipeplan.backends.state.weights import WeightSource
    from pipeplan.compiler.weights import catalogue

    model = hf_llama()
    source = WeightSource(catalogue(str(pretrained / "single")), model)
    up, down = "model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.down_proj.weight"
    meta = {n: torch.nn.Parameter(torch.empty(model.get_parameter(n).shape,
                                              dtype=torch.float64, device="meta"))
            for n in (up, down)}
    rows, cols = sliced_parameter(meta[up], 0, 16, 48), sliced_parameter(meta[down], 1, 32, 32)
    nbytes = fill({up: [rows], down: [cols]}, [], source=source)
    assert torch.equal(rows, model.get_parameter(up)[16:64].double())
    assert torch.equal(cols, model.get_parameter(down)[:, 32:64].double())
    assert rows.dtype == cols.dtype == torch.float64 and nbytes == (48 * 32 + 32 * 32) * 8
    assert source.names_read == [up, down]
    # A ZeRO-3 rank's flat shard: elements [5, 40) of the TP slice, read as the slice alone
    buf = torch.zeros(35, dtype=torch.float64)
    flat = {down: [FlatTarget(Slice(1, 32, 32), 5, 40, buf)]}
    assert fill({}, [], source=source, flat=flat) == 0
    assert torch.equal(buf, model.get_parameter(down)[:, 32:64].double().reshape(-1)[5:40])
    assert source.names_read == [up, down, down]


# --------------------------------------------------------- bad weights, before launch
def _save(folder: Path, tensors: dict) -> str:
    from safetensors.torch import save_file

    folder.mkdir()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return str(folder / "model.safetensors")


def _bad_weights(case: str, good: Path, tmp: Path) -> tuple[str, list[str]]:
    """(weights path for the plan, what the message must name) for one bad-input case."""
    stored = file_tensors(good)
    raw = (good / "model.safetensors").read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    if case == "missing-file":
        return "no/such/weights", ["no/such/weights", "no such file"]
    if case == "missing-tensor":
        del stored["model.norm.weight"]
        return _save(tmp / case, stored), ["model.safetensors", "`model.norm.weight`", "not stored"]
    if case == "wrong-shape":
        stored["model.layers.1.mlp.up_proj.weight"] = torch.zeros(64, 31)
        return _save(tmp / case, stored), ["model.safetensors",
                                           "`model.layers.1.mlp.up_proj.weight`", "[64, 31]"]
    if case == "wrong-dtype":
        stored["model.norm.weight"] = torch.zeros(32, dtype=torch.int32)
        return _save(tmp / case, stored), ["model.safetensors", "`model.norm.weight`", "I32"]
    if case == "extra-tensor":
        stored["model.layers.2.mlp.up_proj.weight"] = torch.zeros(64, 32)
        return _save(tmp / case, stored), ["model.safetensors",
                                           "`model.layers.2.mlp.up_proj.weight`", "does not have"]
    path = tmp / f"{case}.safetensors"
    if case == "header-size":  # a header length beyond the file: refused before reading it
        path.write_bytes(struct.pack("<Q", 2**60) + raw[8:])
        return str(path), [path.name, "corrupted header", "header bytes"]
    if case == "header-json":
        path.write_bytes(raw[:8] + b"{" * n + raw[8 + n:])
        return str(path), [path.name, "corrupted header", "not JSON"]
    if case == "truncated":
        path.write_bytes(raw[:len(raw) - 100])
        return str(path), [path.name, "corrupted header", "truncated"]
    if case == "index-shard":
        folder = tmp / case
        folder.mkdir()
        index = {"metadata": {}, "weight_map": {k: "model-00001-of-00002.safetensors"
                                                for k in stored}}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
        return str(folder), ["model.safetensors.index.json", "model-00001-of-00002.safetensors"]
    raise AssertionError(case)


CASES = ("missing-file", "missing-tensor", "wrong-shape", "wrong-dtype", "extra-tensor",
         "header-size", "header-json", "truncated", "index-shard")


def test_bad_weights_stop_check_at_the_plan_line(pretrained, tmp_path, capsys):
    """Each case: exit 2, the file and the tensor named, a caret under `weights = ...`,
    no traceback; before any tracing (headers only)."""
    failures = []
    for case in CASES:
        weights, named = _bad_weights(case, pretrained / "single", tmp_path)
        plan = write_plan(tmp_path, weights)
        code = main(["check", str(plan)])
        err = capsys.readouterr().err
        caret = any(line.strip().startswith("^") for line in err.splitlines())
        missing = [s for s in named if s not in err]
        if code != 2 or missing or "Traceback" in err or "weights = " not in err or not caret:
            failures.append(f"{case}: exit {code}, missing {missing}:\n{err}")
    assert not failures, "\n".join(failures)
    # without the model (--no-model) the files and headers are still checked
    corrupted = tmp_path / "header-json.safetensors"  # written above
    assert main(["check", str(write_plan(tmp_path, str(corrupted))), "--no-model"]) == 2
    assert "header-json.safetensors: corrupted header" in capsys.readouterr().err
