"""Heads through an attention region run under Ulysses (cp_regions.py): which dims of each
value are heads, and the literal head counts torch.export baked into views and expands
divided by cp (`split_heads`), the head dim of a weight read inside the region found where
it meets a value whose heads are known (`_weight_heads`). The same rule table as the
sequence locality walk (cp_rules.py) follows the heads, seeded with dim 1 of q, k, v."""
from __future__ import annotations

import torch
import torch.fx as fx

from .cp_rules import Dims, Mixing, NoRule, Op

SHAPED = ("view", "reshape", "_unsafe_view", "expand")


class _Values(fx.Interpreter):
    """Runs a program, keeping every node's value."""

    def __init__(self, gm):
        super().__init__(gm)
        self.values = {}

    def run_node(self, n):
        self.values[n] = super().run_node(n)
        return self.values[n]


class _Run:
    def __init__(self, values):
        self.values = values

    def value(self, n):
        return self.values[n]


def split_heads(program: fx.GraphModule, inputs: list, head_dims: list, cp: int) -> str:
    """Divide by cp the literal head counts of the program's views and expands (module
    docstring); returns why it cannot ("" when done)."""
    from .cp_locality import op_name, _rule

    rec = _Values(program)
    rec.run(*inputs)
    phs = [n for n in program.graph.nodes if n.op == "placeholder"]
    if any(d is None for d in head_dims):
        why = _weight_heads(program, rec.values, phs, head_dims)
        if why:
            return why
    dims = {}
    for n, d in zip(phs, head_dims):
        dims[n] = d
    for n in program.graph.nodes:
        if n.op not in ("call_function", "call_method"):
            continue
        carried = [a for a in n.all_input_nodes if dims.get(a)]
        name, _ = op_name(n, program)
        if not carried:
            dims[n] = Dims()
            continue
        rule = _rule(n, name, frozenset())
        if rule is None:
            return f"no rule follows the heads through `{name}` (node `{n.name}`)"
        try:
            dims[n] = rule(Op(n, _Run(rec.values), dims, name))
        except (Mixing, NoRule) as e:
            return f"`{name}` (node `{n.name}`) {e} over the heads"
        if name in SHAPED and isinstance(dims[n], frozenset):
            spread = not isinstance(n.args[1], (list, tuple))  # x.view(1, -1, 1, 1)
            shape = list(n.args[1:]) if spread else list(n.args[1])
            for d in dims[n]:
                if isinstance(shape[d], int) and shape[d] != -1:
                    if shape[d] % cp:
                        return f"node `{n.name}` has {shape[d]} heads, not divisible by {cp}"
                    shape[d] //= cp
            n.args = (n.args[0], *shape) if spread else (n.args[0], shape, *n.args[2:])
    program.recompile()
    return ""


CHAIN = ("view", "reshape", "_unsafe_view", "expand", "unsqueeze", "to", "_to_copy", "type",
         "type_as", "clone", "contiguous", "float", "double")


def _weight_heads(program: fx.GraphModule, values: dict, phs: list, head_dims: list) -> str:
    """Fill in head_dims (in place) for each weight (None): follow each weight through views,
    expands and casts (which weight dim each output dim is) to the first op where it meets
    a value whose heads are known -- a concatenation or an elementwise op, dims aligned --
    and take the weight dim sitting at the heads' position. Returns why not ("": done)."""
    from .cp_locality import op_name

    heads = {n: d for n, d in zip(phs, head_dims) if d is not None}
    chain = {n: (n, {i: i for i in range(values[n].dim())})
             for n, d in zip(phs, head_dims) if d is None}
    found: dict = {}
    for n in program.graph.nodes:
        if n.op not in ("call_function", "call_method"):
            continue
        name, _ = op_name(n, program)
        ins = [a for a in n.all_input_nodes if isinstance(values.get(a), torch.Tensor)]
        out = values[n]
        if not isinstance(out, torch.Tensor):
            continue
        known = [a for a in ins if heads.get(a)]
        mine = [a for a in ins if a in chain]
        if mine and not known and len(ins) == 1 and name in CHAIN:
            chain[n] = (chain[mine[0]][0], _follow(values[mine[0]], out, chain[mine[0]][1],
                                                   name))
            continue
        for a in mine:
            for k in known:
                for d in heads[k]:
                    pos = d + out.dim() - values[k].dim()  # the heads' dim in the output
                    mine_pos = pos - (out.dim() - values[a].dim())
                    if mine_pos in chain[a][1] and values[a].shape[mine_pos] == out.shape[pos]:
                        found.setdefault(chain[a][0], chain[a][1][mine_pos])
        if known:
            heads[n] = Dims({d + out.dim() - values[known[0]].dim() for d in heads[known[0]]})
    for i, (n, d) in enumerate(zip(phs, head_dims)):
        if d is None:
            if n not in found:
                return (f"the model tensor it reads as `{n.name}` meets no value whose heads "
                        "are known, so which of its dims are heads is not known")
            head_dims[i] = Dims({found[n]})
    return ""


def _follow(x: torch.Tensor, out: torch.Tensor, dims: dict, name: str) -> dict:
    """Output dim -> weight dim through one view, expand or cast."""
    if name in ("view", "reshape", "_unsafe_view"):
        pin, pout = [1], [1]
        for v in x.shape:
            pin.append(pin[-1] * v)
        for v in out.shape:
            pout.append(pout[-1] * v)
        got = {}
        for j in range(out.dim()):
            for i in range(x.dim()):
                if x.shape[i] > 1 and pin[i] == pout[j] and pin[i + 1] == pout[j + 1] \
                        and i in dims:
                    got[j] = dims[i]
        return got
    if name in ("expand", "unsqueeze"):
        if name == "unsqueeze":
            where = _unsqueezed(x, out)
            return {where[i]: dims[i] for i in dims}
        shift = out.dim() - x.dim()
        return {i + shift: dims[i] for i in dims if x.shape[i] == out.shape[i + shift]
                and x.shape[i] > 1}
    return dict(dims) if tuple(x.shape) == tuple(out.shape) else {}


def _unsqueezed(x: torch.Tensor, out: torch.Tensor) -> list:
    """For each dim of x, its dim in out (one size-1 dim inserted)."""
    j, got = 0, []
    for i in range(x.dim()):
        while out.shape[j] != x.shape[i]:
            j += 1
        got.append(j)
        j += 1
    return got
