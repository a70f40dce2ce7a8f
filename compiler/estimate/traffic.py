"""What the tensor- and expert-parallel collectives carry, read off the traced graph.

Each `Traffic` is one tensor a module's collective moves per microbatch, by
its role (estimates.py turns roles into the collectives backends/
tp/rewrite.py places, with or without sequence parallel):

* "output": a row-parallel layer's or vocab-parallel embedding's output
  (all-reduced in forward; under sequence parallel reduce-scattered, and its
  grad all-gathered in backward);
* "input": what a column-parallel layer (or vocab-parallel LM head) reads, one
  per distinct input (q, k and v share one, as Megatron's fused QKV): its grad
  all-reduced in backward (under sequence parallel: all-gathered in forward,
  its grad reduce-scattered);
* "whole_input": under sequence parallel, a column input computed in its stage
  from whole values only (the stage's inputs arrive whole; no row output or
  vocab embedding before it in the stage): nothing to gather, its grad all-reduced;
* "partial_input", "seq_input", "seq_output": values crossing a stage edge
  that meet split values (`_stage_edges`); "partial_param": a replicated parameter
  applied to feature-sharded values (a norm within each head); "counted_loss": the model's own mean loss
  of sequence shards (a whole LM head's logits), a partial sum all-reduced as it leaves;
* "loss": a vocab-parallel head feeding the cross-entropy of its logits as rows
  directly (tp.loss_of_logits, the rewrite's own test): the
  vocab-parallel cross-entropy all-reduces 3 values per token in the logits' dtype;
* "logits": otherwise the head all-gathers its logits (nbytes: all of them);
* "tokens": an experts call's hidden rows, which its all-to-alls move (top_k
  copies); "weights": its top-k weights [T, k], moved along.

A module inside a leaf call (attention kept whole so the runtime can split its
heads) is taken to read the leaf's input and, if row-parallel, to produce its
output (attention's layout).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.fx as fx

from ..capture.analysis import MetaRun
from ..capture.blocks import module_path, within
from ..compiled import ExpertPlacement
from ..partition import Split, compute_nodes
from ..parallel.tp import counted_mean, cross_entropy_call, linear_uses, loss_of_logits


ROLES = ("output", "input", "whole_input", "partial_input", "seq_input", "seq_output",
         "partial_param", "counted_loss", "loss", "logits", "tokens", "weights")


@dataclass(frozen=True)
class Traffic:
    """One tensor a module's collectives move per microbatch (full size, unsplit)."""

    module: str
    stage: int
    nbytes: int
    role: str = "output"  # one of ROLES
    read: Optional[str] = None  # "input": the value the module reads (its node's name)


@dataclass(frozen=True)
class ModuleCall:
    """One module's call in the graph: its stage and the bytes going in and out per microbatch."""

    stage: int
    in_bytes: int
    out_bytes: int
    input_node: Optional[str] = None  # the value it reads (layers sharing it: one collective)
    loss_rows: int = 0  # rows of the cross-entropy it feeds directly (0: none)
    loss_itemsize: int = 0  # bytes per element of those logits
    output_node: Optional[str] = None  # its last node


def collective_traffic(model: torch.nn.Module, graph: fx.Graph, run: MetaRun, split: Split,
                       tp_kinds: dict[str, str], experts: tuple[ExpertPlacement, ...]
                       ) -> tuple[list[Traffic], list[Traffic]]:
    """(tensor-parallel traffic, MoE traffic: each experts call's hidden rows ("tokens") and
    top-k weights ("weights"), what its all-to-alls move)."""
    calls = module_calls(graph, run, split, set(tp_kinds), model)
    moe = []
    for i, node in enumerate(compute_nodes(graph)):
        if node.op == "call_module" and len(node.args) >= 3 and any(
                within(node.target, e.module) for e in experts):
            hidden, _, weights = (run.values.get(a) for a in node.args[:3])
            if isinstance(hidden, torch.Tensor) and isinstance(weights, torch.Tensor):
                moe += [Traffic(node.target, split.stage_of(i), _nbytes(hidden), "tokens"),
                        Traffic(node.target, split.stage_of(i), _nbytes(weights), "weights")]
    traffic = tensor_parallel_traffic(model, tp_kinds, calls)
    sharded = _sequence_sharded(graph, split, model, tp_kinds, calls)
    made_in = {n.name: split.stage_of(i) for i, n in enumerate(compute_nodes(graph))}
    # a value another stage made arrives whole (BERT's post-norm: the next stage's q, k, v
    # read the received norm directly)
    traffic = [Traffic(t.module, t.stage, t.nbytes, "whole_input", t.read)
               if t.role == "input" and (t.read not in sharded
                                         or made_in.get(t.read, t.stage) != t.stage) else t
               for t in traffic]
    traffic += _stage_edges(graph, run, split, tp_kinds, sharded)
    return traffic, moe


def _stage_edges(graph: fx.Graph, run: MetaRun, split: Split, kinds: dict[str, str],
                 seq_sharded: set[str]) -> list[Traffic]:
    """What crosses a stage edge and meets split values (each once per stage):

    * "partial_input": a floating value a stage receives from an earlier one that meets
      feature-sharded values outside any split module (RoPE's cos and sin times
      head-sharded q and k): its gradient, a partial sum, is all-reduced when it
      leaves the stage;
    * "seq_input" (sequence parallel): a floating value received that meets sequence
      shards (not feature-sharded values, which hold the whole sequence): split on
      entry, its gradient all-gathered;
    * "seq_output" (sequence parallel): a value sent on that is a sequence shard:
      all-gathered on exit;
    * "counted_loss" (sequence parallel): a mean loss of the model's own whose input is
      a sequence shard (backends' tp CountedMean): its summed loss, a partial sum,
      all-reduced on exit.

    Feature-sharded values: what column modules output, forward through their stage up
    to the row modules (which sum them). A received value's reach: its users forward
    through its stage, not into split modules (a column module's entry is "input")."""
    nodes = compute_nodes(graph)
    stage_of = {n: split.stage_of(i) for i, n in enumerate(nodes)}

    by_path: dict = {}  # module path -> its kind (the first named module holding it)
    order = {name: i for i, name in enumerate(kinds)}

    def kind_at(n: fx.Node) -> Optional[str]:
        path = module_path(n)
        if path not in by_path:  # the path's own module and those around it, first named
            holders, p = [], path
            while p:
                if p in order:
                    holders.append(p)
                p = p.rpartition(".")[0]
            by_path[path] = kinds[min(holders, key=order.__getitem__)] if holders else None
        return by_path[path]

    sharded: set[fx.Node] = set()
    for n in nodes:
        k = kind_at(n)
        if k == "column" and any(kind_at(u) != "column" for u in n.users):
            sharded.add(n)  # a column module's output node
        elif k is None and any(a in sharded and stage_of.get(a) == stage_of[n]
                               for a in n.all_input_nodes):
            sharded.add(n)
    out, seen = [], set()
    for n in nodes:
        s = stage_of[n]
        for a in n.all_input_nodes:
            value = run.values.get(a)
            if a not in stage_of or stage_of[a] >= s or (a, s) in seen \
                    or not isinstance(value, torch.Tensor) or not value.is_floating_point():
                continue
            seen.add((a, s))
            reach, todo = set(), [u for u in a.users if stage_of.get(u) == s]
            while todo:
                u = todo.pop()
                v = run.values.get(u)
                if u in reach or kind_at(u) is not None or not (
                        isinstance(v, torch.Tensor) and v.is_floating_point()):
                    continue  # (sizes and integer values carry no gradient)
                reach.add(u)
                todo += [v for v in u.users if stage_of.get(v) == s]
            if reach & sharded and run.spec(a).requires_grad:  # (RoPE's cos and sin made
                # from buffers have no gradient to sum: the runtime sends none back)
                out.append(Traffic(a.name, s, _nbytes(value), "partial_input"))
            if any(u.name in seq_sharded and u not in sharded for u in reach):
                out.append(Traffic(a.name, s, _nbytes(value), "seq_input"))
    for n in nodes:
        value = run.values.get(n)
        if n.name in seq_sharded and isinstance(value, torch.Tensor) and value.dim() >= 2 \
                and value.is_floating_point() and any(
                stage_of.get(u, stage_of[n]) > stage_of[n] or u.op == "output" for u in n.users):
            out.append(Traffic(n.name, stage_of[n], _nbytes(value), "seq_output"))
    out += _partial_params([n for n in nodes if kind_at(n) is None], stage_of, sharded, run,
                           graph)
    split_losses = {loss_of_logits(n) for n in nodes if kind_at(n) in ("column", "vocab")}
    for n in nodes:  # (a split head's own loss is loss_parallel's: "loss")
        counted = counted_mean(n)
        if counted is not None and n not in split_losses and counted[0] not in sharded \
                and getattr(counted[0], "name", None) in seq_sharded:
            out.append(Traffic(module_path(n), stage_of[n], _nbytes(run.values.get(n)),
                               "counted_loss"))  # (the module it is traced in: recompute's)
    return out


def _partial_params(nodes: list, stage_of: dict, sharded: set, run: MetaRun,
                    graph: fx.Graph) -> list[Traffic]:
    """"partial_param": a replicated parameter whose value meets feature-sharded values
    outside the split modules, directly or through ops on replicated values (a norm within
    each head: Qwen 3's q_norm weight, Gemma 3's `1 + weight`, on the rank's heads); each
    rank's gradient is its heads' part, a partial sum the runtime all-reduces in backward
    (under sequence parallel: summed once per step with the other replicated parameters).
    One per parameter read (a leaf call: each of its parameters)."""
    out, seen = [], set()
    gm = graph.owning_module
    param_only = _parameters_only(graph, sharded)
    for n in nodes:
        if n not in sharded:
            continue
        if n.op == "call_module":
            found = [(f"{n.target}.{k}", p) for k, p in gm.get_submodule(n.target)
                     .named_parameters()]
        else:
            found = [(a.target, run.value(a)) for a in _params_behind(n, param_only)]
        for name, p in found:
            key = name if n.op != "call_module" else (name, n)
            if key in seen or not isinstance(p, torch.Tensor) or not p.requires_grad:
                continue
            seen.add(key)
            out.append(Traffic(name, stage_of[n], _nbytes(p), "partial_param"))
    return out


def _params_behind(n: fx.Node, param_only: set) -> list[fx.Node]:
    """The parameter reads (get_attr) of n's inputs that are computed from parameters and
    constants alone (`param_only`: a weight, its cast, `1 + weight`); an input that also
    reads the stage's inputs (an activation) is not followed."""
    found, todo, seen = [], [a for a in n.all_input_nodes if a in param_only], set()
    while todo:
        a = todo.pop()
        if a in seen:
            continue
        seen.add(a)
        if a.op == "get_attr":
            found.append(a)
        todo += a.all_input_nodes
    return found


def _parameters_only(graph: fx.Graph, sharded: set) -> set:
    """The nodes computed from parameters and constants alone (no graph input, no split
    value), in one pass in graph order."""
    out: set = set()
    for n in graph.nodes:
        if n.op == "get_attr" or n.op in ("call_function", "call_method", "call_module") \
                and n not in sharded and all(a in out for a in n.all_input_nodes):
            out.add(n)
    return out


def _sequence_sharded(graph: fx.Graph, split: Split, model, kinds: dict[str, str],
                      calls: dict[str, ModuleCall]) -> set[str]:
    """Node names that carry sequence shards under sequence parallel: everything computed in
    a stage from a row output or a vocab embedding of that stage (inputs arrive whole)."""
    nodes = compute_nodes(graph)
    stage_of = {n: split.stage_of(i) for i, n in enumerate(nodes)}
    seeds = {c.output_node for n, cs in calls.items() for c in cs
             if n in kinds and _all_reduces_output(model, n, kinds[n])}
    sharded: set[str] = set()
    for n in nodes:
        if n.name in seeds or any(a.name in sharded and stage_of.get(a) == stage_of[n]
                                  for a in n.all_input_nodes):
            sharded.add(n.name)
    return sharded


def tensor_parallel_traffic(model: torch.nn.Module, kinds: dict[str, str],
                            calls: dict[str, list[ModuleCall]]) -> list[Traffic]:
    """The tensors TP collectives move (see the module docstring), per microbatch."""
    out, seen_inputs = [], set()
    for name, kind in kinds.items():
        for call in calls.get(name, ()):
            out += _call_traffic(model, name, kind, call, seen_inputs)
    return out


def _call_traffic(model: torch.nn.Module, name: str, kind: str, call: ModuleCall,
                  seen_inputs: set) -> list[Traffic]:
    out = []
    if _all_reduces_output(model, name, kind):
        return [Traffic(name, call.stage, call.out_bytes)]
    if call.input_node not in seen_inputs:
        seen_inputs.add(call.input_node)
        out.append(Traffic(name, call.stage, call.in_bytes, "input", call.input_node))
    if kind == "vocab":  # the LM head's logits: a split loss, or gathered
        if call.loss_rows:
            out.append(Traffic(name, call.stage, 3 * call.loss_itemsize * call.loss_rows,
                               "loss"))
        else:
            out.append(Traffic(name, call.stage, call.out_bytes, "logits"))
    return out


def module_calls(graph: fx.Graph, run: MetaRun, split: Split, names: set[str],
                 model: torch.nn.Module) -> dict[str, list[ModuleCall]]:
    """For each named module, its calls: the stage of a call's first node, its first tensor
    input's bytes (from outside the module: the first of its nodes reading one -- Falcon's
    `x @ W.T` transposes its weight first) and its last node's output bytes. One call, but
    for a module whose weight the graph applies as a Linear more than once (ALBERT's one
    layer, run as every layer): one per application, each a run of its nodes."""
    runs: dict[str, list[list[tuple[int, fx.Node]]]] = {}
    below: dict[str, list[str]] = {}  # module -> the named modules inside it
    for name in names:
        parent = name.rpartition(".")[0]
        while parent:
            below.setdefault(parent, []).append(name)
            parent = parent.rpartition(".")[0]
    for i, node in enumerate(compute_nodes(graph)):
        path = module_path(node)
        inside = list(below.get(path, ())) if node.op == "call_module" else []  # a leaf call
        while path:
            if path in names:
                inside.append(path)
            path = path.rpartition(".")[0]
        for name in inside:
            mine = runs.setdefault(name, [])
            if mine and mine[-1][-1][0] == i - 1:
                mine[-1].append((i, node))
            else:
                mine.append([(i, node)])
    uses: dict[str, int] = {}
    for use in linear_uses(graph, model).values():
        uses[use.module] = uses.get(use.module, 0) + 1
    out = {}
    for name, found in runs.items():
        if uses.get(name, 0) < 2:
            found = [[n for r in found for n in r]]
        out[name] = [_call(run, split, name, nodes) for nodes in found]
    return out


def _call(run: MetaRun, split: Split, name: str, nodes: list[tuple[int, fx.Node]]
          ) -> ModuleCall:
    read = next((a for _, n in nodes for a in _outside_inputs(n, name, run)), None)
    end = nodes[-1][1]
    return ModuleCall(split.stage_of(nodes[0][0]), _nbytes(run.value(read)) if read else 0,
                      _nbytes(run.value(end)) if run.is_tensor(end) else 0,
                      read.name if read else None, *_loss_rows(end, run), end.name)


def _outside_inputs(node: fx.Node, name: str, run: MetaRun) -> list[fx.Node]:
    """The tensor values `node` (a node of module `name`, or a leaf call holding it) reads
    from outside that module (or leaf), parameters aside."""
    leaf = node.op == "call_module" and within(name, node.target)  # a leaf holding it
    scope = node.target if leaf else name
    return [a for a in node.all_input_nodes if a.op != "get_attr" and run.is_tensor(a)
            and not within(module_path(a), scope)]


def _loss_rows(node: fx.Node, run: MetaRun) -> tuple[int, int]:
    """(rows, bytes per element) of the cross-entropy of node's logits as rows if that is
    node's only use (the rewrite's test: tp.loss_of_logits), else (0, 0)."""
    ce = loss_of_logits(node)
    if ce is None:
        return 0, 0
    logits = run.value(cross_entropy_call(ce)[0])
    return logits.shape[0], logits.element_size()


def _all_reduces_output(model: torch.nn.Module, name: str, kind: str) -> bool:
    return kind == "row" or (kind == "vocab" and
                             isinstance(model.get_submodule(name), torch.nn.Embedding))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
