"""The construction budget: what a model's constructor may build before pipeplan stops it.

The compiler builds the model on the meta device, so a constructor that scales without bound
(`layers = 1000000`) or allocates outside its parameters (a 100 GB `torch.zeros` buffer or
plain tensor attribute) costs nothing in bytes there, but minutes of CPU and gigabytes of
module objects, and every rank later builds its buffers on CPU for real. While the model is
constructed, `Budget` counts every module registered and every tensor the constructor creates
(through the meta build's TorchFunctionMode in compiler/capture/loading.py: the bytes of
each call's new tensor, not a view nor an argument back, cumulative; factory calls that
name a real device are sized on meta first, so nothing is allocated past the bound) and
stops the constructor the moment a count passes its bound:

| count                            | bound                                                   |
|----------------------------------|---------------------------------------------------------|
| modules                          | MAX_MODULES (61 layers x 256 experts x 4 modules: 62k) |
| bytes created, parameters too    | this machine's memory for a local run, else MAX_MODEL_BYTES |
| bytes created outside parameters | this machine's memory (every rank builds them on its CPU) |

`compiler/capture/loading.py` turns the stop into a PlanError at `model.args` with the counts.
"""
from __future__ import annotations

import contextlib
import contextvars
import os
from dataclasses import dataclass

import torch

MAX_MODULES = 2**16
MAX_MODEL_BYTES = 2**44  # 16 TiB: a 2-trillion-parameter model in float64 still fits
GIB = 1 << 30

# The bound on all bytes created: None = MAX_MODEL_BYTES; the local launcher sets the
# machine's memory (`local_run_budget`) around its compile.
_TOTAL_BOUND: contextvars.ContextVar = contextvars.ContextVar("total_bound", default=None)


def machine_memory_bytes() -> int | None:
    """This machine's physical memory (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


@contextlib.contextmanager
def local_run_budget(total: int | None = None):
    """Models constructed inside are bounded by `total` bytes (default: this machine's
    memory): every rank of a local run lives on this machine."""
    token = _TOTAL_BOUND.set(total or machine_memory_bytes())
    try:
        yield
    finally:
        _TOTAL_BOUND.reset(token)


class OverBudget(BaseException):
    """Raised inside the constructor (a BaseException: a model's own `except Exception`
    does not swallow it)."""

    def __init__(self, what: str, counts: "Counts"):
        super().__init__(what)
        self.what = what
        self.counts = counts


@dataclass
class Counts:
    modules: int = 0
    bytes: int = 0  # every tensor created, cumulative
    param_bytes: int = 0

    def describe(self) -> str:
        plural = "s" * (self.modules != 1)
        return (f"{self.modules:,} module{plural}, {self.bytes / GIB:,.2f} GiB of tensors created "
                f"({self.param_bytes / GIB:,.2f} GiB of them parameters)")


class Budget:
    """Counts while active (a context manager: registration hooks; tensors through `call`,
    which the meta build's TorchFunctionMode routes every torch call to); raises OverBudget
    past a bound."""

    def __init__(self, real: bool = False):
        self.real = real  # the default device is CPU: size each factory call on meta first
        self.counts = Counts()
        machine = machine_memory_bytes()
        self.total_bound = _TOTAL_BOUND.get() or MAX_MODEL_BYTES
        self.total_why = ("this machine's memory" if _TOTAL_BOUND.get() else
                          f"pipeplan's bound of {MAX_MODEL_BYTES / GIB:,.0f} GiB")
        self.other_bound = machine or MAX_MODEL_BYTES
        self._params: dict[int, torch.Tensor] = {}  # held: a freed one's id is reused
        self._last = 0
        self._hooks = []

    def __enter__(self):
        mod = torch.nn.modules.module
        self._hooks = [mod.register_module_module_registration_hook(self._module),
                       mod.register_module_parameter_registration_hook(self._parameter),
                       mod.register_module_buffer_registration_hook(self._buffer)]
        return self

    def __exit__(self, *exc):
        for h in self._hooks:
            h.remove()
        return False

    def _module(self, module, name, sub):
        if sub is not None:
            self.counts.modules += 1
            if self.counts.modules > MAX_MODULES:
                raise OverBudget(f"more than {MAX_MODULES:,} modules (pipeplan's bound)",
                                 self.counts)

    def _parameter(self, module, name, param):
        if param is not None and id(param) not in self._params:  # a tied one counts once
            self._params[id(param)] = param  # kept alive while counting, so no other
            # parameter (a replaced one freed, a new one at its address) shares its id
            self.counts.param_bytes += param.nelement() * param.element_size()
        self.check()

    def _buffer(self, module, name, buffer):
        self.check()

    def call(self, func, args, kwargs):
        """`func(*args, **kwargs)`, counted (the meta build's TorchFunctionMode calls it). A
        factory that would allocate for real (naming a real device, or on the default one
        when it is CPU: `real`) is sized on meta before it runs."""
        device = kwargs.get("device")
        if not any(isinstance(a, torch.Tensor) for a in args) and (
                torch.device(device).type != "meta" if device is not None else self.real):
            sized = _sized_on_meta(func, args, kwargs)
            if sized is not None:
                self._add(sized, args)
                self.check(pending=0)  # sized before it is allocated
                return func(*args, **kwargs)
        out = func(*args, **kwargs)
        if self._add(out, args):
            self.check(pending=self._last)
        return out

    def _add(self, out, args) -> bool:
        """Count `out` if it is a new tensor: not a view (`_base`), not an argument back
        (an in-place op). Views share their base's bytes; anything else counts in full."""
        if type(out) is not torch.Tensor or out._base is not None or \
                any(out is a for a in args):
            return False
        self._last = out.nelement() * out.element_size()
        self.counts.bytes += self._last
        return True

    def check(self, pending: int = 0) -> None:
        """Raise OverBudget past a bound. `pending`: the bytes just created, which may yet
        be registered as a parameter (checked against the bound outside parameters at the
        next op, registration or the constructor's end)."""
        c = self.counts
        if c.bytes > self.total_bound:
            raise OverBudget(f"more than {self.total_why} ({self.total_bound / GIB:,.1f} GiB)",
                             c)
        if c.bytes - c.param_bytes - pending > self.other_bound:
            raise OverBudget(f"more than this machine's memory ({self.other_bound / GIB:,.1f} "
                             "GiB) outside parameters, which every rank builds on its CPU", c)


def _sized_on_meta(func, args, kwargs):
    """What `func` makes, made on meta (None where it makes no tensor there)."""
    try:
        with torch.device("meta"):
            out = func(*args, **({**kwargs, "device": "meta"} if "device" in kwargs else kwargs))
    except Exception:
        return None
    return out if isinstance(out, torch.Tensor) and out.is_meta else None
