"""How each parameter gets its initial value: the per-module rule, and proof it covers them.

backends/state/materialize.py draws a rank's initial weights module by module, each by
the module's own rule (`init_rule`): its `reset_parameters()` (what torch layers run in
their __init__), then the `_init_weights(module)` of the nearest enclosing module that
has one (`init_owner`) -- Hugging Face's convention, applied as its `post_init` applies it:
each nested PreTrainedModel initialises its own submodules, so a user module wrapping
`LlamaForCausalLM` (which has no rule of its own) initialises the Llama by Llama's rule;
on a plain model the hook is the user's, on the model itself.
A parameter that rule leaves unwritten is drawn by the rule applied to the modules around
it, nearest first, as `post_init` (children first) would write it, each writing only into
what is still unwritten.

`check_init` proves, at `pipeplan check` (the model line), that every parameter is
covered: each module's rule runs on fresh meta parameters (no storage, nothing computed)
under a dispatch mode that records the in-place writes, and a parameter no rule writes
whole is refused by name, before any process starts -- unless no rule writes into it at
all and its constructor made it a constant of the code (constructor.py), which it keeps.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.nn.utils.parametrize import ParametrizationList
from torch.utils._python_dispatch import TorchDispatchMode

from ...dsl.ast import Plan
from ...dsl.errors import PlanError
from .constructor import written as _written

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

    A parameter those leave unwritten may be written by the rule applied to a module around
    it: Qwen3-Next's `_init_weights(sparse_moe_block)` draws `block.gate.weight` (its router
    has no rule of its own). Hugging Face applies the rule children first, so an
    enclosing module's call comes after the module's own: here each enclosing module's
    rule, nearest first, follows, letting through only writes into the parameters still
    unwritten (`_into_only`) -- every other parameter keeps what its own module draws,
    whichever modules a process holds. Empty: no rule."""
    steps = _own_steps(model, module, path)
    missing = _unwritten(module, steps) or []
    parts = path.split(".") if path else []
    for i in range(len(parts) - 1, -1, -1) if missing else ():
        around = ".".join(parts[:i])
        owner = init_owner(model, around)
        if owner is not None:
            hook, outer = getattr(owner, INIT_HOOK), model.get_submodule(around)
            steps.append(_into_only(model, module, missing, lambda h=hook, m=outer: h(m)))
    return steps


def _own_steps(model: torch.nn.Module, module: torch.nn.Module, path: str) -> list:
    steps = []
    reset = getattr(module, "reset_parameters", None)
    if callable(reset):
        steps.append(reset)
    owner = init_owner(model, path)
    if owner is not None:
        hook = getattr(owner, INIT_HOOK)
        steps.append(lambda: hook(module))
    return steps


class _IntoOnly(TorchDispatchMode):
    """Lets an in-place write through unless it targets a tensor of `closed` (storages)."""

    def __init__(self, closed: set):
        super().__init__()
        self.closed = closed

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        t = _written(func, args, kwargs)
        if t is not None and t.untyped_storage()._cdata in self.closed:
            return t
        return func(*args, **kwargs)


def _into_only(model, module, names: list, step):
    """`step`, writing into no tensor of `model` but `module`'s parameters `names`."""
    def run():
        own = {module._parameters[n].untyped_storage()._cdata for n in names}
        closed = {t.untyped_storage()._cdata
                  for t in list(model.parameters()) + list(model.buffers())} - own
        with _IntoOnly(closed):
            step()
    return run


def _rule_text(model, module, path) -> str:
    parts = []
    if callable(getattr(module, "reset_parameters", None)):
        parts.append(f"{type(module).__name__}.reset_parameters()")
    owner = init_owner(model, path)
    if owner is not None:
        parts.append(f"{type(owner).__name__}.{INIT_HOOK}(module), then on each module "
                     "around it")
    return " then ".join(parts)


class _Writes(TorchDispatchMode):
    """Records the storages an in-place op writes whole (meta tensors; nothing runs)."""

    def __init__(self):
        super().__init__()
        self.whole: set[int] = set()
        self.any: set[int] = set()  # written at all

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        t = _written(func, args, kwargs)
        if t is not None:
            self.any.add(t.untyped_storage()._cdata)
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
    return _unwritten(module, init_rule(model, module, path)) or []


def _unwritten(module: torch.nn.Module, steps: list, whole: bool = True
               ) -> Optional[list[str]]:
    """`module`'s own parameters `steps` leave unwritten (a run on fresh meta parameters;
    a CPU draw the rule makes there leaves the caller's random state as it was): not
    written whole, or (`whole=False`) not written at all; None where the steps cannot run
    on meta."""
    saved = dict(module._parameters)
    fresh = {k: torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"),
                                   requires_grad=p.requires_grad)
             for k, p in saved.items() if p is not None}
    writes = _Writes()
    try:
        module._parameters.update(fresh)
        with writes, torch.no_grad(), torch.random.fork_rng(devices=[]):
            for step in steps:
                step()
    except Exception:
        return None
    finally:
        module._parameters.update(saved)
    done = writes.whole if whole else writes.any
    return [k for k, p in fresh.items() if p.untyped_storage()._cdata not in done]


def check_init(plan: Plan, model: torch.nn.Module) -> None:
    """Refuse (at the plan's model line) a model whose initial weights cannot be drawn per
    module: a module owning parameters directly that no rule covers (none, or one that
    does not write them), unless its constructor made them constants of the code that no
    rule writes into (constructor.py: they keep the constructor's value)."""
    _check_copies(plan, model)
    seen, constants = set(), None
    for path, module in model.named_modules():
        own = [n for n, p in module.named_parameters(recurse=False)]
        if not own or id(module) in seen:
            continue
        seen.add(id(module))
        kind = type(module).__name__
        where = f"module `{path}`" if path else f"the model ({kind}) itself"
        steps = init_rule(model, module, path)
        missing = own if not steps else uncovered(model, module, path)
        if missing:
            constants = _constructor_kept(plan) if constants is None else constants
            untouched = own if not steps else (_unwritten(module, steps, whole=False) or [])
            missing = [n for n in missing
                       if n not in untouched or _joined(path, n) not in constants]
        if not missing:
            continue
        if isinstance(module, ParametrizationList):  # torch.nn.utils.parametrize's originals
            _refuse_parametrization(plan, module, path, missing)
        said = (f"{where} ({kind}) owns parameters {', '.join(own)} but has no "
                f"reset_parameters(), and no module around it has {INIT_HOOK}(module)"
                if not steps else
                f"{where} ({kind}): its init rule ({_rule_text(model, module, path)}) does "
                f"not set {', '.join(missing)}")
        raise PlanError.at(
            plan, "model.source", said + ": pipeplan cannot initialise them per module "
            "(nor keep the constructor's value: it is drawn, uninitialised, or rewritten)",
            f"give {kind} a reset_parameters() that initialises {', '.join(missing)}, or "
            f"an enclosing module (the model) an {INIT_HOOK}(self, module) method that "
            "does (see docs/runtime.md, Initial weights)")


def _refuse_parametrization(plan: Plan, module: torch.nn.Module, path: str,
                            missing: list[str]) -> None:
    """A parametrized tensor's originals: the constructor computed them from the layer's
    own draw (the parametrization's right_inverse, as it was registered), which no
    per-module rule replays; the hint names what the user can do (torch's
    ParametrizationList takes no reset_parameters of theirs)."""
    owner, _, tensor = path.rpartition(".parametrizations.")
    kinds = ", ".join(type(m).__name__ for m in module)
    raise PlanError.at(
        plan, "model.source",
        f"`{owner}.{tensor}` is parametrized ({kinds}, torch.nn.utils.parametrize): "
        f"{', '.join(missing)} of module `{path}` {'was' if len(missing) == 1 else 'were'} "
        f"computed by the constructor from `{owner}`'s own draw (through the "
        "parametrization's right_inverse), which pipeplan does not replay, and no rule "
        "initialises it: pipeplan cannot start the layer as your model does",
        f"give the model an {INIT_HOOK}(self, module) method that initialises "
        f"{', '.join(missing)} of each torch.nn.utils.parametrize.ParametrizationList, or "
        "train without the parametrization (torch.nn.utils.parametrize."
        "remove_parametrizations; see docs/runtime.md, Initial weights)")


def _check_copies(plan: Plan, model: torch.nn.Module) -> None:
    """Refuse parameters the constructor made as copies of drawn ones where no draw
    reproduces them (constructor.copy_leaders: a module that also holds a parameter drawn
    on its own after the copy, or a source written after it), outside any `_init_weights`
    hook (a model with one redraws every module after construction, as Hugging Face's
    post_init does): in the user's model they start equal to their source."""
    from .constructor import constructor_copies

    copies = {n: src for n, src in constructor_copies(model).items()
              if init_owner(model, n.rpartition(".")[0]) is None}
    if not copies:
        return
    names = sorted(copies)
    sources = sorted({src or "a module outside the model" for src in copies.values()})
    raise PlanError.at(
        plan, "model.source",
        f"the constructor made {len(names)} parameters ({', '.join(names[:3])}"
        f"{', ...' if len(names) > 3 else ''}) as copies of drawn ones ({', '.join(sources[:2])}"
        f"{', ...' if len(sources) > 2 else ''}: copy.deepcopy of a module), so in your model "
        "they start equal to their source; pipeplan draws a copied module as its source only "
        "where the module holds nothing drawn on its own and the source was not written "
        "after the copy",
        "draw the whole copied module again after copying it, or give the model an "
        f"{INIT_HOOK}(self, module) method (see docs/runtime.md, Initial weights)")


def _joined(path: str, leaf: str) -> str:
    return f"{path}.{leaf}" if path else leaf


def _constructor_kept(plan: Plan) -> set[str]:
    """The parameters no rule writes that take their value from the constructor
    (constructor.py): those two skeletons, built under different seeds, both hold as the same
    constant (the second build sees what its dispatch mode cannot, such as numpy's random
    generator), and those its recorded writes draw whole from nothing (`draws_whole`:
    materialize.py replays them)."""
    import dataclasses

    from .constructor import constructor_constants, constructor_writes, draws_whole
    from .loading import load_skeleton

    other = dataclasses.replace(plan, train=dataclasses.replace(
        plan.train, seed=plan.train.seed + 1))
    skeleton = load_skeleton(plan)
    a, b = constructor_constants(skeleton), constructor_constants(load_skeleton(other))
    return {n for n, v in a.items() if n in b and torch.equal(v, b[n])} | \
        {n for n, entries in constructor_writes(skeleton).items() if draws_whole(entries)}
