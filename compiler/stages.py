"""Cut the captured graph into stage GraphModules with explicit inputs and outputs.

Each stage's inputs come from the batch or from the stage just before it: a
value used by a later, non-adjacent stage (a skip connection) is forwarded
through every stage in between. Parameters are never sent: a stage reads them
by `get_attr`, so a parameter used by two stages (tied embedding and LM head) is
held by both. Non-tensor values (sizes, shapes) are never sent either: the
consumer recomputes them from what it has.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch.fx as fx

from .capture.analysis import MetaRun
from .capture.blocks import block_of, module_path
from .compiled import BATCH, CONSTANT, StageSpec, ValueRef
from .parallel.tp import graph_made
from .partition import Split, compute_nodes

LOSS = "loss"


@dataclass(frozen=True)
class _Layout:
    """Which nodes each stage computes, and which tensors cross each boundary."""

    computes: tuple[frozenset, ...]  # stage -> nodes it computes (own + recomputed non-tensors)
    received: tuple[tuple[fx.Node, ...], ...]  # stage -> tensors from stage k-1, in graph order


def build_stages(gm: fx.GraphModule, split: Split, run: MetaRun, loss: fx.Node,
                 blocks: set[str], non_persistent: frozenset[str] = frozenset()
                 ) -> list[StageSpec]:
    """One StageSpec per stage. `non_persistent` names the model's buffers kept out of its
    state_dict (e.g. rotary inv_freq); the stages keep them out too."""
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    layout = _layout(graph, split, run, order)
    count = len(layout.computes)
    stages = []
    for k in range(count):
        sends = layout.received[k + 1] if k + 1 < count else ()
        stages.append(_stage(gm, k, layout, sends, run, order, loss, blocks, non_persistent))
    return stages


def _layout(graph: fx.Graph, split: Split, run: MetaRun, order: dict) -> _Layout:
    nodes = compute_nodes(graph)
    home = {n: split.stage_of(i) for i, n in enumerate(nodes)}
    for n in nodes:  # unpacking a tuple output stays with its producer: tensors cross, not tuples
        if n.op == "call_function" and n.target is operator.getitem and n.args[0] in home \
                and isinstance(run.values.get(n.args[0]), (tuple, list)):
            home[n] = home[n.args[0]]
    count = len(split.positions) + 1
    computes = [set() for _ in range(count)]
    last_use: dict[fx.Node, int] = {}  # tensor -> last stage that reads it

    def need(node: fx.Node, stage: int) -> None:
        """Make `node`'s value available in `stage`."""
        if node.op in ("placeholder", "get_attr") or node in computes[stage]:
            return
        if home[node] == stage or not run.is_tensor(node):
            computes[stage].add(node)  # computed here (recomputed if it is a non-tensor)
            for a in node.all_input_nodes:
                need(a, stage)
        else:
            last_use[node] = max(last_use.get(node, stage), stage)

    for node in nodes:
        need(node, home[node])
    received = [[] for _ in range(count)]
    for node, last in last_use.items():
        for k in range(home[node] + 1, last + 1):
            received[k].append(node)
    return _Layout(tuple(frozenset(c) for c in computes),
                   tuple(tuple(sorted(r, key=order.__getitem__)) for r in received))


def _stage(gm: fx.GraphModule, k: int, layout: _Layout, sends: tuple, run: MetaRun,
           order: dict, loss: fx.Node, blocks: set[str], non_persistent: frozenset[str]
           ) -> StageSpec:
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    inputs = []
    for node in layout.received[k]:
        env[node] = g.placeholder(node.name)
        inputs.append(ValueRef(node.name, k - 1, bool(run.spec(node).requires_grad)))
    mine = sorted(layout.computes[k], key=order.__getitem__)
    batch = sorted({a for n in mine for a in n.all_input_nodes if a.op == "placeholder"},
                   key=order.__getitem__)
    for node in batch:
        env[node] = g.placeholder(node.target)
        env[node].meta[BATCH] = True  # made from the data, not received (tp.graph_made_uses)
        inputs.append(ValueRef(node.target, BATCH))

    def arg(a: fx.Node) -> fx.Node:
        if a not in env and a.op == "get_attr":
            env[a] = g.get_attr(a.target)
            if a.meta.get(CONSTANT):  # (tp.graph_made_uses)
                env[a].meta[CONSTANT] = True
        return env[a]

    for node in mine:
        env[node] = g.node_copy(node, arg)
    if loss in layout.computes[k]:
        out_nodes, outputs = (env[loss],), (run.spec(loss, LOSS),)
    else:
        out_nodes = tuple(env[n] for n in sends)
        outputs = tuple(run.spec(n) for n in sends)
    g.output(out_nodes)
    module = fx.GraphModule(gm, g, class_name=f"Stage{k}")
    for name, buf in list(module.named_buffers(remove_duplicate=False)):
        if name in non_persistent:
            owner, _, leaf = name.rpartition(".")
            module.get_submodule(owner).register_buffer(leaf, buf, persistent=False)
    original = {new: old for old, new in env.items()}
    return StageSpec(
        index=k, rank=k, inputs=tuple(inputs), outputs=outputs,
        param_names=tuple(n for n, _ in module.named_parameters(remove_duplicate=False)),
        buffer_names=tuple(n for n, _ in module.named_buffers(remove_duplicate=False)),
        module_names=_blocks_in(mine, blocks), code=module.code, module=module,
        made=sum(1 for n in graph_made(module) if run.is_tensor(original[n])))


def _blocks_in(nodes: list[fx.Node], blocks: set[str]) -> tuple[str, ...]:
    seen: dict[str, None] = {}
    for n in nodes:
        b = block_of(module_path(n), blocks)
        if b is not None:
            seen.setdefault(b, None)
    return tuple(seen)


def move_stage(module: fx.GraphModule, device) -> fx.GraphModule:
    """Move a stage to `device`, including the device its graph names as constants.

    Graphs captured with torch.export spell out the capture device in factory ops
    (`arange(..., device=cpu)`); moving only the parameters would leave those
    on the old device. Returns `module`, moved in place.
    """
    import torch
    target = torch.device(device)
    module.to(target)
    for node in module.graph.nodes:
        node.args, node.kwargs = torch.utils._pytree.tree_map_only(
            torch.device, lambda _: target, (node.args, node.kwargs))
    module.recompile()
    return module
