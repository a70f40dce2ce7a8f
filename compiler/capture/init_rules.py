"""How each parameter gets its initial value: the per-module rule, and proof it covers them.

backends/state/materialize.py draws a rank's initial weights module by module, each by
the module's own rule (`init_rule`): its `reset_parameters()` (what torch layers run in
their __init__), then the `_init_weights(module)` of the nearest enclosing module that
has one (`init_owner`) -- Hugging Face's convention, applied as its `post_init` applies it:
each nested PreTrainedModel initialises its own submodules, so a user module wrapping
`LlamaForCausalLM` (which has no rule of its own) initialises the Llama by Llama's rule;
on a plain model the hook is the user's, on the model itself.

`check_init` proves, at `pipeplan check` (the model line), that every parameter is
covered: each module's rule runs on fresh meta parameters (no storage, nothing computed)
under a dispatch mode that records the in-place writes, and a parameter no rule writes
whole is refused by name, before any process starts.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ...dsl.ast import Plan
from ...dsl.errors import PlanError

INIT_HOOK = "_init_weights"  # `_init_weights(module)` (Hugging Face's convention; also the user's hook)


def init_owner(model: torch.nn.Module, path: str) -> Optional[torch.nn.Module]:
    """The module whose `_init_weights(module)` initialises the module at `path`: the
    nearest enclosing one (itself included) that has the hook -- as Hugging Face's
    `post_init` applies each nested PreTrainedModel's own rule to its submodules, so a
    user module wrapping `LlamaForCausalLM` initialises the Llama by Llama's rule.
    None: no enclosing module has one."""
    parts = path.split(".") if path else []
    for i in range(len(parts), -1, -1):
        owner = model.get_submodule(".".join(parts[:i]))
        if callable(getattr(owner, INIT_HOOK, None)):
            return owner
    return None


def init_rule(model: torch.nn.Module, module: torch.nn.Module, path: str) -> list:
    """How `module` (at `path` in `model`)'s own parameters are initialised, in the
    constructor's order: the module's `reset_parameters()` (what torch layers run in their
    __init__), then the nearest enclosing `_init_weights(module)` (`init_owner`: what a
    model applies to every module after construction, e.g. Hugging Face's `post_init`).
    Empty: no rule."""
    steps = []
    reset = getattr(module, "reset_parameters", None)
    if callable(reset):
        steps.append(reset)
    owner = init_owner(model, path)
    if owner is not None:
        hook = getattr(owner, INIT_HOOK)
        steps.append(lambda: hook(module))
    return steps


def _rule_text(model, module, path) -> str:
    parts = []
    if callable(getattr(module, "reset_parameters", None)):
        parts.append(f"{type(module).__name__}.reset_parameters()")
    owner = init_owner(model, path)
    if owner is not None:
        parts.append(f"{type(owner).__name__}.{INIT_HOOK}(module)")
    return " then ".join(parts)


class _Writes(TorchDispatchMode):
    """Records the storages an in-place op writes whole (meta tensors; nothing runs)."""

    def __init__(self):
        super().__init__()
        self.whole: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = func._schema.arguments[0] if func._schema.arguments else None
        if first is not None and first.alias_info is not None and first.alias_info.is_write:
            t = args[0] if args else kwargs.get(first.name)
            if isinstance(t, torch.Tensor):
                if t.storage_offset() == 0 and t.numel() * t.element_size() == \
                        t.untyped_storage().nbytes():
                    self.whole.add(t.untyped_storage()._cdata)
                return t  # a write on meta: nothing to compute
        return func(*args, **kwargs)


def uncovered(model: torch.nn.Module, module: torch.nn.Module, path: str) -> list[str]:
    """`module`'s own parameters its init rule does not write whole, found by running the
    rule on fresh meta parameters (no storage) and recording the in-place writes. A rule
    that cannot run on meta (it reads values) is not judged here: materialisation still
    refuses a parameter it leaves NaN (backends/state/materialize.py)."""
    saved = dict(module._parameters)
    fresh = {k: torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"),
                                   requires_grad=p.requires_grad)
             for k, p in saved.items() if p is not None}
    writes = _Writes()
    try:
        module._parameters.update(fresh)
        with writes, torch.no_grad():
            for step in init_rule(model, module, path):
                step()
    except Exception:
        return []
    finally:
        module._parameters.update(saved)
    return [k for k, p in fresh.items() if p.untyped_storage()._cdata not in writes.whole]


def check_init(plan: Plan, model: torch.nn.Module) -> None:
    """Refuse (at the plan's model line) a model whose initial weights cannot be drawn per
    module: a module owning parameters directly that no rule covers (none, or one that
    does not write them)."""
    seen = set()
    for path, module in model.named_modules():
        own = [n for n, p in module.named_parameters(recurse=False)]
        if not own or id(module) in seen:
            continue
        seen.add(id(module))
        kind = type(module).__name__
        where = f"module `{path}`" if path else f"the model ({kind}) itself"
        steps = init_rule(model, module, path)
        missing = own if not steps else uncovered(model, module, path)
        if not missing:
            continue
        said = (f"{where} ({kind}) owns parameters {', '.join(own)} but has no "
                f"reset_parameters(), and no module around it has {INIT_HOOK}(module)"
                if not steps else
                f"{where} ({kind}): its init rule ({_rule_text(model, module, path)}) does "
                f"not set {', '.join(missing)}")
        raise PlanError.at(
            plan, "model.source", said + ": pipeplan cannot initialise them per module",
            f"give {kind} a reset_parameters() that initialises {', '.join(missing)}, or "
            f"an enclosing module (the model) an {INIT_HOOK}(self, module) method that "
            "does (see docs/runtime.md, Initial weights)")
