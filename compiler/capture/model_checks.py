"""What the plan says about the model, checked against the model once it is built.

Run by `load_model`, so `pipeplan check`, `compile` and `run` (before any process
starts) refuse the same plans at their plan line, every problem at once:

* each `model.inputs` entry is a parameter of the model's forward, and every
  forward parameter without a default is among them;
* each recompute and leaf_modules pattern matches at least one module of the
  model (a pattern matching nothing would silently do nothing; experts.modules
  and the tensor lists are checked where they are used).

And, around the capture (traced.py), that the forward leaves the modules' plain Python
state as it found it (`python_state_watched`): a captured graph keeps the values it read
while capturing, so a forward that counts its calls in an attribute would run as its first
call forever.
"""
from __future__ import annotations

import contextlib
import inspect
from typing import Iterator

import torch

from ...dsl.ast import Plan
from ...dsl.errors import Diagnostic, PlanError
from ..patterns import matches


def check_model_against_plan(plan: Plan, model: torch.nn.Module) -> None:
    """Raise one PlanError listing every problem found (nothing when all is well)."""
    problems = list(_inputs(plan, model)) + list(_patterns(plan, model)) + \
        list(_derived(plan, model))
    if problems:
        raise PlanError([Diagnostic(msg, plan.span_of(key), hint) for key, msg, hint in problems],
                        plan.source_text or None, plan.sources)


def _inputs(plan: Plan, model: torch.nn.Module) -> Iterator[tuple[str, str, str]]:
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return  # forward(**kwargs) takes any name
    named = {n: p for n, p in params.items() if p.kind is not p.VAR_POSITIONAL}
    takes = ", ".join(named) or "nothing"
    cls = type(model).__name__
    given = [spec.name for spec in plan.model.inputs]
    for name in given:
        if name not in named:
            yield (_key(plan, f"model.inputs.{name}", "model.inputs"),
                   f"model input '{name}' is not a parameter of {cls}.forward (it takes {takes})",
                   "model.inputs names the forward's parameters; rename or remove this one")
    needed = [n for n, p in named.items() if p.default is p.empty]
    for name in needed:
        if name not in given:
            yield (_key(plan, "model.inputs", "model"),
                   f"{cls}.forward needs '{name}', which model.inputs does not give",
                   f"add {name} = dtype[dims] to model.inputs (and say which data field it "
                   "reads in data's inputs = {...})")


def _derived(plan: Plan, model: torch.nn.Module) -> Iterator[tuple[str, str, str]]:
    """A module holding, beside its parameters and buffers, a tensor made from a parameter
    (computed from one: a grad_fn; or its storage: `.data`) is reparametrised by a forward
    pre-hook that recomputes the tensor from the parameter (torch.nn.utils.prune,
    spectral_norm, the old weight_norm). Check passed such a model and every rank failed in
    setup (a non-leaf tensor cannot be deep-copied): refused at the model line."""
    storages = {_storage_of(p) for p in model.parameters()} - {None}
    for path, module in model.named_modules():
        for name, value in vars(module).items():
            if not isinstance(value, torch.Tensor) or isinstance(value, torch.nn.Parameter):
                continue
            if value.grad_fn is not None or value.requires_grad or \
                    _storage_of(value) in storages:
                where = f"module `{path}`" if path else "the model"
                yield (_key(plan, "model.source", "model"),
                       f"{where} ({type(module).__name__}) holds `{name}`, a tensor made from "
                       "its parameters outside forward (a forward pre-hook recomputes it: "
                       "torch.nn.utils.prune, spectral_norm, weight_norm's hooks): pipeplan "
                       "cannot copy or shard it",
                       "compute it inside the module's forward from its parameters, or make "
                       "the reparametrisation permanent before training (prune.remove)")


def _storage_of(t: torch.Tensor):
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return None


def _patterns(plan: Plan, model: torch.nn.Module) -> Iterator[tuple[str, str, str]]:
    names = [n for n, _ in model.named_modules(remove_duplicate=False) if n]
    lists = [(f"recompute.{i}", r.pattern, "recompute") for i, r in enumerate(plan.recompute)]
    lists += [(f"model.leaf_modules.{i}", p, "leaf_modules")  # those the plan file wrote, not
              for i, p in enumerate(plan.model.leaf_modules)  # the runtime's additions
              if f"model.leaf_modules.{i}" in plan.spans or not plan.spans]
    # experts.modules and the tensor lists: compiler/parallel/ep.py, compiler/parallel/tp.py
    for key, pattern, what in lists:
        if not any(matches(n, pattern) for n in names):
            yield (_key(plan, key, key.rsplit(".", 1)[0]),
                   f"{what} pattern '{pattern}' matches no module of {type(model).__name__}",
                   _near(pattern, names))


def _near(pattern: str, names: list[str]) -> str:
    """A hint: modules at the pattern's depth ('*' matches one dotted segment)."""
    depth = pattern.count(".") + 1
    same = [n for n in names if n.count(".") + 1 == depth][:4]
    shown = ", ".join(same) + (", ..." if len(same) == 4 else "")
    return ("`*` matches one dotted segment; modules at this depth: " + shown if same else
            "`*` matches one dotted segment; no module is nested this deep")


def _key(plan: Plan, key: str, fallback: str) -> str:
    return key if key in plan.spans else fallback


_PLAIN = (int, float, bool, str, type(None))
_UNSET = object()  # an attribute the module did not have


def _plain(value) -> bool:
    return isinstance(value, _PLAIN) or (isinstance(value, tuple)
                                         and all(isinstance(v, _PLAIN) for v in value))


@contextlib.contextmanager
def python_state_watched(plan: Plan, model: torch.nn.Module):
    """Around the capture: refuse, at the model line, a forward that set plain Python
    attributes (numbers, strings, booleans, tuples of them) of the model's modules to other
    values than they had -- a captured graph keeps the values it read while capturing (one
    the forward creates is taken for one-time setup, as lazily installed hooks mark it).
    Sets are seen through nn.Module.__setattr__ (torch.export puts a module's attributes
    back afterwards, so comparing before and after would not see them)."""
    mine = {id(m): path for path, m in model.named_modules()}
    first: dict = {}  # (path, name) -> its value when the capture began
    last: dict = {}  # (path, name) -> the last value set
    original = torch.nn.Module.__setattr__

    def watched(module, name, value):
        path = mine.get(id(module))
        if path is not None and _plain(value):
            first.setdefault((path, name), vars(module).get(name, _UNSET))
            last[(path, name)] = value
        original(module, name, value)

    torch.nn.Module.__setattr__ = watched
    try:
        yield
    finally:
        torch.nn.Module.__setattr__ = original
    # an attribute the forward creates is taken for one-time setup (transformers installs its
    # output-capturing hooks on the first call and marks it so); one it changes is state
    changed = [(k, first[k], v) for k, v in last.items()
               if first[k] is not _UNSET and v != first[k]]
    if not changed:
        return
    shown = ", ".join(f"`{(p + '.') if p else ''}{a}` ({b!r} -> {c!r})"
                      for (p, a), b, c in changed[:4])
    raise PlanError.at(
        plan, "model.source", f"the model's forward changes its own Python attributes: "
        f"{shown} in one call; a captured graph keeps the values it read while capturing, "
        "so every microbatch would run as that first call (the model computes otherwise)",
        "keep such state in a buffer the forward writes in place (register_buffer), or "
        "pass it to the forward as an input")
