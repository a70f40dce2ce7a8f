"""A repeated block's meta run, replayed from its first run instead of run again.

A layer stack runs the same ops on the same shapes in every layer: an 80-layer model's
meta run (analysis.MetaRun, and its bf16 autocast run for saved records) spent most of
its time running layers 2..80 to learn what layer 1 had already shown. Here the graph's
nodes are cut into segments, one per run of consecutive nodes in one block (capture/
blocks.py), and each segment gets a static form: every node by its position (op; target,
with the block's own module path taken out; arguments by position inside the segment or
as the k-th value from outside; each called module's class, plain attributes, parameters'
and buffers' shapes, strides and dtypes; a fetched attribute's spec). When a segment's
form matches one already run, and the values it reads from outside match too (spec, view
or not, parameter or not, saved already or not, which of them share a storage), its nodes
get that run's results, renamed: new meta tensors of the same specs, the same FLOPs, ops
and work, and the saved/output storages keyed exactly as running it would key them (the
storage counter advanced alike, names mapped node for node, outside storages to this
segment's own). Anything that cannot be mapped so (an owner or storage from elsewhere, an
output a later segment reads as a view or a cast copy) makes the segment run for real:
replay is exact or not used. tests/compiler/test_capture.py compares whole runs with and
without it.
"""
from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.fx as fx
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_leaves, tree_map_only

from .blocks import block_of, module_path

ENABLED = True  # tests turn it off to compare runs
_META = torch.device("meta")


@dataclass(frozen=True)
class _Spec:
    shape: tuple
    stride: tuple
    dtype: torch.dtype
    requires_grad: bool


@dataclass
class _Run:
    """One segment as it ran: what a replay copies and maps."""

    block: str
    nodes: list  # its nodes
    outside: list  # the nodes outside it that it reads, in order of first use
    reads: tuple  # their values' signature (`_reads`)
    read_keys: list  # their tensors' storage keys, leaf by leaf
    first: int  # the storage counter when it began
    created: list  # (key, (owner, source)) of the storages keyed inside it, in order
    values: list  # per node: its value with _Specs for tensors
    leaf_keys: list  # per node: its tensor leaves' storage keys (None: a parameter)
    leaf_saved: list  # per node: whether each leaf's storage was saved


class Replays:
    """Segments by block for one MetaRun: run each form once, replay the rest."""

    def __init__(self, blocks):
        self.blocks = set(blocks)
        self.runs: dict = {}  # form -> _Run (None: a form that cannot be replayed)
        self.replayed = 0  # segments replayed (tests read it)

    def segments(self, nodes: list) -> list[tuple[Optional[str], list]]:
        out: list = []
        for n in nodes:
            b = block_of(module_path(n), self.blocks) if n.op != "placeholder" else None
            if out and out[-1][0] == b:
                out[-1][1].append(n)
            else:
                out.append((b, [n]))
        return out

    def enter(self, run, block: str, seg: list) -> Optional[tuple]:
        """Replay `seg` from the run of its form (None), or say what `finish` needs after
        the caller runs it: its form, what it reads, and the run's counters now."""
        form, outside = static_form(run.gm, block, seg)
        reads = _reads(run, outside)
        if ENABLED and self._replay(run, block, seg, form, outside, reads):
            return None
        return form, outside, reads, len(run._alive), len(run._owners)

    # ---------------------------------------------------------------- recording
    def finish(self, run, block: str, seg: list, start: tuple) -> None:
        form, outside, (reads, read_keys), first, owners = start
        if form in self.runs:
            return
        created = list(run._owners.items())[owners:]
        inside = set(seg)
        ok = len(created) == len(run._alive) - first
        values, leaf_keys, leaf_saved = [], [], []
        for n in seg:
            value = run.values[n]
            keys, saved = [], []
            exported = any(u not in inside for u in n.users)
            for t in tree_leaves(value):
                if not isinstance(t, torch.Tensor):
                    continue
                base = t._base if t._base is not None else t
                param = id(base) in run._param_ids
                keys.append(None if param else run._keys.get(id(base)))
                saved.append(id(base) in run._saved)
                if exported and n.op != "get_attr" and (t._base is not None or param):
                    ok = False  # a later segment would read it as a view or a parameter
                if not param and keys[-1] is None:
                    ok = False
            values.append(tree_map_only(torch.Tensor, _spec, value))
            leaf_keys.append(keys)
            leaf_saved.append(saved)
        self.runs[form] = _Run(block, list(seg), outside, reads, read_keys, first, created,
                               values, leaf_keys, leaf_saved) if ok else None

    # ----------------------------------------------------------------- replaying
    def _replay(self, run, block: str, seg: list, form: tuple, outside: list,
                reads: tuple) -> bool:
        """Give `seg` the results of the run of its form, renamed; False: run it."""
        was = self.runs.get(form)
        reads, read_keys = reads
        if was is None or reads != was.reads:
            return False
        mapped = _Mapping(was, block, seg, outside, read_keys, len(run._alive))
        costs = mapped.costs(run)
        if costs is None:
            return False
        self._commit(run, was, seg, mapped, costs)
        self.replayed += 1
        return True

    def _commit(self, run, was: _Run, seg: list, mapped: "_Mapping", costs: list) -> None:
        run._owners.update(mapped.created)
        run._alive.extend([None] * len(was.created))  # the counter as a run advances it
        inside = set(seg)
        # a fetched attribute as the run makes it (its parameter stand-in) where anything
        # may read it: a later segment, or the compiler after the meta run (whose values
        # it reads; an autocast run's are read by no one)
        real = [n.op == "get_attr" and (run.autocast is None or
                                        any(u not in inside for u in n.users)) for n in seg]
        exported = [any(u not in inside for u in n.users) for n in seg]
        with _disable_current_modes():  # what no later node reads: meta tensors, built
            # outside the run's modes (nothing counted, nothing faked: the cheap way)
            quiet = [tree_map_only(_Spec, lambda s: _build(s, _META, leaf=True), spec)
                     if not e and not r else None
                     for spec, e, r in zip(was.values, exported, real)]
        with run._ops.paused():
            for n, spec, keys, saved, cost, e, q, r in zip(
                    seg, was.values, was.leaf_keys, was.leaf_saved, costs, exported, quiet,
                    real):
                if r:
                    value = run._to_meta(_fetch(run.gm, n.target), name=n.target)
                else:  # what a later segment reads: as the run would hand it over
                    value = q if not e else \
                        tree_map_only(_Spec, lambda s: _build(s, run._device), spec)
                leaves = [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
                for t, key, was_saved in zip(leaves, keys, saved):
                    if key is None:
                        continue
                    base = t._base if t._base is not None else t
                    run._keys.setdefault(id(base), mapped.key(key))
                    run._held.append(base)  # kept alive: its id stays its key's
                    if was_saved:
                        run._saved.setdefault(id(base), base)
                run.values[n] = value
                run.costs[n] = cost


class _Mapping:
    """Names of the run of a form -> names in the segment replayed from it."""

    def __init__(self, was: _Run, block: str, seg: list, outside: list, read_keys: list,
                 counter: int):
        self.was, self.block = was, block
        self.names = {a.name: b.name for a, b in zip(was.nodes, seg)}
        self.names.update((a.name, b.name) for a, b in zip(was.outside, outside))
        self.keys = {a: b for a, b in zip(was.read_keys, read_keys) if a is not None}
        self.failed = False
        for key, _ in was.created:
            node, _, number = key.rpartition("#")
            if node not in self.names or not number.isdigit():
                self.failed = True
                return
            self.keys[key] = f"{self.names[node]}#{counter + int(number) - was.first}"

    def key(self, k: str) -> str:
        if k in self.keys:
            return self.keys[k]
        node, _, suffix = k.rpartition("#")  # a fused attention's own (#lse, #cast0)
        if node in self.names and not suffix.isdigit():
            return f"{self.names[node]}#{suffix}"
        raise KeyError(k)

    def owner(self, o: str) -> str:
        if o.startswith("param:"):
            p = o[len("param:"):]
            old = self.was.block
            if p.startswith(old + "."):
                return "param:" + self.block + p[len(old):]
            raise KeyError(o)
        return self.names[o]

    def costs(self, run) -> Optional[list]:
        """Each node's NodeCost renamed, or None where a name cannot be mapped."""
        if self.failed:
            return None
        try:
            self.created = [(self.keys[k], (self.owner(o), self.key(s) if s else ""))
                            for k, (o, s) in self.was.created]
            return [self._cost(run.costs[n]) for n in self.was.nodes]
        except KeyError:
            return None

    def _cost(self, c):
        saves = tuple(dataclasses.replace(s, key=self.key(s.key), owner=self.owner(s.owner),
                                          source=self.key(s.source) if s.source else "")
                      for s in c.saves)
        return dataclasses.replace(c, saves=saves,
                                   outs=tuple((self.key(k), b) for k, b in c.outs))


def static_form(gm: fx.GraphModule, block: str, seg: list) -> tuple[tuple, list]:
    """The nodes `seg` (of `gm`'s graph) by position, with the block's module path taken out;
    and the nodes outside it that they read, in order of first use. (Also the form of a
    stage graph's nodes, planner/repeats.py: a placeholder is named by its position.)"""
    at = {n: i for i, n in enumerate(seg)}
    outside: list = []

    def arg(a: fx.Node):
        if a in at:
            return ("at", at[a])
        if a not in outside:
            outside.append(a)
        return ("outside", outside.index(a))

    def path(p: str) -> str:
        return "<block>" + p[len(block):] if p == block or p.startswith(block + ".") else p

    out = []
    for n in seg:
        args = repr(fx.node.map_arg((n.args, n.kwargs), arg))
        if n.op == "call_module":
            target = (path(n.target), _module_form(gm.get_submodule(n.target)))
        elif n.op == "get_attr":
            target = (path(n.target), _value_form(_fetch(gm, n.target)))
        else:  # a placeholder's target is its global name: its position names it here
            target = None if n.op == "placeholder" else n.target
        out.append((n.op, target, args, path(module_path(n) or "")))
    return tuple(out), outside


def _module_form(module: torch.nn.Module) -> tuple:
    """What a call of `module` can depend on: each submodule's class and plain attributes,
    each parameter's and buffer's spec."""
    plain = (int, float, bool, str, type(None))
    return tuple(
        (name, type(m), tuple(sorted((k, repr(v)) for k, v in vars(m).items()
                                     if isinstance(v, plain) or isinstance(v, tuple)
                                     and all(isinstance(x, plain) for x in v))),
         tuple((k, _value_form(t)) for k, t in (*m.named_parameters(recurse=False),
                                                *m.named_buffers(recurse=False))))
        for name, m in module.named_modules(remove_duplicate=False))


def _value_form(v: Any) -> tuple:
    if isinstance(v, torch.Tensor):
        return (tuple(v.shape), tuple(v.stride()), v.dtype, bool(v.requires_grad),
                isinstance(v, torch.nn.Parameter))
    return (repr(v),)


def _reads(run, outside: list) -> tuple[tuple, list]:
    """The values the segment reads from outside: each tensor's spec, whether it is a view,
    a parameter, saved already, and which of them share a storage (by first appearance);
    other values by repr. And their storage keys, leaf by leaf."""
    sig, keys, order = [], [], {}
    for n in outside:
        for t in tree_leaves(run.values.get(n)):
            if not isinstance(t, torch.Tensor):
                sig.append(repr(t))
                continue
            base = t._base if t._base is not None else t
            key = run._keys.get(id(base))
            keys.append(key)
            sig.append((_spec(t), t._base is not None, id(base) in run._param_ids,
                        id(base) in run._saved, order.setdefault(id(base), len(order))))
    return tuple(sig), keys


def _spec(t: torch.Tensor) -> _Spec:
    return _Spec(tuple(t.shape), tuple(t.stride()), t.dtype, bool(t.requires_grad))


def _build(s: _Spec, device: torch.device, leaf: bool = False) -> torch.Tensor:
    """A tensor of spec `s`; one requiring grad is made by an op (as a node's output is:
    a leaf would take other kernels' paths, a layer norm's input viewed first) unless
    `leaf` (a value no op will read)."""
    t = torch.empty_strided(s.shape, s.stride, dtype=s.dtype, device=device)
    if not (s.requires_grad and s.dtype.is_floating_point):
        return t
    if leaf:
        return t.requires_grad_(True)
    out = t.requires_grad_(True).clone()
    return out if tuple(out.stride()) == s.stride else \
        torch.empty_strided(s.shape, s.stride, dtype=s.dtype, device=device,
                            requires_grad=True)


def _fetch(gm: torch.nn.Module, target: str) -> Any:
    return operator.attrgetter(target)(gm)  # a dotted path, as fx's get_attr names it
