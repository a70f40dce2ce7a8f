"""Blocks that repeat: one saved-bytes walk per distinct block, not per block.

A layer stack's blocks are the same graph under other names: layer 6's stage graph is
layer 5's with `layers.6` for `layers.5` in its module paths and other global node names
(`add_41` for `add_37`). The unit tables (units.py) walk every block's stage graph for the
bytes it saves under each rewrite (activations.stage_saved_bytes: placements under TP,
recompute regions), nine rewrites per capture; on an 80-layer model that walk was the
largest part of a capture after the meta runs.

`Forms` gives each stage graph a form: every node's static form as the meta run's replay
reads it (compiler/capture/replay.static_form: op, target with the block's own name taken
out, arguments by position, called modules' classes, attributes and parameter specs), its
meta-run record with storage keys numbered in order of appearance and owners by position,
the TP kind of each module it calls, whether it draws random numbers or is a collective. Two stages with the same form,
the same recompute regions (by position), the same sequence-shard inputs and the same
per-node scale give the same bytes: the walk reads nothing else. Anything a form cannot
name by position (an owner outside the stage, a module of another block) stays as its
global name, so such stages never share a walk: a missed repeat costs time, never a wrong
number. tests/planner/test_planner.py compares the tables with and without it.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch.fx as fx

from ..compiler.capture.blocks import COLLECTIVE
from ..compiler.capture.replay import static_form
from ..compiler.recompute import draws_random, find_regions

ENABLED = True  # tests turn it off to compare the tables


class _At:
    """A node by its position in its stage graph (repr only: forms compare reprs)."""

    def __init__(self, i: int):
        self.i = i

    def __repr__(self) -> str:
        return f"%{self.i}"


class Forms:
    """Stage graph -> (its form's number, node name -> position), per TP kinds."""

    def __init__(self, records: dict, kinds: dict, blocks: tuple[str, ...]):
        self.records, self.kinds, self.blocks = records, kinds, blocks
        self._of: dict[int, tuple] = {}  # id(module) -> (module, number, positions)
        self._numbers: dict[tuple, int] = {}

    def of(self, module: fx.GraphModule, index: int) -> tuple[int, dict]:
        if id(module) not in self._of:
            form, where = _form(module, self.blocks[index], self.records, self.kinds)
            number = self._numbers.setdefault(form, len(self._numbers))
            self._of[id(module)] = (module, number, where)  # module kept: its id stays
        return self._of[id(module)][1:]


def cached_walk(walk: Callable, forms: Optional[Forms], rules, scale: dict) -> Callable:
    """`walk(module, t, shards)` (the saved bytes of a stage under one rewrite), computed
    once per (form, tp, shard inputs, regions, scale) when repeats are enabled."""
    done: dict = {}
    local: dict = {}  # id(module) -> (module, its regions and scale by position)

    def saved(module, index: int, t: int, shards: frozenset = frozenset()) -> int:
        if forms is None or not ENABLED:
            return walk(module, t, shards)
        number, where = forms.of(module, index)
        if id(module) not in local:
            local[id(module)] = (module, (
                tuple((r.mode, tuple(where[n.name] for n in r.nodes))
                      for r in find_regions(module.graph, rules)),
                tuple((where[n], s) for n, s in sorted(scale.items()) if n in where)))
        key = (number, t, tuple(sorted(where[n] for n in shards))) + local[id(module)][1]
        if key not in done:
            done[key] = walk(module, t, shards)
        return done[key]
    return saved


def _form(module: fx.GraphModule, block: str, records: dict, kinds: dict) -> tuple:
    nodes = list(module.graph.nodes)
    static, _ = static_form(module, block, nodes)  # every argument is inside: a stage graph
    where = {n.name: i for i, n in enumerate(nodes)}
    keys: dict[str, str] = {}

    def key(k: str) -> str:
        return keys.setdefault(k, f"k{len(keys)}")

    def owner(o: str) -> object:
        if o.startswith("param:"):
            p = o[len("param:"):]
            return ("param", _path(p, block), kinds.get(p.rpartition(".")[0]))
        return _At(where[o]) if o in where else o

    out = []
    for n, form in zip(nodes, static):
        kind = kinds.get(n.target if n.op == "call_module" else n.target.rpartition(".")[0]) \
            if n.op in ("call_module", "get_attr") else None
        c = records.get(n.name)
        record = None if c is None else (
            c.flops, c.tensor_out, tuple((key(k), b) for k, b in c.outs),
            tuple((key(s.key), s.nbytes, owner(s.owner), s.dims,
                   key(s.source) if s.source else "") for s in c.saves))
        out.append((form, kind, repr(record), bool(n.meta.get(COLLECTIVE)),
                    n.op not in ("placeholder", "output") and draws_random(n)))
    return tuple(out), where


def _path(p: str, block: str) -> str:
    return "<block>" + p[len(block):] if p == block or p.startswith(block + ".") else p
