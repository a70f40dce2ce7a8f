"""What the model's constructor did to its parameters, watched while the skeleton is built.

The skeleton (loading.load_skeleton: the constructor run on CPU, each parameter moved to
meta as it is registered) is built under `Watch`, a dispatch mode that keeps two records,
read back by parameter name:

* **Constants** (`constructor_constants`). A parameter no init rule writes (init_rules.py)
  keeps the value its constructor computed when that value is a constant of the code:
  nanoGPT's `LayerNorm` holds `nn.Parameter(torch.ones(n))` and has no rule, Apertus's
  xIELU holds `log(expm1(tensor(0.8)))`. Every construction gives such a parameter the same
  value, so the ranks and the single-process reference each take it from their own
  skeleton. `Watch` marks every storage an op fills from the random generator (the ops torch
  tags `nondeterministic_seeded`) or leaves uninitialised (`empty` and its kin), and every
  storage an op computes or writes from a marked one; an op overwriting a storage whole from
  unmarked values (`fill_`, `zero_`, `copy_`) unmarks it. A mark lives as long as its
  storage (a weak reference: torch keeps one Python object per live storage), so a new
  storage never inherits one. A parameter registered with an unmarked CPU value is kept,
  with that value, until an op writes it. What torch does not dispatch (numpy's random
  generator behind `torch.tensor(array)`) this mode cannot see: `init_rules.check_init`
  takes a constant only where two skeletons built under different seeds agree on it.
* **Writes** (`constructor_writes`): every in-place op on a parameter after it was
  registered, in order (op and its other arguments). materialize.py compares them with what
  the parameter's init rule writes: where the constructor wrote the rule's writes and then
  more -- nanoGPT re-draws each `c_proj.weight` at std 0.02/sqrt(2 x layers) after
  `apply(_init_weights)` drew it at 0.02 -- the rest is replayed after the rule, so the
  parameter is drawn from the constructor's distribution.

**Copies** (`constructor_copies`), on the meta build `pipeplan check` makes (loading.py's
`_MetaBuild` reports every call to `Copies`): the parameters the constructor made by
cloning a tensor it had drawn (an initialiser or a random factory) and wrote nothing into
after -- `copy.deepcopy` of a module, as `nn.TransformerEncoder` clones the layer it is
given, or `nn.Parameter(other.weight.clone())`. In the user's model they start equal to
their source; drawn module by module (materialize.py) they would not: check refuses them
(init_rules.check_init).

Both records of the skeleton are keyed by the parameter's meta storage and hold it, so no other storage can
take its address: a constructor that swaps its parameters' storages at the end
(`model.double()` sets each `.data`) leaves them with no record at all -- no constant (check
refuses what no rule writes, as before) and nothing replayed.
"""
from __future__ import annotations

import weakref
from typing import Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

_aten = torch.ops.aten
_UNINITIALISED = frozenset({_aten.empty.memory_format, _aten.empty_strided.default,
                            _aten.new_empty.default, _aten.new_empty_strided.default,
                            _aten.empty_like.default, _aten.resize_.default})
_OVERWRITES = frozenset({_aten.fill_.Scalar, _aten.fill_.Tensor, _aten.zero_.default,
                         _aten.copy_.default})

_FOUND: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()
_LAYOUT = "layout"  # a write into part of a parameter not laid out as a fresh one is (where)


def _storage(t) -> Optional[torch.UntypedStorage]:
    """`t`'s storage object (one per storage while it lives: a weak reference to it dies
    with the storage), or None."""
    if not isinstance(t, torch.Tensor):
        return None
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse and other storage-less layouts
        return None


def _key(t) -> Optional[int]:
    s = _storage(t)
    return None if s is None else s._cdata


def written(func, args, kwargs) -> Optional[torch.Tensor]:
    """The tensor an in-place op writes (its first argument, marked written), or None."""
    first = func._schema.arguments[0] if func._schema.arguments else None
    if first is not None and first.alias_info is not None and first.alias_info.is_write:
        t = args[0] if args else kwargs.get(first.name)
        if isinstance(t, torch.Tensor):
            return t
    return None


def write_entry(func, args, kwargs) -> tuple:
    """One in-place write as (op, its other arguments, keyword arguments, where): an argument
    that is a tensor (a copy from another value) is recorded as None: such a write cannot be
    replayed from the record (`replayable`); `where` is None when the op wrote its whole
    storage, else the written view's (size, stride, storage offset) -- `weight[0].zero_()`
    writes one row, and replayed on the whole parameter it zeroed every row (stop 61)."""
    def plain(v):
        return None if isinstance(v, torch.Tensor) else v
    target = written(func, args, kwargs)
    where = None if target is None or _whole(target) else \
        (tuple(target.shape), tuple(target.stride()), target.storage_offset())
    return (func, tuple(plain(a) for a in args[1:]),
            tuple(sorted((k, plain(v)) for k, v in kwargs.items())), where)


def replayable(entry: tuple) -> bool:
    _, args, kwargs, where = entry
    return None not in args and all(v is not None for _, v in kwargs) and where != _LAYOUT


def replay(entry: tuple, p: torch.Tensor) -> None:
    """Run a recorded write on `p` (contiguous, as the caller made it; the caller seeds the
    random generator), on the part of it the constructor wrote."""
    func, args, kwargs, where = entry
    func(p if where is None else p.as_strided(*where), *args, **dict(kwargs))


def draws_whole(entries) -> bool:
    """Do these writes make a parameter's value from nothing it held before: all replayable,
    the first overwriting it whole by a random draw or a fill (MultiheadAttention's
    constructor draws `in_proj_weight` by xavier_uniform_ in its private
    `_reset_parameters()`, which no per-module rule calls)? Replayed, they draw it from the
    constructor's distribution (backends/state/materialize.py)."""
    if not entries or not all(map(replayable, entries)):
        return False
    func, _, _, where = entries[0]
    return where is None and (func in _OVERWRITES
                              or torch.Tag.nondeterministic_seeded in func.tags)


def _whole(t: torch.Tensor) -> bool:
    return t.storage_offset() == 0 and \
        t.numel() * t.element_size() == t.untyped_storage().nbytes()


class Writes(TorchDispatchMode):
    """Records every in-place write, by the written storage (`log`: key -> entries)."""

    def __init__(self):
        super().__init__()
        self.log: dict[int, list] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = written(func, args, kwargs)
        if target is not None:
            self.log.setdefault(_key(target), []).append(write_entry(func, args, kwargs))
        return func(*args, **kwargs)


class Watch(TorchDispatchMode):
    """Marks what the random generator or uninitialised memory reached; keeps parameters
    registered with unmarked values until something writes them; records every write on a
    registered (meta) parameter (see the module docstring)."""

    def __init__(self):
        super().__init__()
        self.marked = weakref.WeakSet()  # storages: a mark dies with its storage
        # keyed by a meta storage's address, the storage held so no other takes it (a
        # parameter's `.data` swapped by `model.double()` frees its old one)
        self.kept: dict[int, tuple] = {}  # -> (the storage, the parameter's value)
        self.writes: dict[int, tuple] = {}  # -> (the storage, entries)
        # a clone of a drawn parameter's key -> (its storage, the source's key, the source's
        # writes then): the clone starts with the source's history (copy.deepcopy's)
        self.copies: dict[int, tuple] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        target = written(func, args, kwargs)
        if func is _aten.clone.default and isinstance(out, torch.Tensor) and out.is_meta \
                and _key(args[0]) in self.writes:  # a clone starts with its source's history
            history = list(self.writes[_key(args[0])][1])
            self.writes[_key(out)] = (_storage(out), history)
            if _storage(args[0]) in self.marked:  # a copy of a draw
                self.copies[_key(out)] = (_storage(out), _key(args[0]), len(history))
        if target is not None and target.is_meta:
            self.kept.pop(_key(target), None)
            self.writes.setdefault(_key(target), (_storage(target), []))[1].append(
                write_entry(func, args, kwargs))
        inputs = [_storage(t) for t in tree_leaves((args, kwargs)) if t is not target]
        tainted = func in _UNINITIALISED or torch.Tag.nondeterministic_seeded in func.tags \
            or any(k is not None and k in self.marked for k in inputs)
        changed = [target] if target is not None else tree_leaves(out)
        for k in filter(None, map(_storage, changed)):
            if tainted:
                self.marked.add(k)
            elif target is not None and func in _OVERWRITES and _whole(target):
                self.marked.discard(k)  # overwritten whole from unmarked values
        return out

    def register(self, value: torch.Tensor, moved: torch.Tensor) -> None:
        """`value` (the constructor's) was registered as a parameter, now `moved` to meta."""
        if value.device.type == "cpu" and _storage(value) not in self.marked:
            self.kept[_key(moved)] = (_storage(moved), value.detach())

    def found(self, model: torch.nn.Module) -> None:
        """Records `model`'s kept constants and parameter writes, by every name they have."""
        named = [(n, p) for n, p in model.named_parameters(remove_duplicate=False)
                 if p.is_meta]
        untouched = {n: self.copies[_key(p)][1] for n, p in named if _key(p) in self.copies
                     and len(self.writes[_key(p)][1]) == self.copies[_key(p)][2]}
        changed = {src for _, src, n in self.copies.values() if len(self.writes[src][1]) > n}
        drawn = {n for n, p in named if _storage(p) in self.marked}
        leaders, _ = copy_leaders(model, untouched, drawn,
                                  {_key(p): n for n, p in reversed(named)}, changed)
        _FOUND[model] = ({n: self.kept[_key(p)][1] for n, p in named if _key(p) in self.kept
                          and self.kept[_key(p)][1].shape == p.shape},
                         {n: _placed(p, self.writes[_key(p)][1]) for n, p in named
                          if _key(p) in self.writes}, leaders)


def _placed(p: torch.Tensor, entries: list) -> list:
    """`entries` as replay places them on a fresh contiguous parameter: a partial write's
    geometry is kept where `p` itself is laid out so, else marked unreplayable."""
    if p.is_contiguous() and p.storage_offset() == 0:
        return entries
    return [e if e[3] is None else e[:3] + (_LAYOUT,) for e in entries]


_DRAWS = frozenset({"normal_", "uniform_", "trunc_normal_", "orthogonal_", "sparse_",
                    "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_",
                    "exponential_", "random_", "bernoulli_", "log_normal_", "cauchy_",
                    "geometric_"})  # initialisers that draw (loading._FILLS' random ones)
_RANDOM_FACTORIES = frozenset({"rand", "randn", "randint", "normal", "randperm", "rand_like",
                               "randn_like", "randint_like"})
_COPIES: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()


class Copies:
    """Which meta storages the constructor cloned from a drawn one and did not write after
    (see the module docstring); fed every call of the meta build (loading._MetaBuild)."""

    def __init__(self):
        self.drawn = weakref.WeakSet()  # storages an initialiser or random factory drew
        self.copied: dict[int, tuple] = {}  # a clone's key -> (its storage, the source's)
        self.sources = weakref.WeakSet()  # storages cloned
        self.changed = weakref.WeakSet()  # sources written after a clone was made of them

    def _wrote(self, s) -> None:
        self.copied.pop(s._cdata, None)  # written after the copy: its own value now
        if s in self.sources:
            self.changed.add(s)

    def filled(self, name: str, t: torch.Tensor) -> None:
        """An initialiser `name` on the meta tensor `t` (which the build does not run)."""
        s = _storage(t)
        if s is None:
            return
        self._wrote(s)
        if name in _DRAWS:
            self.drawn.add(s)
        else:
            self.drawn.discard(s)

    def called(self, name: str, args: tuple, out) -> None:
        """Any other call of the build, with its result."""
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if name in _RANDOM_FACTORIES and isinstance(out, torch.Tensor) and out.is_meta:
            self.drawn.add(_storage(out))
        elif name == "clone" and first is not None and first.is_meta \
                and _storage(first) in self.drawn and isinstance(out, torch.Tensor):
            s = _storage(out)
            self.copied[s._cdata] = (s, _storage(first))
            self.sources.add(_storage(first))
            self.drawn.add(s)
        elif first is not None and first.is_meta and (
                name == "__setitem__" or (name.endswith("_") and not name.startswith("_"))):
            s = _storage(first)  # an in-place op writes its first argument
            if s is not None:
                self._wrote(s)

    def found(self, model: torch.nn.Module) -> None:
        """Records the copies no draw reproduces (`copy_leaders`) by every name they have."""
        if not self.copied:
            return
        named = [(n, p) for n, p in model.named_parameters(remove_duplicate=False)
                 if p.is_meta]
        untouched = {n: self.copied[_key(p)][1]._cdata for n, p in named
                     if _key(p) in self.copied}
        drawn = {n for n, p in named if _storage(p) in self.drawn}
        _COPIES[model] = copy_leaders(model, untouched, drawn,
                                      {_key(p): n for n, p in reversed(named)},
                                      {c._cdata for c in self.changed})[1]


def copy_leaders(model: torch.nn.Module, copies: dict, drawn: set, source_names: dict,
                 changed: set) -> tuple[dict, dict]:
    """How copies are drawn as the constructor made them: (leaders, unreproducible).

    `copies`: name -> its source's storage key, for each parameter cloned from a drawn one
    and not written after; `drawn`: the names whose value is a draw (copies included);
    `source_names`: storage key -> its first parameter name in the model; `changed`: sources
    written after a clone was made. A module whose own drawn parameters are all copies
    (the rest constants: a LayerNorm's ones, MultiheadAttention's zero biases) takes the draw
    of its leader -- the module whose own parameters are its sources (copy.deepcopy of an
    earlier layer), else the first module in model order copied from the same sources
    (nn.TransformerEncoder's clones of a layer outside the model): materialize.py draws it
    under the leader's seed, by the same rule (a deep copy has the same structure) and the
    same history (a clone inherits its source's writes), so it takes the same values.
    `leaders`: path -> leader path (where not itself). `unreproducible`: name -> its
    source's name (None: outside the model) for the copies of a module that also holds a
    parameter drawn on its own, or of a source written after the copy."""
    leaders, first_of, bad = {}, {}, {}
    for path, module in model.named_modules():
        own = [(leaf, f"{path}.{leaf}" if path else leaf)
               for leaf, p in module._parameters.items() if p is not None]
        hit = [(leaf, n) for leaf, n in own if n in copies]
        if not hit:
            continue
        sources = tuple((leaf, copies[n]) for leaf, n in hit)
        names = [source_names.get(k) for _, k in sources]
        inside = {n.rpartition(".")[0] for n in names if n is not None}
        leader = None
        if all(n in copies or n not in drawn for _, n in own) and \
                not changed.intersection(k for _, k in sources):
            if not inside:
                leader = first_of.setdefault(sources, path)
            elif len(inside) == 1 and None not in names:
                (owner,) = inside
                mine = [f"{owner}.{leaf}" if owner else leaf for leaf, _ in sources]
                leader = owner if names == mine else None
        if leader is None:
            bad.update({n: source_names.get(copies[n]) for _, n in hit})
        elif leader != path:
            leaders[path] = leader
    return leaders, bad


def constructor_copies(model: torch.nn.Module) -> dict[str, Optional[str]]:
    """name -> the parameter it is a copy of (None: a tensor outside the model), for each
    parameter the constructor cloned from a drawn one and did not write after whose value no
    draw reproduces (`copy_leaders`), for a model `load_model` built on meta; empty for any
    other."""
    return _COPIES.get(model, {})


def copy_leaders_of(model: torch.nn.Module) -> dict[str, str]:
    """path -> the module whose draw it takes (`copy_leaders`), for a skeleton."""
    return _FOUND.get(model, ({}, {}, {}))[2]


def constructor_constants(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """name -> the constant value the constructor gave that parameter and nothing rewrote,
    for a skeleton (loading.load_skeleton); empty for any other model."""
    return _FOUND.get(model, ({}, {}, {}))[0]


def constructor_writes(model: torch.nn.Module) -> dict[str, list]:
    """name -> the in-place writes the constructor made on that parameter once registered
    (write_entry's), for a skeleton; empty for any other model."""
    return _FOUND.get(model, ({}, {}, {}))[1]
