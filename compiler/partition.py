"""Where each pipeline stage begins: explicit points, layer ranges, or `auto`.

A split is a list of module names where stages 1..S-1 begin. Graph nodes are
taken in execution order; stage k starts at the first node traced inside its
module, so glue between blocks (a residual add, a reshape) stays with the stage
before it. `auto` balances blocks (see blocks.py) by training cost: it minimises
the largest stage cost over contiguous groups of blocks (ties broken toward even
stages), so embedding, LM head, loss and MoE layers weigh what they cost.
"""
from __future__ import annotations

import bisect
import difflib
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.fx as fx

from ..dsl.ast import Plan
from ..dsl.errors import PlanError
from .capture.blocks import block_of, blocks_of, module_path, within
from .estimate.costs import Cost

COMPUTE_OPS = ("call_function", "call_method", "call_module")


@dataclass(frozen=True)
class Split:
    starts: tuple[str, ...]  # module names where stages 1..S-1 begin
    positions: tuple[int, ...]  # index in compute-node order where each begins

    def stage_of(self, index: int) -> int:
        return bisect.bisect_right(self.positions, index)

    @property
    def text(self) -> str:
        """The split in plan syntax, to pin it."""
        return "split = [" + ", ".join(f'"{s}"' for s in self.starts) + "]"


def compute_nodes(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if n.op in COMPUTE_OPS]


def choose_split(plan: Plan, model: torch.nn.Module, graph: fx.Graph,
                 costs: dict[fx.Node, Cost], param_bytes: dict[fx.Node, int],
                 measured: Optional[list[float]] = None) -> Split:
    """`measured`: seconds per compute node from the plan's cost file (profile.node_times),
    the weights of `auto(profile)`."""
    stages = plan.mesh.pp * plan.pipeline.virtual
    nodes = compute_nodes(graph)
    spec = plan.pipeline.split
    if stages == 1:
        return Split((), ())
    if spec.kind == "auto":
        weights = measured if spec.basis == "profile" and measured is not None else \
            _weights(plan, nodes, costs, param_bytes)
        return _auto(plan, model, nodes, weights, stages)
    if spec.kind == "points":
        names, key = spec.points, "pipeline.split"
    elif spec.kind == "ranges":
        names, key = _ranges_to_points(plan, model, stages), "pipeline.split"
    else:
        raise PlanError.at(plan, "pipeline.split", f"unknown split kind {spec.kind!r}")
    if len(names) != stages - 1:
        raise PlanError.at(plan, key, f"split names {len(names)} start points, but "
                           f"pp × virtual = {stages} stages need {stages - 1}",
                           f"give {stages - 1} module names where stages 1..{stages - 1} begin")
    positions = first_positions(plan, model, nodes, names, key)
    for a, b, na, nb in zip(positions, positions[1:], names, names[1:]):
        if b <= a:
            raise PlanError.at(plan, key, f"split point {nb!r} runs before {na!r}",
                               "list split points in execution order")
    if positions[0] == 0:
        raise PlanError.at(plan, key, f"split point {names[0]!r} leaves stage 0 empty",
                           "name where stage 1 begins, not stage 0")
    return Split(tuple(names), positions)


def _weights(plan: Plan, nodes: list[fx.Node], costs: dict[fx.Node, Cost],
             param_bytes: dict[fx.Node, int]) -> list[float]:
    basis = plan.pipeline.split.basis
    if basis == "flops":
        return [costs[n].total if n in costs else 0.0 for n in nodes]
    if basis == "params":
        return [float(param_bytes.get(n, 0)) for n in nodes]
    if basis == "profile":
        raise PlanError.at(plan, "pipeline.split", "auto(profile) balances measured op times, "
                           "but the plan names no cost file",
                           'add `profile = "costs.json"` to the pipeline section (write it with '
                           '`pipeplan profile PLAN -o costs.json`)')
    raise PlanError.at(plan, "pipeline.split", f"split basis {basis!r} is not supported",
                       'use basis "flops", "params" or "profile"')


def first_positions(plan: Plan, model, nodes: list[fx.Node], names, key: str) -> tuple:
    """The index of the first node run inside each module of `names` (one pass over the
    nodes: a split of an 80-layer model asks for 79)."""
    first: dict = {}  # module path -> its first node's index (every enclosing path too)
    for i, node in enumerate(nodes):
        path = module_path(node)
        while path and path not in first:
            first[path] = i
            path = path.rpartition(".")[0]
    return tuple(first[n] if n in first else first_position(plan, model, nodes, n, key)
                 for n in names)


def first_position(plan: Plan, model, nodes: list[fx.Node], name: str, key: str) -> int:
    for i, node in enumerate(nodes):
        if within(module_path(node), name):
            return i
    known = [n for n, _ in model.named_modules() if n]
    if name in known:
        raise PlanError.at(plan, key, f"module {name!r} runs no operation in the captured graph",
                           "split at a module the forward pass calls")
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"did you mean {close[0]!r}?" if close else \
        f"blocks: {', '.join(blocks_of(model)[:12])}"
    raise PlanError.at(plan, key, f"no module named {name!r} in the model", hint)


def _ranges_to_points(plan: Plan, model, stages: int) -> tuple[str, ...]:
    ranges = plan.pipeline.split.ranges
    if len(ranges) != stages:
        raise PlanError.at(plan, "pipeline.split", f"{len(ranges)} layer ranges for {stages} "
                           "stages", "give one range per stage (pp × virtual)")
    for a, b in zip(ranges, ranges[1:]):
        if a.prefix == b.prefix and a.stop != b.start:
            raise PlanError.at(plan, "pipeline.split", f"ranges {a.prefix}[{a.start}:{a.stop}] "
                               f"and {b.prefix}[{b.start}:{b.stop}] are not contiguous",
                               "each range starts where the previous one stops")
    return tuple(f"{r.prefix}.{r.start}" for r in ranges[1:])


def _auto(plan: Plan, model, nodes: list[fx.Node], weight: list[float], stages: int) -> Split:
    """Group blocks contiguously into `stages` groups minimising the largest group cost."""
    blocks = set(blocks_of(model))
    starts, seen, cur = [], set(), None  # candidate boundaries: a block's first node
    for i, node in enumerate(nodes):
        b = block_of(module_path(node), blocks)
        if b is not None and b != cur and b not in seen:
            starts.append((i, b))
            seen.add(b)
        cur = b if b is not None else cur
    if not starts:
        starts = [(0, None)]
    starts[0] = (0, starts[0][1])  # glue before the first block (positions, sizes) joins it
    if len(starts) < stages:
        raise PlanError.at(plan, "mesh.pp", f"the model has {len(starts)} blocks, too few for "
                           f"{stages} pipeline stages", "use fewer stages (pp × virtual)")
    edges = [i for i, _ in starts] + [len(nodes)]
    seg = np.array([sum(weight[a:b]) for a, b in zip(edges, edges[1:])], dtype=np.float64)
    cut = _min_max_partition(seg, stages)
    positions = tuple(starts[c][0] for c in cut)
    return Split(tuple(starts[c][1] for c in cut), positions)


def _min_max_partition(seg: np.ndarray, parts: int) -> list[int]:
    """Segment indices where groups 1..parts-1 begin; minimises (max group, sum of squares)."""
    n = len(seg)
    prefix = np.concatenate([[0.0], np.cumsum(seg)])
    inf = float("inf")
    # best[k][i]: (max, sumsq) of splitting seg[:i] into k groups; arg[k][i]: start of group k
    best_max = np.full((parts + 1, n + 1), inf)
    best_sq = np.full((parts + 1, n + 1), inf)
    arg = np.zeros((parts + 1, n + 1), dtype=np.int64)
    best_max[0][0], best_sq[0][0] = 0.0, 0.0
    scale = max(prefix[-1], 1e-30)
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            j = np.arange(k - 1, i)
            group = (prefix[i] - prefix[j]) / scale
            m = np.maximum(best_max[k - 1][j], group)
            sq = best_sq[k - 1][j] + group * group
            lo = m.min()
            tie = np.flatnonzero(m <= lo * (1 + 1e-12) + 1e-15)
            pick = tie[np.argmin(sq[tie])]
            best_max[k][i], best_sq[k][i], arg[k][i] = m[pick], sq[pick], j[pick]
    cuts, i = [], n
    for k in range(parts, 0, -1):
        i = int(arg[k][i])
        cuts.append(i)
    return sorted(cuts)[1:]
