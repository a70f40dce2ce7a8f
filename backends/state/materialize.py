"""Initial weights: each rank materialises only what it owns, from (seed, module path).

The model is constructed once per process as a *skeleton* (compiler/capture/loading.py
`load_skeleton`): parameters on the meta device, buffers computed by the
constructor on CPU. Initial values are drawn module by module
(`initial_values`): every module that directly owns a wanted parameter runs its
init rule (`reset_parameters()`, then the nearest enclosing module's
`_init_weights(module)`, see `compiler.capture.init_rules.init_rule`) on CPU under `torch.manual_seed(module_seed(seed,
path))`. A parameter's initial value is therefore a function of the plan's seed
and the module owning it, never of which other modules a process holds (nor of
its device: the rule always draws on CPU), so a rank holding stages 2-3 and the
single-process reference holding everything draw identical tensors.

Two separable steps, so a weights file can replace the first and keep the second:

* **values** — `initial_values(model, seed, names)` yields each wanted parameter's
  full value once the last module holding it has run its rule, then gives that
  module's storage back: the peak is one module's parameters (plus a tied
  parameter until its last holder ran), never the stage. `source=` (a mapping
  name -> tensor, e.g. a weights file) replaces the init per tensor.
* **slices** — `fill(targets, values, device)` gives each target parameter (meta,
  possibly a TP / EP shard marked by `sliced_parameter` with its `Slice` of the
  full tensor) storage on `device` holding exactly its slice, in place
  (`torch.utils.swap_tensors`: the Python object, and everything keyed by it,
  stays). With `source=` (a weights file, backends/state/weights.py) the names it holds
  skip the first step: `fill` reads each target's slice alone from the file
  (`source.read(name, slice.index())`), never the full tensor.

* A tied parameter (embedding and LM head) is drawn once; every module owning it
  runs its rule, in model order (as the constructor did), so each holder draws
  the same value.
* Before the rules run, new storage is filled with NaN; a wanted tensor still NaN
  afterwards was not covered by the model's init and is refused by name.
* Buffers keep the constructor's values (rotary inv_freq, masks).
* What the constructor did beyond the rule (compiler/capture/constructor.py): a
  parameter no rule writes keeps the constant the constructor made (nanoGPT's
  LayerNorm ones); writes the constructor made after the rule's are replayed after it
  (nanoGPT's c_proj drawn again at a smaller std).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Iterable, Iterator, Mapping, Optional

import torch
from torch import nn

from ...errors import PipeplanError


def module_seed(seed: int, path: str) -> int:
    """The RNG seed of one module's init: a stable hash of (plan seed, module path)."""
    digest = hashlib.sha256(f"{seed}/{path}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


# ------------------------------------------------------------------ slices
@dataclass(frozen=True)
class Slice:
    """The part of a full parameter one rank holds: `full.narrow(dim, start, length)`."""

    dim: int
    start: int
    length: int

    def take(self, full: torch.Tensor) -> torch.Tensor:
        return full.narrow(self.dim, self.start, self.length)

    def index(self) -> tuple[slice, ...]:
        """The same part as an index, `full[index]` (what a weights file reads)."""
        return (slice(None),) * self.dim + (slice(self.start, self.start + self.length),)

    def read(self, source, name: str) -> torch.Tensor:
        """This part alone from a weights file (weights.WeightSource)."""
        return source.read(name, self.index())


@dataclass(frozen=True)
class Pieces:
    """Several slices of one full parameter on one dim, held concatenated: a rank's shard of
    a fused projection split part by part (backends/parallel/tp/fused.py)."""

    slices: tuple[Slice, ...]

    @property
    def dim(self) -> int:
        return self.slices[0].dim

    def take(self, full: torch.Tensor) -> torch.Tensor:
        return torch.cat([s.take(full) for s in self.slices], dim=self.dim)

    def read(self, source, name: str) -> torch.Tensor:
        return torch.cat([s.read(source, name) for s in self.slices], dim=self.dim)


_SLICE = "_pipeplan_slice"  # attribute of a meta shard: the Slice fill() gives it


def sliced_parameter(full: nn.Parameter, dim: int, start: int, length: int) -> nn.Parameter:
    """A parameter holding `full`'s slice (the TP and EP rewrites' shards). A copy when `full`
    has storage; when it is meta (the runtime rewrites stages before materialising them) a
    meta parameter of the slice's shape, marked with its `Slice` for `fill`."""
    return part_parameter(full, Slice(dim, start, length))


def part_parameter(full: nn.Parameter, part) -> nn.Parameter:
    """A parameter holding `part` (a Slice or Pieces) of `full`, as `sliced_parameter`."""
    if full.device.type != "meta":
        return nn.Parameter(part.take(full.detach()).contiguous().clone(),
                            requires_grad=full.requires_grad)
    if getattr(full, _SLICE, None) is not None:
        raise PipeplanError("a parameter cannot be sliced twice before materialisation "
                            "(tensor and expert parallelism on one tensor)")
    shard = nn.Parameter(part.take(full.detach()).contiguous().clone(),
                         requires_grad=full.requires_grad)
    setattr(shard, _SLICE, part)
    return shard


def slice_of(p: torch.Tensor) -> Optional[Slice]:
    """The Slice a meta shard will hold (None: the whole tensor)."""
    return getattr(p, _SLICE, None)


# ------------------------------------------------------------------ values
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


def _to_meta(p: nn.Parameter) -> nn.Parameter:
    return nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"),
                        requires_grad=p.requires_grad)


def initial_values(model: nn.Module, seed: int, names: Iterable[str], keep: bool = False,
                   source: Optional[Mapping[str, torch.Tensor]] = None
                   ) -> Iterator[tuple[tuple[str, ...], torch.Tensor]]:
    """(names, full CPU value) of each distinct wanted parameter of the skeleton `model`,
    drawn module by module in model order (see the module docstring). With `keep` the
    values stay in `model`; without, each module's storage goes back to meta once its
    parameters are handed out. `source` supplies named tensors instead of the init."""
    from ...compiler.capture.constructor import Writes, constructor_constants, \
        constructor_writes, copy_leaders_of
    from ...compiler.capture.init_rules import init_rule

    constants, made = constructor_constants(model), constructor_writes(model)
    leaders = copy_leaders_of(model)  # deep copies: the draw of the module they copy
    ruled: dict[int, list] = {}  # id(parameter) -> the writes its rule made, every holder
    params = dict(model.named_parameters(remove_duplicate=False))
    wanted = set(names)
    unknown = sorted(wanted - set(params))
    if unknown:
        raise PipeplanError(f"cannot materialise {unknown[:3]}: not parameters of the model")
    owners = _owners(model)
    names_of: dict[int, list[str]] = {}
    for n in sorted(wanted):
        names_of.setdefault(id(params[n]), []).append(n)
    holders, seen = [], set()  # (path, module) directly holding a wanted parameter, model order
    for path, mod in model.named_modules(remove_duplicate=False):
        if id(mod) not in seen and any(p is not None and id(p) in names_of
                                       for p in mod._parameters.values()):
            seen.add(id(mod))  # a module reachable by two paths runs once, under its first
            holders.append((path, mod))
    last = {}  # id(parameter) -> index of the last holder module running a rule on it
    for i, (_, mod) in enumerate(holders):
        for p in mod._parameters.values():
            if p is not None:
                last[id(p)] = i
    for i, (path, mod) in enumerate(holders):
        for leaf, p in list(mod._parameters.items()):
            if p is None or p.device.type != "meta":
                continue
            new = nn.Parameter(torch.full(p.shape, float("nan"), dtype=p.dtype)
                               if p.is_floating_point() else torch.zeros(p.shape, dtype=p.dtype),
                               requires_grad=p.requires_grad)
            _replace(owners[id(p)], new, True)
            owners[id(new)] = owners.pop(id(p))
            for key in (names_of, last):
                if id(p) in key:
                    key[id(new)] = key.pop(id(p))
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(module_seed(seed, leaders.get(path, path)))
            with Writes() as rule:
                for step in init_rule(model, mod, path):
                    step()
            for p in mod._parameters.values():
                if p is not None:
                    ruled.setdefault(id(p), []).extend(
                        rule.log.get(p.untyped_storage()._cdata, ()))
            _keep_constants(mod, path, constants)
            _replay_the_rest(mod, path, made, ruled, [leaf for leaf, p in mod._parameters.items()
                                                      if p is not None and last.get(id(p)) == i])
        for leaf, p in list(mod._parameters.items()):
            if p is None or last.get(id(p)) != i:
                continue  # a later holder still runs its rule on it
            ruled.pop(id(p), None)  # its id may be reused once it is released
            if id(p) in names_of:
                value = p.detach()
                if source is not None:
                    value = _from_source(source, names_of[id(p)], value)
                _check_covered(model, names_of[id(p)][0], value)
                yield tuple(names_of[id(p)]), value
                if keep:
                    continue
            if p.device.type != "meta":
                _replace(owners[id(p)], _to_meta(p), True)


def _keep_constants(mod: nn.Module, path: str, constants: Mapping[str, torch.Tensor]) -> None:
    """A parameter the rule left unwritten (all NaN still) takes its constructor's constant,
    where it has one (compiler/capture/constructor.py)."""
    for leaf, p in mod._parameters.items():
        name = f"{path}.{leaf}" if path else leaf
        if p is not None and name in constants and p.is_floating_point() \
                and bool(torch.isnan(p).all()):
            p.copy_(constants[name])


def _replay_the_rest(mod: nn.Module, path: str, made: Mapping[str, list],
                     ruled: Mapping[int, list], leaves) -> None:
    """Where the constructor wrote a parameter as its rule does and then more (nanoGPT's
    `c_proj.weight`, drawn again at a smaller std), the rest is replayed after the rule, on
    the module's random stream (compiler/capture/constructor.py). `leaves`: the module's
    parameters whose last holder it is (a tied one: after every holder's rule)."""
    from ...compiler.capture.constructor import replay, replayable

    for leaf in leaves:
        p = mod._parameters[leaf]
        wrote, done = made.get(f"{path}.{leaf}" if path else leaf, ()), ruled.get(id(p), [])
        rest = wrote[len(done):]
        if rest and list(wrote[:len(done)]) == done and all(map(replayable, rest)):
            for entry in rest:
                replay(entry, p)


def _from_source(source: Mapping[str, torch.Tensor], names, value: torch.Tensor):
    """The hook for a weights file: a named tensor replaces the init (same shape)."""
    for n in names:
        if n in source:
            got = source[n]
            if tuple(got.shape) != tuple(value.shape):
                raise PipeplanError(f"`{n}`: the weights give shape {tuple(got.shape)}, the "
                                    f"model has {tuple(value.shape)}")
            return got.detach().to(dtype=value.dtype)
    return value


def _check_covered(model: nn.Module, name: str, value: torch.Tensor) -> None:
    """The run-time net under `check_init` (which cannot judge a rule that reads values)."""
    if value.is_floating_point() and bool(torch.isnan(value).any()):
        from ...compiler.capture.init_rules import init_owner

        path = name.rpartition(".")[0]
        owner = init_owner(model, path)
        hook = f"{type(owner).__name__}._init_weights(module)" if owner is not None else \
            "no enclosing _init_weights(module)"
        raise PipeplanError(
            f"parameter `{name}` was not initialised: no rule of module `{path}` "
            f"({type(model.get_submodule(path)).__name__}) set it (its reset_parameters() "
            f"or {hook}); see docs/runtime.md, Initial weights")


def fresh_meta(modules: Iterable[nn.Module]) -> None:
    """Replace each meta parameter of `modules` by a new meta Parameter (one per distinct
    tensor, shared by all its names), before the TP / EP rewrites see them: the compiler's
    capture may still reference the old ones, which would stop `fill` from swapping
    storage into them in place."""
    new: dict[int, nn.Parameter] = {}
    for m in modules:
        for mod in m.modules():
            for leaf, p in list(mod._parameters.items()):
                if p is not None and p.device.type == "meta" and slice_of(p) is None:
                    mod._parameters[leaf] = new.setdefault(id(p), _to_meta(p))


@dataclass(frozen=True)
class FlatTarget:
    """Part of a parameter that lives in a flat buffer (ZeRO, backends/parallel/zero/sharding.py): elements
    [lo, hi) of the parameter's local value (its `part` of the full tensor, or all of it),
    flattened, go to `dest` (a 1-D view of the buffer this rank owns)."""

    part: Optional[Slice]
    lo: int
    hi: int
    dest: torch.Tensor

    def put(self, local: torch.Tensor) -> None:
        self.dest.copy_(local.reshape(-1)[self.lo:self.hi])


def fill(targets: Mapping[str, Iterable[nn.Parameter]],
         values: Iterable[tuple[tuple[str, ...], torch.Tensor]],
         device: torch.device | str = "cpu", source=None,
         flat: Optional[Mapping[str, Iterable[FlatTarget]]] = None) -> int:
    """Give each meta target parameter storage on `device` holding its slice (`slice_of`,
    default all) of its full value, in the target's dtype, in place. `targets`: name ->
    the parameters of that name (a rank's stage modules may hold one under several names,
    or two stages one name). `flat`: name -> the parts of it that go into flat buffers
    already allocated (ZeRO: a rank's own range only), copied there. A name that `source`
    (a weights.WeightSource) holds is read from it, and only the target's slice
    (`source.read(name, Slice.index())`); `values` supply the others. Returns the bytes of
    the distinct parameters filled (not counting `flat`'s buffers)."""
    device = torch.device(device)
    done: dict[int, nn.Parameter] = {}
    flat = dict(flat or {})
    flat_done: set[str] = set()

    def local(name: str, part: Optional[Slice], value: Optional[torch.Tensor]) -> torch.Tensor:
        if value is None:  # from the weights file: the slice alone
            return part.read(source, name) if part is not None else source.read(name, None)
        return part.take(value) if part is not None else value

    def put_flat(name: str, value: Optional[torch.Tensor]) -> None:
        for target in flat.get(name, ()):
            target.put(local(name, target.part, value))
        flat_done.add(name)

    def put(name: str, t: nn.Parameter, data: torch.Tensor) -> None:
        if tuple(data.shape) != tuple(t.shape):
            raise PipeplanError(f"`{name}`: its value has shape {tuple(data.shape)}, "
                                f"the stage holds {tuple(t.shape)}")
        new = nn.Parameter(data.to(device=device, dtype=t.dtype, copy=True).contiguous(),
                           requires_grad=t.requires_grad)
        torch.utils.swap_tensors(t, new)  # same object: the layout's ids stay valid
        done[id(t)] = t

    for name in (n for n in targets if source is not None and n in source):
        for t in targets[name]:
            if id(t) not in done and t.device.type == "meta":
                put(name, t, local(name, slice_of(t), None))
    for name in (n for n in flat if source is not None and n in source):
        put_flat(name, None)
    for names, value in values:
        for name in names:
            for t in targets.get(name, ()):
                if id(t) not in done and t.device.type == "meta":
                    put(name, t, local(name, slice_of(t), value))
            if name in flat and name not in flat_done:
                put_flat(name, value)
    missing = sorted(n for n, ts in targets.items() for t in ts if t.device.type == "meta")
    missing += sorted(set(flat) - flat_done)
    if missing:
        raise PipeplanError(f"no initial value for {missing[:3]}")
    return sum(p.numel() * p.element_size() for p in done.values())


def materialize(model: nn.Module, seed: int, names: Optional[Iterable[str]] = None,
                device: torch.device | str = "cpu",
                source: Optional[Mapping[str, torch.Tensor]] = None) -> int:
    """Give the parameters and buffers of `model` named by `names` (None: all) real storage
    on `device` and their deterministic initial values, in place; the others stay meta.
    `source`, when given, supplies named tensors instead of the init. Returns the bytes of
    distinct parameters materialised. (The single-process reference calls it; a rank's
    stages are filled by `backends.model.fill_stages`.)"""
    device = torch.device(device)
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    wanted = set(params) | set(buffers) if names is None else set(names)
    unknown = sorted(wanted - set(params) - set(buffers))
    if unknown:
        raise PipeplanError(f"cannot materialise {unknown[:3]}: not in the model")
    nbytes = 0
    for held, value in initial_values(model, seed, [n for n in wanted if n in params],
                                      keep=True, source=source):
        p = model.get_parameter(held[0])
        if p.device != device or value.data_ptr() != p.data_ptr():  # moved, or from `source`
            torch.utils.swap_tensors(p, nn.Parameter(value.to(device=device, dtype=p.dtype,
                                                              copy=True),
                                                     requires_grad=p.requires_grad))
        nbytes += p.numel() * p.element_size()
    owners = _owners(model)
    for name in sorted(n for n in wanted if n in buffers):
        b = buffer_value(model, name, device)
        if b is not model.get_buffer(name):
            _replace(owners[id(model.get_buffer(name))], b, False)
    return nbytes


def buffer_value(model: nn.Module, name: str, device: torch.device | str,
                 dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """A skeleton buffer's constructor value on `device`, in `dtype` (the compiled stage's
    buffer's: compiler/estimate/precision.py `precision_dtype`) where both are floating or
    both complex."""
    b = model.get_buffer(name)
    if b.device.type == "meta":
        raise PipeplanError(
            f"buffer `{name}` has no value: the constructor made it from a parameter (meta "
            "during construction); compute it in the module's reset_parameters() instead")
    if dtype is not None and b.dtype != dtype and (
            (b.is_floating_point() and dtype.is_floating_point)
            or (b.is_complex() and dtype.is_complex)):
        return b.to(device=torch.device(device), dtype=dtype)
    return b.to(torch.device(device))


def param_bytes(modules: Iterable[nn.Module]) -> int:
    """Bytes of the distinct materialised parameters of `modules` (not meta, nor views of a
    released buffer: ZeRO-3's full parameters outside gather)."""
    seen: dict[int, torch.Tensor] = {}
    for m in modules:
        for p in m.parameters():
            if p.device.type != "meta" and p.untyped_storage().nbytes() > 0:
                seen[id(p)] = p
    return sum(p.numel() * p.element_size() for p in seen.values())


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
