"""Activation memory: the bytes a stage's forward keeps for backward, as the runtime keeps them.

One walker over a stage graph, node by node, from what each node saves
(`analysis.Saved`: one record per storage, with the node that produced it):

* Each storage counts once (the runtime's meter, backends' SavedBytes, counts
  unique storages); parameters never count.
* Tensor parallel: a storage is this rank's 1/tp when the rewrite leaves its
  value sharded (`placements`): features or heads between a column-parallel
  layer and its row-parallel partner, and under sequence parallel the sequence
  shards from a row output (or a split embedding) to the next column input.
  A column layer's input is replicated: under sequence parallel the
  all-gathered copy is what the layer saves (a storage of its own, whole).
  Stage inputs arrive whole. A 0-d scalar is never split. A mean loss on sequence
  shards (a whole LM head's logits) is its sum over the weight its targets count
  (backends' tp/dtensor.CountedMean): the division keeps that scalar besides the op's
  own saves.
* Recompute regions (compiler/recompute.py, the runtime's too): `full` drops every
  node, `selective` the nodes without matmul work (zero FLOPs) and attention.
  A dropped node's save stays held when its storage is alive anyway (a region
  input, a kept node's output); otherwise it is rerun, and the values the
  rerun starts from (region inputs, kept outputs) are held instead. A region
  with a random op (dropout) reruns all its dropped nodes, in order.

These are the rules backends/runtime/recompute.py executes (both take the
regions from compiler/recompute.py); tests compare the two byte for byte.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.fx as fx

from ..capture.analysis import MetaRun, NodeCost
from ..parallel.tp import (counted_mean, embedding_calls, linear_calls, loss_of_logits,
                           shard_dim)
from ..recompute import Region, draws_random, dropped, find_regions

REPLICATED, SHARDED, SEQUENCE = "replicated", "sharded", "sequence"


# --------------------------------------------------------------- placements
@dataclass(frozen=True)
class TensorSplit:
    """The plan's tensor parallelism as the rewrite applies it to one stage."""

    tp: int
    sequence_parallel: bool
    kinds: dict  # qualified module -> column | row | vocab (CompiledPlan.tp_rewrites)
    # stage inputs that arrive as sequence shards: none for the runtime's stages (values
    # cross a stage edge whole); a planner's block after others of its stage (planner/units)
    sequence_inputs: frozenset = frozenset()


def placements(graph: fx.Graph, module: torch.nn.Module, split: TensorSplit,
               is_tensor) -> tuple[dict, set, dict]:
    """Each tensor value's placement under the TP rewrite (backends' parallel/tp), the
    column-parallel uses whose input is all-gathered (sequence parallel), and the nodes
    the rewrite puts a collective around: "column" (its input redistributed), "summed"
    (its partial output reduced: row layers, split embeddings, gathered vocab logits)."""
    linear = linear_calls(graph, module)
    embedding = embedding_calls(graph, module)
    out_seq = SEQUENCE if split.sequence_parallel else REPLICATED
    place: dict[fx.Node, str] = {}
    gathered: set[fx.Node] = set()
    roles: dict[fx.Node, str] = {}
    for n in graph.nodes:
        kind = split.kinds.get(linear.get(n) or embedding.get(n))
        if n.op == "placeholder" and n.name in split.sequence_inputs \
                and split.sequence_parallel:
            place[n] = SEQUENCE
        elif n.op in ("placeholder", "get_attr"):
            place[n] = REPLICATED
        elif kind == "row" and n in linear:
            place[n], roles[n] = out_seq, "summed"
        elif kind in ("column", "vocab") and n in linear:
            if place.get(n.args[0]) == SEQUENCE:
                gathered.add(n)
            loss = loss_of_logits(n) is not None
            place[n] = SHARDED if kind == "column" or loss else REPLICATED
            roles[n] = "column"  # (a gathered vocab output: not rerun either; not modelled)
        elif kind == "vocab" and n in embedding:
            place[n], roles[n] = out_seq, "summed"
        else:
            found = {place.get(a) for a in n.all_input_nodes if is_tensor(a)}
            place[n] = SHARDED if SHARDED in found else SEQUENCE if SEQUENCE in found \
                else REPLICATED
    return place, gathered, roles


# ------------------------------------------------------------------ records
def saved_records(precision: str, gm: fx.GraphModule, run: MetaRun) -> dict[str, NodeCost]:
    """What each node of the captured graph saves, by node name: the meta run's, or under
    bf16 a second run as under the runtime's autocast (fake CPU tensors: autocast's casts
    are saved copies of their own, a weight's too; norms keep float32 inputs)."""
    if precision != "bf16":
        return {n.name: c for n, c in run.costs.items()}
    again = MetaRun(gm, autocast=torch.bfloat16, blocks=run.blocks)
    inputs = {n.target: run.value(n) for n in gm.graph.nodes if n.op == "placeholder"}
    again.run([n for n in gm.graph.nodes if n.op != "output"], inputs)
    return {n.name: dataclasses.replace(c, saves=again.costs[n].saves, outs=again.costs[n].outs,
                                        tensor_out=again.costs[n].tensor_out)
            for n, c in run.costs.items() if n in again.costs}


# ------------------------------------------------------------------- walker
class _Stage:
    """One stage graph's nodes with their meta-run records and placements."""

    def __init__(self, module: fx.GraphModule, costs: dict, split: Optional[TensorSplit],
                 scale: dict):
        self.scale = scale
        self.nodes = [n for n in module.graph.nodes if n.op != "output"]
        self.cost = {n: costs.get(n.name) for n in self.nodes}
        self.split = split if split is not None and split.tp > 1 else None
        self.place, self.gathered, self.roles = {}, set(), {}
        if self.split is not None:
            self.place, self.gathered, self.roles = placements(
                module.graph, module, self.split, self.is_tensor)
        self.by_name = {n.name: n for n in self.nodes if n.op != "placeholder"}

    def outs(self, n: fx.Node) -> tuple:
        c = self.cost.get(n)
        return c.outs if c is not None else ()

    def is_tensor(self, n: fx.Node) -> bool:
        return bool(self.outs(n)) or n.op == "placeholder"

    def divisor(self, owner: str, dims: int = 1) -> int:
        """tp where a storage holding `owner` (a node's value, or a parameter's cast) is
        left sharded by the rewrite, else 1 (stage inputs arrive whole but for
        `sequence_inputs`; a 0-d scalar is never split)."""
        if self.split is None or dims == 0:
            return 1
        if owner.startswith("param:"):
            module, _, leaf = owner[len("param:"):].rpartition(".")
            kind = self.split.kinds.get(module)
            return self.split.tp if kind and shard_dim(kind, leaf) is not None else 1
        node = self.by_name.get(owner)
        if node is None or node.op == "placeholder":  # a stage input
            return self.split.tp if owner in self.split.sequence_inputs and \
                self.split.sequence_parallel else 1
        return 1 if self.place.get(node, REPLICATED) == REPLICATED else self.split.tp

    def saves(self, n: fx.Node):
        """(storage, bytes on this rank) of each tensor n saves."""
        c = self.cost.get(n)
        if c is None or n.op == "placeholder":
            return
        inputs = {k for k, _ in self.outs(n.args[0])} if n in self.gathered else ()
        scale = self.scale.get(n.name, 1.0)
        for s in c.saves:
            if s.key in inputs or s.source in inputs:  # the whole all-gathered input
                yield "gathered:" + s.key, s.nbytes * scale
            else:
                yield s.key, s.nbytes * scale / self.divisor(s.owner, s.dims)
        counted = counted_mean(n) if self.split is not None else None
        if counted is not None and self.place.get(counted[0]) == SEQUENCE:
            for key, nb in c.outs:  # the counted weight: a scalar of the loss's dtype
                yield "counted:" + key, nb

    def value(self, n: fx.Node):
        """(storage, bytes on this rank) of n's output, if it is one tensor (what a
        recompute holds to start from)."""
        c = self.cost.get(n)
        if c is None or not c.tensor_out:
            return ()
        return [(k, nb / self.divisor(n.name)) for k, nb in c.outs]


def stage_saved_bytes(module: fx.GraphModule, costs: dict, rules: Sequence = (),
                      split: Optional[TensorSplit] = None, scale: Optional[dict] = None) -> int:
    """Bytes one forward of the stage graph `module` keeps for backward on one rank.
    `costs`: the meta run's NodeCost by node name (a stage input: its producer's);
    `scale`: by node name, the share of its saves that count (experts at top-k)."""
    stage = _Stage(module, costs, split, scale or {})
    held: dict[str, float] = {}
    regions = {r.nodes[0]: r for r in find_regions(module.graph, rules)}
    node = stage.nodes[0] if stage.nodes else None
    while node is not None and node.op != "output":
        region = regions.get(node)
        if region is None:
            for key, nb in stage.saves(node):
                held.setdefault(key, nb)
            node = node.next
            continue
        for key, nb in _region_holds(region, stage):
            held.setdefault(key, nb)
        node = region.nodes[-1].next
    return int(round(sum(held.values())))


@dataclass(eq=False)
class _Step:
    """One node of a region as the runtime runs it: a graph node, or a collective the TP
    rewrite puts around one (kept under `selective`: its output is a value a rerun starts
    from)."""

    inputs: list  # _Step, or an fx.Node outside the region
    value: list  # (storage, bytes) of its output, if one tensor
    saves: list = field(default_factory=list)
    dropped: bool = False
    random: bool = False


def _steps(region: Region, stage: _Stage) -> list:
    """The region's nodes, with the rewrite's collectives: under sequence parallel a column
    layer's input all-gathered (one per value, as Megatron's fused QKV; a no-op on a
    stage input, which arrives whole), a row layer's (and a split embedding's) output
    summed. A collective reruns under `full` only (recompute.dropped)."""
    rerun = region.mode == "full"
    steps, step_of, entered = [], {}, {}
    split = stage.split
    for n in region.nodes:
        c = stage.cost.get(n)
        inputs = [step_of.get(a, a) for a in n.all_input_nodes]
        role = stage.roles.get(n)
        if role == "column" and split.sequence_parallel:  # (else a no-op, rerun freely)
            x = n.args[0]
            if x not in entered:
                value = stage.value(x) if n not in stage.gathered else \
                    [("gathered:" + k, nb) for k, nb in stage.outs(x)]
                entered[x] = _Step([step_of.get(x, x)], value, dropped=rerun)
                steps.append(entered[x])
            inputs = [entered[x] if a is x else i for a, i in zip(n.all_input_nodes, inputs)]
        core = _Step(inputs, stage.value(n), list(stage.saves(n)),
                     dropped(region, n, c.flops if c is not None else 0.0), draws_random(n))
        steps.append(core)
        step_of[n] = core
        if role == "summed":
            core.value = [(k + ":partial", nb) for k, nb in stage.outs(n)]
            step_of[n] = _Step([core], stage.value(n), dropped=rerun)
            steps.append(step_of[n])
    return steps


def _region_holds(region: Region, stage: _Stage):
    """What one recompute region holds (backends' _RegionCall.forward, as its meter counts):
    kept nodes' saves; dropped nodes' saves of storages alive anyway; what reruns start from."""
    steps = _steps(region, stage)
    keep = {k for st in steps for a in st.inputs if isinstance(a, fx.Node)
            for k, _ in stage.value(a)}
    held = []
    placeholder: dict[_Step, bool] = {}
    for st in steps:
        if not st.dropped:
            held += st.saves
            keep.update(k for k, _ in st.value)
            continue
        placeholder[st] = False
        for key, nb in st.saves:
            if key in keep:
                held.append((key, nb))
            else:
                placeholder[st] = True
    needed: set = set()
    starts: list = []
    stack = [st for st, has in placeholder.items() if has]
    while stack:
        st = stack.pop()
        if st not in needed:
            needed.add(st)
            stack += [a for a in st.inputs if a in placeholder]
            starts += [a for a in st.inputs if a not in placeholder]
    if any(st.random for st in placeholder):  # the whole region reruns, in order
        starts += [a for st in placeholder for a in st.inputs if a not in placeholder]
    for a in starts:
        held += stage.value(a) if isinstance(a, fx.Node) else a.value
    return held
