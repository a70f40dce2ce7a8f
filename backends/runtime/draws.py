"""Random numbers keyed by where they are drawn, so a plan's layout never changes them.

A model that draws random numbers while training (dropout, an attention kernel's
dropout, noise) would otherwise draw them from each process's generator in the
order its actions happen to run: a pipeline's stages on other ranks, microbatches
interleaved by the schedule, data-parallel replicas each from its own state.
Nothing about that order is the single-process run's, so `pipeplan verify` could
never call such a model EQUAL, and changing `pp` or `microbatches` would change
the masks a step draws.

Instead, every random op of a microbatch's forward draws from a generator seeded
by (train.seed, step, chunk, k): `chunk` is the microbatch's place in the step's
global batch (dp rank x microbatches + microbatch, the chunks `data.chunks` makes),
and `k` counts the random ops of that microbatch's forward in the model's order.
A stage starts `k` where the stages before it stopped (`draw_offsets`, counted
once at start-up on fake copies of every stage, so every rank derives the same
table without asking another). The single-process reference draws under the same
keys (backends/verify/reference.py); a recompute reruns a region with the `k` its
forward started from (recompute.py).

Random ops are the ATen ops torch tags `nondeterministic_seeded` (an attention kernel
only when its `dropout_p` is not 0); one that takes a
`generator` gets a keyed one, the others (CUDA's fused dropout) run with the
device's default generator seeded by the key and put back afterwards. An op
given a generator by the model keeps it. Under tensor, sequence or context
parallelism a rank holds part of a random op's input, and its draws would not be
the reference's part: `pipeplan check` refuses those plans (compiler/parallel/
random.py), as it does inductor's kernels, which draw from their own generator.
"""
from __future__ import annotations

import contextlib
import hashlib
import threading
from typing import Optional, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_state = threading.local()


def _seed(key: tuple, k: int) -> int:
    digest = hashlib.blake2b(repr((*key, k)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


_SCHEMA: dict = {}  # op -> (seeded, position of dropout_p or None, takes a generator)


def _schema(func) -> tuple:
    if func not in _SCHEMA:
        seeded = torch.Tag.nondeterministic_seeded in getattr(func, "tags", ())
        names = [a.name for a in func._schema.arguments] if seeded else []
        _SCHEMA[func] = (seeded, names.index("dropout_p") if "dropout_p" in names else None,
                         "generator" in names)
    return _SCHEMA[func]


def _is_random(func, args, kwargs) -> bool:
    """Whether this call draws: an op torch tags `nondeterministic_seeded`, unless it takes
    a `dropout_p` that is 0 (attention kernels draw only for their dropout)."""
    seeded, at, _ = _schema(func)
    if not seeded:
        return False
    if at is not None:
        return bool(kwargs.get("dropout_p", args[at] if at < len(args) else 0.0))
    return True


def _device(args, kwargs) -> torch.device:
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            return a.device
    return torch.device(kwargs.get("device") or "cpu")


class KeyedDraws(TorchDispatchMode):
    """While active, the k-th random op draws from a generator seeded by (key, k)."""

    def __init__(self, key: tuple, start: int = 0):
        super().__init__()
        self.key, self.k = key, start

    def __enter__(self):
        self._outer = getattr(_state, "active", None)
        _state.active = self
        return super().__enter__()

    def __exit__(self, *exc):
        _state.active = self._outer
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not _is_random(func, args, kwargs) or kwargs.get("generator") is not None:
            return func(*args, **kwargs)
        seed = _seed(self.key, self.k)
        self.k += 1
        if any(_is_dtensor(a) for a in (*args, *kwargs.values())):
            return _fill_part(func, args, kwargs, seed)
        return _draw(func, args, kwargs, seed)


_GENERATORS: dict = {}  # device -> one generator, reseeded for each draw (this thread's)


def _draw(func, args, kwargs, seed: int):
    """`func` run with its draws from a generator seeded by `seed`."""
    device = _device(args, kwargs)
    if _schema(func)[2]:
        gen = _GENERATORS.get(device)
        if gen is None:
            gen = _GENERATORS[device] = torch.Generator(device=device)
        gen.manual_seed(seed)
        return func(*args, **{**kwargs, "generator": gen})
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else [],
                               device_type=device.type):
        torch.manual_seed(seed)
        return func(*args, **kwargs)


def _is_dtensor(a) -> bool:
    return getattr(a, "placements", None) is not None and hasattr(a, "to_local")


# in-place fills whose values do not depend on what the tensor held (dropout's mask on CPU
# is `empty_like(x).bernoulli_(1 - p)`): drawn whole, this rank keeps its part
_FILLS = frozenset({"bernoulli_", "uniform_", "normal_", "exponential_", "random_",
                    "geometric_", "cauchy_", "log_normal_"})


def _fill_part(func, args, kwargs, seed: int):
    """A random fill of a DTensor (tensor parallelism's values, whole or in parts): the whole
    tensor drawn as the single process draws it, this rank's part copied into its local
    tensor (DTensor's own random ops draw from its generator, not the keyed one). Anything
    else drawn on a DTensor would not be the reference's draws: refused, naming the op."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    target = args[0] if args else None
    others = [a for a in (*args[1:], *kwargs.values()) if isinstance(a, torch.Tensor)]
    if func._schema.name.split("::")[-1] not in _FILLS or not _is_dtensor(target) or others \
            or any(p.is_partial() for p in target.placements):
        raise RuntimeError(
            f"{func} draws random numbers on a tensor-parallel value (placements "
            f"{[getattr(a, 'placements', None) for a in args if _is_dtensor(a)]}); its draws "
            "would not be the single-process run's. Run this model without tensor "
            "parallelism, or without that random op")
    whole = torch.empty(target.shape, dtype=target.dtype, device=target.device)
    _draw(func, (whole, *args[1:]), kwargs, seed)
    shape, offset = compute_local_shape_and_global_offset(target.shape, target.device_mesh,
                                                          target.placements)
    part = whole[tuple(slice(o, o + n) for o, n in zip(offset, shape))]
    with torch.no_grad():
        target.to_local().copy_(part)
    return target


class _Counter(TorchDispatchMode):
    """Counts the random ops run under it (the start-up pass of `draw_offsets`)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.count += _is_random(func, args, kwargs)
        return func(*args, **kwargs)


def where() -> Optional[tuple]:
    """(key, k) of the draws active now, or None: what a recompute region reruns from."""
    active = getattr(_state, "active", None)
    return None if active is None else (active.key, active.k)


def resumed(at: Optional[tuple]):
    """Draws continuing from `where()`'s (key, k) (a recompute's rerun); a no-op for None."""
    return contextlib.nullcontext() if at is None else KeyedDraws(*at)


@contextlib.contextmanager
def aside():
    """A dry run's draws leave the count where it was (a selective region's measuring run)."""
    active = getattr(_state, "active", None)
    k = None if active is None else active.k
    try:
        yield
    finally:
        if active is not None:
            active.k = k


def microbatch(offset: Optional[int], seed: int, step: int, chunk: int):
    """The draws of one microbatch's forward through a stage whose first random op is the
    `offset`-th of the model's forward (None: the stage draws nothing)."""
    return contextlib.nullcontext() if offset is None else KeyedDraws((seed, step, chunk),
                                                                      offset)


def draw_offsets(plan, stages: Sequence) -> list[Optional[int]]:
    """Per stage, how many random ops the stages before it run in one microbatch's forward,
    or None where the stage itself runs none. One forward of every stage on fake copies
    (shapes only; in training mode, under the plan's autocast), as every rank holds the
    stage specs. Under context parallelism, which `check` refuses for a model that draws
    (compiler/parallel/checks.py), the stages hold cp's own collectives: none is keyed."""
    if plan.mesh.cp > 1:
        return [None] * len(stages)
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ...compiler.compiled import BATCH
    from ..state.materialize import fake_copy
    from . import data
    from .precision import autocast_for

    autocast = autocast_for(plan.train.precision, torch.device("cpu"))
    batch = data.dp_microbatches(plan, 0, 0)[0]
    values: dict = {}
    counts = []
    with FakeTensorMode(allow_non_fake_inputs=True), torch.no_grad(), autocast():
        for spec in stages:
            module = fake_copy(spec.module)
            inputs = [batch.field(r.name) if r.source == BATCH else values[r.name]
                      for r in spec.inputs]
            counter = _Counter()
            with counter:
                out = module(*inputs)
            out = out if isinstance(out, (tuple, list)) else (out,)
            values.update({v.name: x for v, x in zip(spec.outputs, out)})
            counts.append(counter.count)
    offsets, total = [], 0
    for c in counts:
        offsets.append(total if c else None)
        total += c
    return offsets
