"""Custom autograd Functions in a model's forward: recorded while it is captured, and each
proven to have autograd's gradient of its forward, or refused.

Both front ends (fx and export) trace through `Function.apply` into the Function's
forward and keep none of its backward: the stages then train with autograd's gradient of
the forward's ops. That is the model's gradient only where the Function's backward
computes the same thing -- BLOOM's GeLUFunction (the tanh GELU's derivative written out)
does; a straight-through estimator (round forward, identity backward) or PhiMoE's router
multiplier does not, and a pipelined run would silently train another model.

`recording()` patches `torch.autograd.Function.apply` for the capture and keeps, per
Function class, the arguments of its first call (shapes and dtypes where the tracer's
values have them: export's fake tensors; fx's proxies have none, so the caller records
them with one more forward, `record_shapes`). `check(calls)` then runs each Function on
random float64 inputs of those shapes (shrunk from the front above 2^20 elements),
differentiates its outputs with random output gradients through its own backward and
through autograd of its forward (called with a stand-in ctx), and returns the first whose
gradients differ (beyond rtol 1e-9 of the largest) or cannot be computed, with why.
torch's own Functions that a captured graph keeps or that differentiate their own ops
(custom ops' autograd wrappers, reentrant checkpoints) are not recorded.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.utils._pytree as pytree

# torch's own Functions whose backward the captured graph keeps: a custom op's autograd
# wrapper stays with its op (the graph keeps the op); a reentrant checkpoint's is
# autograd's gradient of its forward (it recomputes and differentiates the same ops)
_KEPT = frozenset({"torch.utils.checkpoint", "torch._library.autograd"})
_LIMIT = 1 << 20  # elements per input of the proof run


@dataclass
class _Spec:
    shape: Optional[tuple]  # None: not known (an fx proxy)
    dtype: Optional[torch.dtype]


@contextlib.contextmanager
def recording():
    """Within the block, every custom Function called: {class: its first call's arguments
    (tensors as _Spec, other values as they were)}."""
    calls: dict = {}
    original = torch.autograd.Function.__dict__["apply"]

    def apply(cls, *args, **kwargs):
        if cls.__module__ not in _KEPT and (cls not in calls or _unknown(calls[cls])):
            calls[cls] = pytree.tree_map(_spec, (args, kwargs))
        return original.__func__(cls, *args, **kwargs)

    torch.autograd.Function.apply = classmethod(apply)
    try:
        yield calls
    finally:
        torch.autograd.Function.apply = original


def _spec(v):
    if isinstance(v, torch.Tensor):
        return _Spec(tuple(v.shape), v.dtype)
    if type(v).__name__ == "Proxy":
        return _Spec(None, None)
    return v


def _unknown(call) -> bool:
    return any(isinstance(s, _Spec) and s.shape is None for s in pytree.tree_leaves(call))


def record_shapes(calls: dict, run) -> None:
    """Fill in the shapes `calls` lacks (an fx capture) by one more forward, `run()`."""
    if not any(_unknown(c) for c in calls.values()):
        return
    with recording() as again, torch.no_grad():
        try:
            run()
        except Exception:  # noqa: BLE001 -- then the Function stays unproven, and is refused
            return
    for cls, call in again.items():
        if cls in calls and _unknown(calls[cls]):
            calls[cls] = call


def check(calls: dict) -> Optional[tuple[type, str]]:
    """The first Function whose backward is not autograd's gradient of its forward, and
    why; None when each was proven the same."""
    for cls, call in calls.items():
        why = _differs(cls, call)
        if why:
            return cls, why
    return None


def _input(spec: _Spec, gen: torch.Generator):
    shape = list(spec.shape)
    i = 0
    while math.prod(shape) > _LIMIT and i < len(shape):
        shape[i], i = 1, i + 1
    if spec.dtype.is_floating_point or spec.dtype.is_complex:
        return torch.randn(shape, dtype=torch.float64, generator=gen).requires_grad_()
    return torch.zeros(shape, dtype=spec.dtype)


class _Ctx:
    """What a Function's forward may call on its ctx, for autograd of the forward alone."""

    needs_input_grad: tuple = ()
    materialize_grads = True

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors

    def mark_dirty(self, *args):
        pass

    def mark_non_differentiable(self, *args):
        pass

    def set_materialize_grads(self, value):
        self.materialize_grads = value


def _differs(cls, call) -> Optional[str]:
    if _unknown(call):
        return "its inputs' shapes could not be found to compare its backward with " \
               "autograd's gradient of its forward"
    gen = torch.Generator().manual_seed(0)
    args, kwargs = pytree.tree_map(lambda s: _input(s, gen) if isinstance(s, _Spec) else s,
                                   call)
    leaves = [t for t in pytree.tree_leaves((args, kwargs))
              if isinstance(t, torch.Tensor) and t.requires_grad]
    # a Function with setup_context takes no ctx in its forward
    plain = cls.setup_context is not torch.autograd.function._SingleLevelFunction.setup_context
    try:
        own = _grads(lambda: cls.apply(*args, **kwargs), leaves, gen)
        traced = _grads(lambda: cls.forward(*args, **kwargs) if plain else
                        cls.forward(_Ctx(), *args, **kwargs), leaves, gen)
    except Exception as e:  # noqa: BLE001 -- unproven: refused, saying why
        return f"comparing its backward with autograd's gradient of its forward failed " \
               f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    scale = max((float(g.abs().max()) for g in own if g.numel()), default=0.0)
    worst = max((float((a - b).abs().max()) for a, b in zip(own, traced) if a.numel()),
                default=0.0)
    if worst > 1e-9 * scale + 1e-12:
        return f"its backward differs from autograd's gradient of its forward by up to " \
               f"{worst:.3g} (largest gradient {scale:.3g}, float64, random inputs)"
    return None


def _grads(call, leaves, gen) -> list:
    """d(outputs . random cotangents)/d(leaves), zeros where unused; the cotangents are drawn
    from a copy of the generator so both sides get the same ones."""
    out = [t for t in pytree.tree_leaves(call())
           if isinstance(t, torch.Tensor) and t.requires_grad]
    state = gen.get_state()
    cot = [torch.randn(t.shape, dtype=t.dtype, generator=gen) for t in out]
    gen.set_state(state)
    got = torch.autograd.grad(out, leaves, cot, allow_unused=True) if out else [None] * len(leaves)
    return [torch.zeros_like(x) if g is None else g for x, g in zip(leaves, got)]


def describe(cls) -> str:
    import inspect
    try:
        return f"{cls.__qualname__} ({inspect.getsourcefile(cls)}:{inspect.getsourcelines(cls)[1]})"
    except (OSError, TypeError):
        return f"{cls.__module__}.{cls.__qualname__}"
