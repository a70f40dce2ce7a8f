"""Pretrained weights in: `model { weights = "DIR_OR_FILE" }`, safetensors read lazily per rank.

The plan names a single `.safetensors` file or a Hugging Face `save_pretrained`
folder (`model.safetensors`, or shards listed by `model.safetensors.index.json`),
relative to the plan file. Three pieces, used in this order:

* `catalogue(path)`: every stored tensor's file, dtype and shape, read from the
  file headers only (each header's size is bounded and checked against the file
  before it is read; nothing is allocated for tensor data).
* `check_weights(plan, model)` (compile time, so `pipeplan check`, `compile`,
  `run` and `verify` refuse before any process starts): every parameter of the
  model is stored, under its own name or under a name it is tied to (a Hugging
  Face checkpoint omits a tied `lm_head.weight`), with the model's shape and a
  dtype that casts to the model's (floating to floating, integral to integral).
  A stored tensor that is neither a parameter nor a buffer of the model is an
  error too, as in `load_state_dict(strict=True)`: it means the file is another
  model's (more layers, another prefix), which a warning would let train.
  Buffers are optional: their values are the constructor's (as the run computes
  them); a stored one must have the model's shape.
* `weights_source(plan, model)`: what `backends/state/materialize.py` reads instead of
  the init, a mapping from the model's names to tensors that opens a file
  (`safetensors.safe_open`) only when a name it holds is asked for, so a rank
  reads exactly the tensors of the stages it owns. A rank's stages are filled
  through `read(name, index)` (`materialize.fill(..., source=...)`): a TP/EP
  shard reads only its slice through `get_slice`, never the rest of the tensor;
  the single-process reference (`materialize(..., source=...)`) reads whole
  tensors.

Values are cast to the model's constructed dtype, then to the plan's precision
like the init's values, so the pipelined run and the reference of `pipeplan
verify` (both materialise through this source) start from the same weights.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Iterator, Optional

import torch
from torch import nn

from ...dsl.ast import Plan
from ...compiler.weights import (Stored, WeightsFileError, catalogue, match_names,
                                 weight_problems, weights_path)


# safetensors dtype code -> (torch dtype, bytes per element)


# ------------------------------------------------------------- headers only


# ------------------------------------------------------------- the model's names


# ------------------------------------------------------------- reading, per rank
class WeightSource(Mapping):
    """The model's names -> stored tensors, read on demand (see the module docstring).

    `names_read` lists the stored names actually read, in order."""

    def __init__(self, stored: Mapping[str, Stored], model: nn.Module):
        self.stored = stored
        self._key: dict[str, str] = match_names(model, stored)[0]  # model name -> stored name
        self._dtype = {n: p.dtype for n, p in model.named_parameters(remove_duplicate=False)}
        self._files: dict[str, object] = {}
        self.names_read: list[str] = []

    def __contains__(self, name) -> bool:
        return name in self._key

    def __iter__(self) -> Iterator[str]:
        return iter(self._key)

    def __len__(self) -> int:
        return len(self._key)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.read(name)

    def read(self, name: str, index=None) -> torch.Tensor:
        """The stored tensor for the model's `name`, cast to the model's constructed dtype;
        with `index` (a tuple of slices, as for `tensor[index]`) only that part is read
        (safetensors' `get_slice`: a TP / EP shard never reads the rest of the tensor)."""
        key = self._key[name]
        handle = self._open(self.stored[key].file)
        self.names_read.append(key)
        value = handle.get_tensor(key) if index is None else handle.get_slice(key)[index]
        return value.to(self._dtype[name])

    def _open(self, file: str):
        if file not in self._files:
            from safetensors import safe_open

            try:
                self._files[file] = safe_open(file, framework="pt", device="cpu")
            except Exception as e:  # the header was checked; the file changed since
                raise WeightsFileError(f"{file}: cannot be read: {e}") from None
        return self._files[file]


def weights_source(plan: Plan, model: nn.Module) -> Optional[WeightSource]:
    """The plan's weights for `model` (its skeleton), None when the plan names none. Checked
    again here (headers only): the files may have changed since `pipeplan check`."""
    if plan.model.weights is None:
        return None
    stored = catalogue(weights_path(plan))
    problems = weight_problems(stored, model, weights_path(plan))
    if problems:
        raise WeightsFileError("; ".join(problems[:3]))
    return WeightSource(stored, model)
