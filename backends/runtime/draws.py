"""Random numbers seeded by where they are drawn, so a plan's layout never changes them.

A model that draws random numbers while training (dropout, an attention kernel's
dropout, noise) would otherwise draw them from each process's generator in the
order its actions happen to run: a pipeline's stages on other ranks, microbatches
interleaved by the schedule, data-parallel replicas each from its own state.
Nothing about that order is the single-process run's, so `pipeplan verify` could
never call such a model EQUAL, and changing `pp` or `microbatches` would change
the masks a step draws.

Instead, each stage's forward of a microbatch draws from the default generator
seeded by (train.seed, step, chunk, k) (and put back afterwards): `chunk` is the
microbatch's place in the step's global batch (dp rank x microbatches + microbatch,
the chunks `data.chunks` makes) and `k` is how many random ops the stages before
it run in one microbatch's forward (`draw_offsets`, counted once at start-up on
fake copies of every stage, so every rank derives the same table without asking
another). Within the stage the ops draw in order, as in one process. The
single-process reference (backends/verify/reference.py) reseeds its generator the
same way when its forward reaches the k-th random op of a stage start
(`ReferenceDraws`); a recompute reruns its region from the generator state its
forward started at (recompute.py), and a failed step's rerun draws the same again.

Random ops are the ATen ops torch tags `nondeterministic_seeded` (an attention kernel
only when its `dropout_p` is not 0). Under tensor parallelism a rank holds a DTensor's
part: a random fill of a DTensor (CPU dropout's mask is `empty_like(x).bernoulli_(1 -
p)`) is drawn whole from the stage's generator, as the single process draws it, and
the rank keeps its part (`WholeDraws`, the one dispatch mode the runtime adds, on tp
stages that draw only); any other random op on a DTensor stops the run naming it.
`pipeplan check` refuses the plans where the draws cannot be the reference's
(compiler/parallel/checks.py): inductor's kernels (their own generator), tensor
parallelism's compiled graphs, context parallelism, expert parallelism's grouped
reference, attention dropout on heads tp splits.
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


_SCHEMA: dict = {}  # op -> (seeded, position of dropout_p or None)


def _schema(func) -> tuple:
    if func not in _SCHEMA:
        seeded = torch.Tag.nondeterministic_seeded in getattr(func, "tags", ())
        names = [a.name for a in func._schema.arguments] if seeded else []
        _SCHEMA[func] = (seeded, names.index("dropout_p") if "dropout_p" in names else None)
    return _SCHEMA[func]


def is_random(func, args, kwargs) -> bool:
    """Whether this call draws: an op torch tags `nondeterministic_seeded`, unless it takes
    a `dropout_p` that is 0 (attention kernels draw only for their dropout)."""
    seeded, at = _schema(func)
    if not seeded:
        return False
    if at is not None:
        return bool(kwargs.get("dropout_p", args[at] if at < len(args) else 0.0))
    return True


@contextlib.contextmanager
def seeded(key: tuple, k: int, device: torch.device):
    """The default generators (CPU, and `device`'s) seeded by (key, k) within the block, put
    back after it."""
    seed = _seed(key, k)
    cpu = torch.default_generator
    saved = cpu.get_state()
    cpu.manual_seed(seed)
    try:
        if device.type == "cpu":
            yield
        else:
            with torch.random.fork_rng(devices=[device], device_type=device.type):
                torch.manual_seed(seed)
                yield
    finally:
        cpu.set_state(saved)


def microbatch(offset: Optional[int], seed: int, step: int, chunk: int,
               device: torch.device, split: bool = False):
    """The draws of one microbatch's forward through a stage whose first random op is the
    `offset`-th of the model's forward (None: the stage draws nothing). `split`: the stage
    computes on DTensors (tensor parallelism)."""
    if offset is None:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(seeded((seed, step, chunk), offset, device))
    if split:
        stack.enter_context(WholeDraws())
    return stack


# in-place fills whose values do not depend on what the tensor held (dropout's mask on CPU
# is `empty_like(x).bernoulli_(1 - p)`): drawn whole, this rank keeps its part
_FILLS = frozenset({"bernoulli_", "uniform_", "normal_", "exponential_", "random_",
                    "geometric_", "cauchy_", "log_normal_"})


def _is_dtensor(a) -> bool:
    return getattr(a, "placements", None) is not None and hasattr(a, "to_local")


class WholeDraws(TorchDispatchMode):
    """A random fill of a DTensor (whole or in parts) drawn whole from the default generator,
    as the single process draws it, this rank's part copied into its local tensor
    (DTensor's own random ops draw a local shape, or from a generator of its own).
    Anything else random on a DTensor would not be the reference's draws: refused."""

    def __enter__(self):
        self._outer = getattr(_state, "whole", None)
        _state.whole = self
        return super().__enter__()

    def __exit__(self, *exc):
        _state.whole = self._outer
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not any(_is_dtensor(a) for a in (*args, *kwargs.values())) or \
                not is_random(func, args, kwargs):
            return func(*args, **kwargs)
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        target = args[0] if args else None
        others = [a for a in (*args[1:], *kwargs.values()) if isinstance(a, torch.Tensor)]
        if func._schema.name.split("::")[-1] not in _FILLS or not _is_dtensor(target) \
                or others or any(p.is_partial() for p in target.placements):
            raise RuntimeError(
                f"{func} draws random numbers on a tensor-parallel value (placements "
                f"{[getattr(a, 'placements', None) for a in args if _is_dtensor(a)]}); its "
                "draws would not be the single-process run's. Run this model without tensor "
                "parallelism, or without that random op")
        whole = torch.empty(target.shape, dtype=target.dtype, device=target.device)
        func(whole, *args[1:], **kwargs)
        shape, offset = compute_local_shape_and_global_offset(target.shape, target.device_mesh,
                                                              target.placements)
        with torch.no_grad():
            target.to_local().copy_(whole[tuple(slice(o, o + n) for o, n in zip(offset, shape))])
        return target


def whole_draws_active() -> bool:
    """Whether a WholeDraws mode is active (a recompute's rerun enters one again)."""
    return getattr(_state, "whole", None) is not None


class ReferenceDraws(TorchDispatchMode):
    """The single-process forward of one chunk, reseeding the default generator by
    (key, k) when it reaches the k-th random op for k in `starts` (where a stage that draws
    begins), as the stages do."""

    def __init__(self, key: tuple, starts: frozenset):
        super().__init__()
        self.key, self.starts, self.k = key, starts, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if is_random(func, args, kwargs):
            if self.k in self.starts:
                torch.manual_seed(_seed(self.key, self.k))
            self.k += 1
        return func(*args, **kwargs)


class _Counter(TorchDispatchMode):
    """Counts the random ops run under it (the start-up pass of `draw_offsets`)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.count += is_random(func, args, kwargs)
        return func(*args, **kwargs)


def draw_offsets(plan, stages: Sequence) -> list[Optional[int]]:
    """Per stage, how many random ops the stages before it run in one microbatch's forward,
    or None where the stage itself runs none. One forward of every stage on fake copies
    (shapes only; in training mode, under the plan's autocast), as every rank holds the
    stage specs. Under context parallelism, which `check` refuses for a model that draws
    (compiler/parallel/checks.py), the stages hold cp's own collectives: none is seeded."""
    if plan.mesh.cp > 1:
        return [None] * len(stages)
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ..state.materialize import fake_copy
    from .precision import autocast_for, chained

    def counted(spec, inputs):
        with counter:
            return fake_copy(spec.module)(*inputs)

    counter = _Counter()
    offsets, before = [], 0
    autocast = autocast_for(plan.train.precision, torch.device("cpu"))
    with FakeTensorMode(allow_non_fake_inputs=True), torch.no_grad(), autocast():
        for _ in chained(plan, stages, counted):
            offsets.append(before if counter.count > before else None)
            before = counter.count
    return offsets


def reference_starts(plan, model, chunk_forward) -> frozenset:
    """Where the reference reseeds (the offsets of the stages that draw), or nothing when
    one forward of a chunk (`chunk_forward()`, counted, its draws put back) draws nothing:
    then the plan is not compiled for it."""
    counter = _Counter()
    with torch.random.fork_rng(devices=[]), torch.no_grad(), counter:
        chunk_forward()
    if not counter.count:
        return frozenset()
    from ...compiler.driver import compile_plan
    compiled = compile_plan(plan)
    return frozenset(o for o in draw_offsets(compiled.plan, compiled.stages) if o is not None)
