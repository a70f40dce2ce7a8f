"""Training data: the global batch of step t, and how DP ranks and microbatches share it.

Step t's global batch is `train.global_batch` rows of `seq_len + 1` tokens,
a pure function of (data spec, t) -- so a resumed run reads exactly the windows the
uninterrupted one would: synthetic tokens from a seeded torch.Generator (a
learnable stream, see `_synthetic_rows`), sequential windows of a memory-mapped
token file (.bin of uint16, or .npy; checked before launch by
compiler/data.py), or windows of the token file tokenised from text
(`data = text(...)`, compiler/text.py) in a seeded order per epoch; an
evaluation reads the text's held-out windows (`eval_batch`). input_ids = row[:-1], targets = row[1:]; the
model's inputs are fields made from them (see Batch).

Sharing (the same for the pipelined run and the reference): DP rank d takes
rows [d*B/dp, (d+1)*B/dp); its microbatch i is the i-th equal chunk of those.
So chunk c = d*m + i of the global batch is DP rank d's microbatch i.
With context parallel (mesh.cp > 1), cp rank c of that DP rank takes columns
`cp_columns` of each of its microbatches (tokens and targets): [c*S/cp, (c+1)*S/cp) for
Ulysses, chunks c and 2cp-1-c of 2cp for ring attention (backends/parallel/cp/ring.py);
its `positions` field holds the global positions of those columns.
"""
from __future__ import annotations

from dataclasses import dataclass
from dataclasses import field as dataclass_field
from functools import lru_cache
from typing import Optional

import numpy as np
import torch

from ...dsl.ast import DataSpec, Plan
from ...errors import PipeplanError
from ...compiler.data import open_token_file, resolve_data_path


@dataclass(frozen=True)
class Batch:
    """Rows of a batch; any slice of it is again a Batch.

    A batch is a token window per row; every other field a stage reads is made
    from it (`DATA_FIELDS` in dsl/schema.py, bound to the model's inputs by
    `DataSpec.feeds`): tokens (row[:-1]), targets (row[1:]), positions
    (0..seq_len-1 in every row), document_positions (restarting at 0 after each
    end-of-document token `eos`: text data) and mask (ones of the input's declared shape).
    """

    input_ids: torch.Tensor  # [rows, seq_len] int64: the `tokens` field
    targets: torch.Tensor  # [rows, seq_len] int64
    # (model input, data field, dtype, declared shape) for each model input
    feeds: tuple[tuple[str, str, str, tuple], ...] = (
        ("input_ids", "tokens", "int64", ("batch", "seq")),)
    # global position of each column (context parallel slices); None: 0..seq_len-1
    positions: Optional[torch.Tensor] = dataclass_field(default=None, compare=False)
    eos: Optional[int] = None  # the end-of-document token (text data)

    def field(self, name: str) -> torch.Tensor:
        """The batch field a stage input names (ValueRef.source == BATCH)."""
        if name == "targets":
            return self.targets
        for model_input, source, dtype, shape in self.feeds:
            if model_input == name:
                return self._make(source, getattr(torch, dtype), shape)
        raise PipeplanError(
            f"a stage reads batch field {name!r}, but the data feeds only "
            f"{', '.join(f[0] for f in self.feeds)} and targets; name it in model.inputs")

    def _make(self, source: str, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
        rows, seq = self.input_ids.shape
        if source == "tokens":
            return self.input_ids.to(dtype)
        if source == "targets":
            return self.targets.to(dtype)
        if source == "positions":
            at = torch.arange(seq) if self.positions is None else self.positions
            return at.to(dtype).expand(rows, seq).contiguous()
        if source == "document_positions":
            return document_positions(self.input_ids, self.eos).to(dtype)
        if source == "mask":
            dims = {"batch": rows, "seq": seq}
            return torch.ones([dims.get(d, d) for d in shape], dtype=dtype)
        raise PipeplanError(f"unknown data field {source!r}")

    @property
    def inputs(self) -> dict[str, torch.Tensor]:
        """The model's inputs by name: what the unmodified model's forward takes."""
        return {name: self.field(name) for name, *_ in self.feeds}

    def rows(self, start: int, stop: int) -> "Batch":
        return Batch(self.input_ids[start:stop], self.targets[start:stop], self.feeds,
                     self.positions, self.eos)

    def columns(self, index: torch.Tensor) -> "Batch":
        """Columns `index` of every row (a context-parallel slice), keeping their positions."""
        at = torch.arange(self.input_ids.shape[1]) if self.positions is None else self.positions
        return Batch(self.input_ids[:, index], self.targets[:, index], self.feeds, at[index],
                     self.eos)

    @property
    def tokens(self) -> int:
        return self.input_ids.numel()


def document_positions(tokens: torch.Tensor, eos: Optional[int]) -> torch.Tensor:
    """Each token's position in its document: 0 at a row's first token and at every token
    after an `eos`, counting up from there ([rows, seq] int64)."""
    if eos is None:
        raise PipeplanError("document_positions need the end-of-document token: text data")
    rows, seq = tokens.shape
    at = torch.arange(seq).expand(rows, seq)
    starts = torch.zeros(rows, seq, dtype=torch.bool)
    starts[:, 0] = True
    starts[:, 1:] = tokens[:, :-1] == eos
    return at - torch.cummax(torch.where(starts, at, 0), dim=1).values


def feeds_of(plan: Plan) -> tuple[tuple[str, str, str, tuple], ...]:
    """(model input, data field, dtype, shape) per model input (checked by dsl/checks.py)."""
    specs = plan.model.inputs
    bound = dict(plan.data.feeds([s.name for s in specs]))
    return tuple((s.name, bound[s.name] or "tokens", s.dtype, tuple(s.shape)) for s in specs)


SYNTHETIC_NOISE = 0.1  # share of synthetic tokens drawn uniformly instead of from the table


def _synthetic_rows(spec: DataSpec, step: int, rows: int) -> torch.Tensor:
    """A learnable token stream: each next token is succ[token] (one random permutation of
    the vocabulary per data seed), except a SYNTHETIC_NOISE share drawn uniformly. Uniform
    tokens alone would leave nothing to learn below ln(vocab): a run could not show its
    loss falling."""
    succ = torch.randperm(spec.vocab, generator=torch.Generator().manual_seed(spec.seed))
    g = torch.Generator().manual_seed(spec.seed * 1_000_003 + step + 1)
    length = spec.seq_len + 1
    out = torch.empty(rows, length, dtype=torch.int64)
    out[:, 0] = torch.randint(0, spec.vocab, (rows,), generator=g)
    uniform = torch.randint(0, spec.vocab, (rows, length), generator=g)
    noisy = torch.rand(rows, length, generator=g) < SYNTHETIC_NOISE
    for t in range(1, length):
        out[:, t] = torch.where(noisy[:, t], uniform[:, t], succ[out[:, t - 1]])
    return out


def _file_rows(path: str, spec: DataSpec, step: int, rows: int) -> torch.Tensor:
    tokens = open_token_file(path)
    window = spec.seq_len + 1
    windows = len(tokens) // window
    if windows == 0:
        raise PipeplanError(
            f"data file {path!r} holds {len(tokens)} tokens, fewer than one window "
            f"of seq_len + 1 = {window}")
    first = step * rows
    if not spec.wrap and first + rows > windows:
        raise PipeplanError(
            f"data file {path!r} holds {windows} windows of seq_len + 1 = {window} tokens; "
            f"step {step + 1} needs windows up to {first + rows} (set wrap = true in "
            "data = tokens(...) to read the file again from its start)")
    out = np.stack([tokens[((first + r) % windows) * window:][:window] for r in range(rows)])
    return torch.from_numpy(out.astype(np.int64))


# ------------------------------------------------------------------ text
_CACHES: dict = {}  # (plan folder, data spec, seed) -> TokenCache: found once per process


def text_cache(plan: Plan):
    """The plan's token cache (compiler/text.py): tokenised before launch, found here."""
    key = (plan.resolve_path(""), plan.data, plan.train.seed)
    if key not in _CACHES:
        from ...compiler.documents import TextError
        from ...compiler.text import prepare

        try:
            _CACHES[key] = prepare(plan)
        except TextError as e:
            raise PipeplanError(f"data: {e.message}") from None
    return _CACHES[key]


@lru_cache(maxsize=4)
def _epoch_order(windows: int, seed: int, epoch: int) -> np.ndarray:
    """The training windows' order in `epoch`: a permutation drawn from (seed, epoch)."""
    return np.random.default_rng([seed, epoch]).permutation(windows)


def train_window(plan: Plan, windows: int, i: int) -> int:
    """Which training window the run's `i`-th row reads: epoch by epoch, each epoch every
    window once, in a seeded order (`data.shuffle`, `train.seed`) or in file order."""
    epoch, j = divmod(i, windows)
    if not plan.data.shuffle:
        return j
    return int(_epoch_order(windows, plan.train.seed, epoch)[j])


def _text_rows(plan: Plan, step: int, rows: int) -> torch.Tensor:
    cache = text_cache(plan)
    tokens, window = open_token_file(cache.path), plan.data.seq_len + 1
    windows = cache.split // window
    first = step * rows
    if not plan.data.wrap and first + rows > windows:
        raise PipeplanError(f"the text makes {windows} training windows; step {step + 1} needs "
                            f"windows up to {first + rows} (set wrap = true in data = text(...))")
    at = [train_window(plan, windows, first + r) * window for r in range(rows)]
    return torch.from_numpy(np.stack([tokens[a:a + window] for a in at]).astype(np.int64))


def eval_batch(plan: Plan, k: int) -> Batch:
    """Held-out batch `k` of an evaluation: `global_batch` consecutive held-out windows
    (the same ones at every evaluation, so the numbers compare), from the start again
    when the held-out part is shorter."""
    cache = text_cache(plan)
    tokens, window = open_token_file(cache.path), plan.data.seq_len + 1
    windows = cache.held_out_tokens // window
    if windows == 0:
        raise PipeplanError("train.eval: the held-out text makes no window")
    rows = plan.train.global_batch
    at = [cache.split + ((k * rows + r) % windows) * window for r in range(rows)]
    data = torch.from_numpy(np.stack([tokens[a:a + window] for a in at]).astype(np.int64))
    return Batch(data[:, :-1].contiguous(), data[:, 1:].contiguous(), feeds_of(plan), None,
                 cache.eos)


def global_batch(plan: Plan, step: int) -> Batch:
    """Step `step`'s whole global batch (every DP rank's rows)."""
    rows = plan.train.global_batch
    if plan.data.kind == "file":
        data = _file_rows(resolve_data_path(plan), plan.data, step, rows)
    elif plan.data.kind == "text":
        data = _text_rows(plan, step, rows)
    else:
        data = _synthetic_rows(plan.data, step, rows)
    eos = text_cache(plan).eos if plan.data.kind == "text" else None
    return Batch(data[:, :-1].contiguous(), data[:, 1:].contiguous(), feeds_of(plan), None, eos)


def chunks(batch: Batch, count: int) -> list[Batch]:
    """`count` equal consecutive row chunks (microbatches)."""
    rows = batch.input_ids.shape[0]
    if rows % count:
        raise PipeplanError(f"a batch of {rows} rows does not split into {count} equal microbatches")
    size = rows // count
    return [batch.rows(i * size, (i + 1) * size) for i in range(count)]


def concat(batches: list[Batch]) -> Batch:
    if len(batches) == 1:
        return batches[0]
    return Batch(torch.cat([b.input_ids for b in batches]), torch.cat([b.targets for b in batches]),
                 batches[0].feeds, batches[0].positions, batches[0].eos)


def dp_microbatches(plan: Plan, step: int, dp_rank: int, cp_rank: int = 0) -> list[Batch]:
    """DP rank `dp_rank`'s microbatches of step `step`, in microbatch order (their sequence
    slice `cp_rank` under context parallel)."""
    return share_of(plan, global_batch(plan, step), dp_rank, cp_rank)


def dp_eval_microbatches(plan: Plan, k: int, dp_rank: int, cp_rank: int = 0) -> list[Batch]:
    """The same share of held-out batch `k` (train.eval)."""
    return share_of(plan, eval_batch(plan, k), dp_rank, cp_rank)


def share_of(plan: Plan, batch: Batch, dp_rank: int, cp_rank: int = 0) -> list[Batch]:
    dp, m = plan.mesh.dp, plan.microbatches
    per_dp = plan.train.global_batch // dp
    share = batch.rows(dp_rank * per_dp, (dp_rank + 1) * per_dp)
    if plan.mesh.cp > 1:
        from ..parallel.cp.positions import cp_columns

        share = share.columns(cp_columns(plan, cp_rank))
    return chunks(share, m)
