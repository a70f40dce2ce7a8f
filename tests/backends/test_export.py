"""`pipeplan export` of a model that is not transformers', and what export refuses.

* A GPT (pipeplan's example, a plain torch module) trained under ZeRO-3 over dp2 --
  each rank saved a flat range -- exports every state_dict key at full shape (the
  tied head under both names), loads with `load_state_dict(strict=True)` and gives
  the run's own final parameters; without `--plan` the checkpoint's names go out as
  stored.
* A folder that is not a checkpoint, one without a manifest, or one whose metadata is
  unreadable: exit 2,
  the path and the reason named, no traceback, nothing written.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from pipeplan.cli import main

from .conftest import spawn

TOL = dict(rtol=1e-9, atol=1e-12)


GPT_PLAN = f"""\
model {{
  source = "{Path(__file__).resolve().parents[2] / 'examples/models/gpt.py'}:GPT"
  args = {{ vocab = 32, dim = 16, layers = 2, heads = 2, seq_len = 8 }}
  capture = fx
}}
data = synthetic(seed = 2, vocab = 32, seq_len = 8)
mesh {{ pp = 1, dp = 2 }}
zero = 3
pipeline {{ schedule = gpipe  microbatches = 2 }}
train {{
  steps = 2
  global_batch = 4
  optimizer = adamw(lr = 0.01)
  checkpoint {{ every = 2  dir = "ckpt" }}
}}
"""


def _gpt_run(rank, world, plan_path):
    from pipeplan.backends.state.checkpoint import Checkpointer
    from pipeplan.backends.runtime.trainer import PipelineTrainer
    from pipeplan.dsl.load import load_plan

    plan = load_plan(str(plan_path)).with_resolved_paths()
    trainer = PipelineTrainer.for_plan(plan)
    for t in range(2):
        trainer.step(t)
    Checkpointer(plan, trainer).save(2)
    return {k: v.detach().clone() for k, v in trainer.named_parameters().items()}


def test_export_of_a_torch_model_loads_with_strict_state_dict(tmp_path):
    """A model that is not transformers', trained with ZeRO-3 over dp2 (each rank saved a
    flat range): OUT/model.safetensors holds every state_dict key at full shape (the tied
    head under both names), so the class loads it with strict=True; without --plan the
    checkpoint's names go out as stored."""
    from safetensors.torch import load_file

    from pipeplan.backends.state.model import build_model
    from pipeplan.dsl.load import load_plan

    plan_path = tmp_path / "gpt.plan"
    plan_path.write_text(GPT_PLAN)
    final = spawn(_gpt_run, 2, plan_path, timeout=200)[0]
    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(str(tmp_path / "ckpt" / "step_000002")).read_metadata()
    chunks = [len(m.chunks) for k, m in meta.state_dict_metadata.items()
              if k.startswith("params/")]
    assert max(chunks) > 1  # ZeRO-3: parameters on disk as pieces of two ranks' flat ranges
    assert main(["export", str(tmp_path / "ckpt"), "--plan", str(plan_path),
                 "-o", str(tmp_path / "out")]) == 0
    model = build_model(load_plan(str(plan_path)))  # a fresh model: the init's weights
    model.load_state_dict(load_file(tmp_path / "out" / "model.safetensors"), strict=True)
    tied = {"lm_head.weight": "tok_emb.weight", "tok_emb.weight": "lm_head.weight"}
    run = {k: final[k] if k in final else final[tied[k]] for k in model.state_dict()}
    for name, p in model.named_parameters(remove_duplicate=False):
        assert torch.equal(p, run[name]), name
    twin = build_model(load_plan(str(plan_path)))
    twin.load_state_dict(run, strict=True)  # the run's own final parameters
    x = torch.randint(0, 32, (2, 8))
    torch.testing.assert_close(model(x), twin(x), **TOL)
    assert main(["export", str(tmp_path / "ckpt" / "step_000002"),
                 "-o", str(tmp_path / "raw.safetensors")]) == 0
    raw = load_file(tmp_path / "raw.safetensors")
    assert set(raw) <= set(model.state_dict()) and set(raw) >= set(final) - {"tok_emb.weight",
                                                                            "lm_head.weight"}
    assert all(torch.equal(raw[k], final[k]) for k in raw if k in final)


def test_export_refuses_what_is_not_a_checkpoint(tmp_path, capsys):
    assert main(["export", str(tmp_path / "nothing"), "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "nothing" in err and "no such checkpoint folder" in err and "Traceback" not in err
    (tmp_path / "run" / "step_000004").mkdir(parents=True)
    (tmp_path / "run" / "step_000004" / ".metadata").write_bytes(b"not a pickle")
    assert main(["export", str(tmp_path / "run"), "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err  # no manifest: nothing is read before it is verified
    assert "step_000004: no manifest.json" in err and "Traceback" not in err
    from pipeplan.backends.state.checkpoint.integrity import digest
    files = digest(str(tmp_path / "run" / "step_000004"), [".metadata"])
    (tmp_path / "run" / "step_000004" / "manifest.json").write_text(json.dumps(
        {"format": 2, "step": 4, "parameters": {}, "files": files}))
    assert main(["export", str(tmp_path / "run"), "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err  # its bytes as recorded, but not a pickle DCP wrote
    assert "step_000004/.metadata" in err and "unreadable" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()
