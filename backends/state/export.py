"""Trained weights out: `pipeplan export CHECKPOINT -o OUT [--plan PLAN]` (cli/export.py).

A run's checkpoint (backends/state/checkpoint/, DCP) holds every parameter under
the unmodified model's name, `params/<name>` (a DiLoCo run's: the islands'
global parameters of the last sync, `diloco/global/<name>`; its islands'
own parameters are `island<d>/params/<name>`). `read_checkpoint_params` is the
one place that reads it (into plain CPU tensors at full shape, without a
process group: DCP reshards whatever layout the run wrote); the rest of this
module never looks at the checkpoint's layout.

* Without `--plan`: OUT (a `.safetensors` file, else OUT/model.safetensors)
  holds the stored parameters under their names, as stored.
* With `--plan` (the plan that trained it): the names and shapes are checked
  against the plan's model first (every parameter present, nothing extra),
  the model's persistent buffers are added (as the run computed them), and:
  - a Hugging Face model (a `transformers.PreTrainedModel`, e.g. built from a
    config) is written by its own `save_pretrained`: OUT/config.json +
    OUT/model.safetensors, which `from_pretrained(OUT)` loads;
  - any other model gets OUT/model.safetensors with every `state_dict()` key
    (tied names each stored, as `load_state_dict(strict=True)` wants them).

Tensors keep the checkpoint's dtype (the run's precision). The output is
written next to OUT and renamed into place, so a failed export leaves no
half-written OUT.
"""
from __future__ import annotations

import os
import shutil
import warnings

import torch

from ...errors import PipeplanError

PARAMS = "params/"
DILOCO_GLOBAL = "diloco/global/"  # a DiLoCo checkpoint's parameters (checkpoint/islands.py)


class CheckpointError(PipeplanError):
    """A checkpoint that cannot be exported, named with the reason."""


def checkpoint_step_dir(path: str) -> str:
    """`path` itself when it is one checkpoint (holds a manifest or DCP's .metadata), else
    its newest `step_N` folder (a run's checkpoint.dir; a decoupled DiLoCo run's: island
    0's, whose global parameters are the coordinators' own)."""
    from .checkpoint.store import newest

    if any(os.path.isfile(os.path.join(path, f)) for f in (".metadata", "manifest.json")):
        return path
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such checkpoint folder")
    found = newest(path)
    if found is None:
        raise CheckpointError(f"{path}: not a checkpoint (no .metadata) and no step_N "
                              "checkpoint in it")
    return found


def read_checkpoint_params(path: str, check=None) -> dict[str, torch.Tensor]:
    """Every parameter a run's checkpoint holds, by its name in the unmodified model, as full
    CPU tensors (no process group needed). Its files are verified against its manifest
    first (checkpoint/verify.py: a damaged one is refused, the previous intact one
    offered), and nothing of it is unpickled but DCP's allow-listed metadata
    (checkpoint/trusted.py). `check(shapes)`, given {name: shape} from the metadata, runs
    before anything is allocated (it raises to refuse)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from .checkpoint.trusted import NoBytesLoadPlanner, load, read_metadata
    from .checkpoint.verify import verify_offering

    folder = checkpoint_step_dir(path)
    verify_offering(folder, "pipeplan export {} ...")
    keys = read_metadata(folder).state_dict_metadata
    prefix = PARAMS if any(k.startswith(PARAMS) for k in keys) else DILOCO_GLOBAL
    stored = {key[len(prefix):]: md for key, md in keys.items()
              if key.startswith(prefix) and isinstance(md, TensorStorageMetadata)}
    if not stored:
        raise CheckpointError(f"{folder}: the checkpoint holds no parameters ({PARAMS}<name> "
                              f"or {DILOCO_GLOBAL}<name>)")
    if check is not None:
        check({name: tuple(md.size) for name, md in stored.items()})
    state = {prefix + name: torch.empty(tuple(md.size), dtype=md.properties.dtype)
             for name, md in stored.items()}
    with warnings.catch_warnings():  # no process group here, on purpose
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        load(state, folder, NoBytesLoadPlanner(), no_dist=True)
    return {key[len(prefix):]: t for key, t in state.items()}


def check_fits(model: torch.nn.Module, shapes: dict[str, tuple], where: str) -> None:
    """Refuse, naming each tensor, stored parameters that are not exactly `model`'s: every
    parameter present (under one of its tied names) at its shape, nothing else."""
    from .weights import match_names

    found, missing = match_names(model, shapes)
    problems = [f"parameter `{names[0]}` is not in the checkpoint" for names in missing]
    for name, have in found.items():
        want = tuple(model.get_parameter(name).shape)
        if name == have and shapes[have] != want:
            problems.append(f"`{have}` has shape {list(shapes[have])} in the checkpoint, "
                            f"{list(want)} in the model")
    extra = sorted(set(shapes) - set(found) - {n for g in missing for n in g})
    if extra:
        problems.append(f"{len(extra)} tensor(s) the model does not have: "
                        + ", ".join(f"`{n}`" for n in extra[:5]))
    if problems:
        raise CheckpointError(f"{where} does not fit {type(model).__name__}: "
                              + "; ".join(problems[:5]))


def _model_state(model: torch.nn.Module, plan, params: dict[str, torch.Tensor]) -> dict:
    """The full state_dict of the plan's `model` (a skeleton) holding the checked `params`,
    with its persistent buffers as the run computed them."""
    from .materialize import materialize
    from .weights import match_names

    by_name = {n: params[have] for n, have in match_names(model, params)[0].items()}
    buffers = [n for n, _ in model.named_buffers(remove_duplicate=False)]
    materialize(model, plan.train.seed, buffers)
    return {key: by_name[key] if key in by_name else t.detach()
            for key, t in model.state_dict(keep_vars=True).items()}


def _is_hugging_face(model: torch.nn.Module) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return isinstance(model, PreTrainedModel)


def export(checkpoint: str, out: str, plan=None) -> str:
    """Write the checkpoint's trained weights to `out` (see the module docstring); returns
    a one-line description of what was written."""
    from safetensors.torch import save_file

    hf = False
    if plan is not None:
        from ...compiler.capture.loading import load_skeleton

        model = load_skeleton(plan)
        params = read_checkpoint_params(checkpoint, lambda shapes: check_fits(
            model, shapes, f"checkpoint {checkpoint_step_dir(checkpoint)}"))
        state = _model_state(model, plan, params)
        hf = _is_hugging_face(model)
    else:
        state = read_checkpoint_params(checkpoint)
    single_file = not hf and out.endswith(".safetensors")
    tmp = f"{out}.tmp-export"
    shutil.rmtree(tmp, ignore_errors=True)
    if os.path.isfile(tmp):
        os.remove(tmp)
    if hf:
        model.load_state_dict(state, strict=True, assign=True)
        model.save_pretrained(tmp)
        what = f"Hugging Face folder (config.json + safetensors) for {type(model).__name__}"
    else:
        tensors = {}
        for k, t in state.items():  # tied names become separate copies: safetensors wants that
            seen = any(t is v for v in tensors.values())
            tensors[k] = t.clone().contiguous() if seen else t.contiguous()
        target = tmp if single_file else os.path.join(tmp, "model.safetensors")
        os.makedirs(os.path.dirname(os.path.abspath(target)), exist_ok=True)
        save_file(tensors, target, metadata={"format": "pt"})
        what = f"{len(tensors)} tensors"
    if os.path.isdir(out) and not single_file:
        shutil.rmtree(out)
    os.replace(tmp, out)
    return f"{what} -> {out}"
