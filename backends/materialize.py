"""Initial weights: each rank materialises only what it owns, from (seed, module path).

The model is constructed once per process as a *skeleton* (compiler/loading.py
`load_skeleton`): parameters on the meta device, buffers computed by the
constructor on CPU. `materialize(model, seed, names)` then gives real storage
to the named parameters and buffers only, and initialises them module by
module: every module that directly owns one of them runs its init rule
(`reset_parameters()`, then the model's `_init_weights(module)`, see
`compiler.loading.init_rule`) under `torch.manual_seed(module_seed(seed,
path))`. A parameter's initial value is therefore a function of the plan's seed
and the module owning it, never of which other modules a process holds: a rank
holding stages 2-3 and the single-process reference holding everything draw
identical tensors.

* A tied parameter (embedding and LM head) is materialised once; every module
  owning it runs its rule, in model order (as the constructor did), so each
  holder draws the same value.
* Before the rules run, new storage is filled with NaN; a named tensor still
  NaN afterwards was not covered by the model's init and is refused by name.
* Buffers keep the constructor's values (rotary inv_freq, masks); a rule may
  recompute them (Hugging Face's `_init_weights` does for rotary embeddings).

`INIT_SOURCES` is where a weights file will later replace the init per tensor:
`materialize(..., source=...)` takes the tensors it names from there instead.
"""
from __future__ import annotations

import hashlib
from typing import Callable, Iterable, Mapping, Optional

import torch
from torch import nn

from ..errors import PipeplanError


def module_seed(seed: int, path: str) -> int:
    """The RNG seed of one module's init: a stable hash of (plan seed, module path)."""
    digest = hashlib.sha256(f"{seed}/{path}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _owners(model: nn.Module) -> dict[int, list[tuple[str, nn.Module, str]]]:
    """id(tensor) -> every (module path, module, attribute) that holds it directly."""
    out: dict[int, list] = {}
    for path, mod in model.named_modules(remove_duplicate=False):
        for store in (mod._parameters, mod._buffers):
            for leaf, t in store.items():
                if t is not None:
                    out.setdefault(id(t), []).append((path, mod, leaf))
    return out


def _replace(holders, new: torch.Tensor, is_param: bool) -> None:
    for _, mod, leaf in holders:
        (mod._parameters if is_param else mod._buffers)[leaf] = new


def materialize(model: nn.Module, seed: int, names: Optional[Iterable[str]] = None,
                device: torch.device | str = "cpu",
                source: Optional[Mapping[str, torch.Tensor]] = None) -> int:
    """Give the parameters and buffers named by `names` (None: all) real storage on `device`
    and their deterministic initial values, in place; the others stay as they are (meta
    parameters). `source`, when given, supplies named tensors instead of the init.
    Returns the bytes of distinct parameters materialised."""
    from ..compiler.loading import init_rule

    device = torch.device(device)
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    wanted = set(params) | set(buffers) if names is None else set(names)
    unknown = sorted(wanted - set(params) - set(buffers))
    if unknown:
        raise PipeplanError(f"cannot materialise {unknown[:3]}: not in the model")
    owners = _owners(model)
    # Every module directly holding a wanted parameter runs its rule; all of its own
    # parameters get storage for that (so the rule draws from the RNG as in the reference).
    holders = {id(m) for n in wanted if n in params for _, m, _ in owners[id(params[n])]}
    fresh: dict[int, nn.Parameter] = {}  # id(materialised Parameter) -> it
    for path, mod in model.named_modules(remove_duplicate=False):
        if id(mod) not in holders:
            continue
        for leaf, p in list(mod._parameters.items()):
            if p is None or p.device.type != "meta":
                continue
            new = nn.Parameter(torch.full(p.shape, float("nan"), dtype=p.dtype, device=device)
                               if p.is_floating_point() else
                               torch.zeros(p.shape, dtype=p.dtype, device=device),
                               requires_grad=p.requires_grad)
            fresh[id(new)] = new
            _replace(owners[id(p)], new, True)
            owners[id(new)] = owners.pop(id(p))
    ran: set[int] = set()
    for path, mod in model.named_modules(remove_duplicate=False):
        if id(mod) not in holders or id(mod) in ran:
            continue
        ran.add(id(mod))  # a module reachable by two paths runs once, under its first path
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(module_seed(seed, path))
            for step in init_rule(model, mod):
                step()
    # What a rule needed but nobody asked for goes back to meta: bytes stay exact.
    keep = {id(p) for n, p in model.named_parameters(remove_duplicate=False) if n in wanted}
    for pid, p in fresh.items():
        if pid not in keep:
            _replace(owners[pid], nn.Parameter(p.detach().to("meta"),
                                               requires_grad=p.requires_grad), True)
    for name in sorted(n for n in wanted if n in buffers):
        b = model.get_buffer(name)
        if b.device.type == "meta":
            raise PipeplanError(
                f"buffer `{name}` has no value: the constructor made it from a parameter (meta "
                "during construction); compute it in the module's reset_parameters() instead")
        if b.device != device:
            _replace(owners[id(b)], b.to(device), False)
    if source is not None:
        _load(model, source, wanted)
    _check_covered(model, wanted)
    done = {id(p): p for n, p in model.named_parameters(remove_duplicate=False) if n in wanted}
    return sum(p.numel() * p.element_size() for p in done.values())


def _load(model: nn.Module, source: Mapping[str, torch.Tensor], wanted: set[str]) -> None:
    """The hook for a weights file: named tensors replace the init (same shape and dtype)."""
    with torch.no_grad():
        for name, t in model.state_dict(keep_vars=True).items():
            if name in wanted and name in source:
                t.copy_(source[name])


def _check_covered(model: nn.Module, wanted: set[str]) -> None:
    for name, p in model.named_parameters(remove_duplicate=False):
        if name in wanted and p.is_floating_point() and bool(torch.isnan(p).any()):
            owner = name.rpartition(".")[0]
            raise PipeplanError(
                f"parameter `{name}` was not initialised: no rule of module `{owner}` "
                f"({type(model.get_submodule(owner)).__name__}) set it (its reset_parameters() "
                f"or {type(model).__name__}._init_weights(module)); see docs/runtime.md, "
                "Initial weights")


def param_bytes(modules: Iterable[nn.Module]) -> int:
    """Bytes of the distinct materialised (non-meta) parameters of `modules`."""
    seen: dict[int, torch.Tensor] = {}
    for m in modules:
        for p in m.parameters():
            if p.device.type != "meta":
                seen[id(p)] = p
    return sum(p.numel() * p.element_size() for p in seen.values())


def install(stage: nn.Module, model: nn.Module, names: Iterable[str],
            is_param: Callable[[str], bool]) -> None:
    """Point `stage`'s tensors at the model's materialised ones, by qualified name (tied
    names get the same object)."""
    for name in names:
        owner, _, leaf = name.rpartition(".")
        mod = stage.get_submodule(owner)
        if is_param(name):
            mod._parameters[leaf] = model.get_parameter(name)
        else:
            mod._buffers[leaf] = model.get_buffer(name)


def fake_copy(module: nn.Module, device: str = "cpu") -> nn.Module:
    """A copy of a (meta) stage module whose tensors are FakeTensors on `device`: it runs
    shapes and dtypes (autocast's included) without storage. Call inside the FakeTensorMode."""
    import copy

    import torch.fx as fx

    memo = {}  # tensors are not copied: each becomes a meta stand-in, then a fake one
    for t in list(module.parameters()) + list(module.buffers()):
        memo[id(t)] = t.detach().to("meta")
    out = copy.deepcopy(module, memo)
    for mod in out.modules():
        for store, wrap in ((mod._parameters, True), (mod._buffers, False)):
            for k, t in list(store.items()):
                if t is not None:
                    x = torch.empty(t.shape, dtype=t.dtype, device=device)
                    store[k] = nn.Parameter(x, requires_grad=t.requires_grad) if wrap else x
    if isinstance(out, fx.GraphModule):
        target = torch.device(device)
        for node in out.graph.nodes:
            node.args, node.kwargs = torch.utils._pytree.tree_map_only(
                torch.device, lambda _: target, (node.args, node.kwargs))
        out.recompile()
    return out
