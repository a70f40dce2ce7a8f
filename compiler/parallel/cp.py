"""Context parallelism (mesh.cp, `context { method = ulysses | ring }`): what the compiler knows.

The model is captured at the sequence length one cp rank holds (data.seq_len / cp,
compiler/capture/traced.py), so every op outside attention is the model's own op on its
sequence slice, and the meta run's shapes, saved bytes and FLOPs are per rank.
DeepSpeed-Ulysses then needs each attention op (`scaled_dot_product_attention`) to see
the whole sequence for a subset of heads: the runtime (backends/parallel/cp/ulysses.py) wraps each
SDPA call in an all-to-all before (q, k, v: sequence shards -> head shards) and one
after (the output: back to sequence shards).

`check_context` refuses, at the plan line, what that cannot make exact:

* no attention op in the graph (nothing to shard);
* heads or KV heads (dim 1 of q and k in the captured SDPA calls, not attribute names)
  not divisible by cp -- by tp * cp where tensor parallelism splits them first
  (`heads_split_by_tp`: q, k, v computed by column-parallel layers; each tp rank's
  local heads are then split again by the all-to-all over its cp group). Ring
  attention splits no heads: it needs only tp to divide them where tp splits them,
  tensor parallelism's own check at the column line (compiler/parallel/tp.py);
* an attention mask tensor: it is computed from the local slice ([.., S/cp, S/cp]) and
  the whole-sequence mask is never built (transformers materialises one under
  torch.export); only `is_causal` or no mask is exact after the all-to-all;
* positions made inside the model by an `arange` not tied to the sequence's length (a
  literal length, as torch.export bakes it): each rank would number its slice from 0;
  feed position_ids from the data's `positions` field, which each cp rank receives with
  its global offsets (backends/runtime/data.py). An `arange(x.shape[seq])` (fx captures)
  is marked by compiler/parallel/cp_locality.py and renumbered to the rank's global
  positions at run time (backends/parallel/cp/positions.py); so is an arange with a literal
  length whose twin in the whole-length capture is arange(S), and a slice of a constant
  (BERT's `position_ids[:, :seq]` buffer) taking its first S/cp rows there and S here
  (compiler/parallel/cp_masks.py:mark_positions);

Ring attention (`context { method = ring }`, backends/parallel/cp/ring.py) keeps each
rank's queries and passes K/V blocks around the cp ring: heads do not limit cp (only tp,
where tp splits them), but the ring runs the blocks itself, so it takes only what it can
honour: is_causal (with the load-balanced layout of 2*cp chunks, dsl/checks.py checks
data.seq_len), scale and grouped-query K/V; a mask tensor, dropout or q and k of
different lengths are refused.

`ulysses_traffic` / `ring_traffic` are the bytes per rank for the estimates, and
`exchanges` the calls and message latencies per attention op (the time model's latency
term: a CPU's gloo message costs hundreds of microseconds, which bytes alone do not say).

Both methods run inside tensor-parallel stages (backends/ulysses.ContextAttention: on the
tp-local heads, each over the cp group of its tp coordinate), sequence parallel included:
SP splits this cp rank's slice further over tp outside attention, and the column layers
all-gather it back over tp before q, k, v, so attention still sees the cp slice with
tp-split heads.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ...dsl.ast import Plan
from ...dsl.errors import PlanError
from ..capture.analysis import SDPA, MetaRun

POSITIONS = "pipeplan_cp_positions"  # node.meta: an arange cp_locality.py ties to the sequence
# node.meta: (dim, start) of a slice taking S/cp rows of a constant from `start` (a position
# table or buffer, `position_ids[:, :seq]`): taken at start + the rank's positions at run time
POSITION_SLICE = "pipeplan_cp_position_slice"
LITERAL = "literal"  # node.meta[POSITIONS] of an arange with a literal length (cp_masks)
SORTED_ROWS = "pipeplan_cp_sorted_rows"  # node.meta: an arange numbering sorted rows (cp_rows)
WHOLE_MASK = "pipeplan_cp_whole_mask"  # node.meta: a mask rebuilt whole (cp_masks.py)
REGION = "pipeplan_cp_region"  # node.meta: an attention region run whole (cp_regions.py)
ARANGE = {torch.arange, torch.ops.aten.arange.default, torch.ops.aten.arange.start,
          torch.ops.aten.arange.start_step}


def attention_nodes(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if n.op == "call_function" and n.target in SDPA]


def region_nodes(graph: fx.Graph) -> list[fx.Node]:
    """Attention the model writes out, run whole under Ulysses (cp_regions.py)."""
    return [n for n in graph.nodes if n.meta.get(REGION)]


SDPA_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale",
               "enable_gqa")
SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None,
                 "enable_gqa": False}


def sdpa_arguments(args, kwargs) -> dict:
    """An SDPA call's arguments by name (F.scaled_dot_product_attention and the aten op
    share the order; scale and enable_gqa are keyword-only in both)."""
    out = dict(SDPA_DEFAULTS)
    out.update(zip(SDPA_PARAMS, args))
    out.update(kwargs)
    return out


def attn_mask(node: fx.Node):
    """The attn_mask argument of an SDPA call (positional 4th or keyword)."""
    return sdpa_arguments(node.args, node.kwargs)["attn_mask"]


def is_whole_mask(node) -> bool:
    """A mask argument compiler/parallel/cp_masks.py rebuilt on the whole sequence."""
    return isinstance(node, fx.Node) and bool(node.meta.get(WHOLE_MASK))


def heads_split_by_tp(plan: Plan, graph: fx.Graph, model: torch.nn.Module,
                      tp_kinds: dict[str, str], run: MetaRun) -> dict[fx.Node, int]:
    """Per attention op, how many ways tensor parallelism splits its heads before the
    context-parallel method runs on each tp rank's local heads: tp where q is computed by
    a column-parallel layer (backends/tp then hands the op head shards), 1 where it is
    not. (Megatron's pairing, checked before, holds q, k, v and the output projection
    split alike: compiler/tensor_parallel.check_pairing.)"""
    if plan.mesh.tp == 1 or plan.mesh.cp == 1:
        return {}
    from .tp import first_linears, linear_calls
    linear = linear_calls(graph, model)
    return {node: plan.mesh.tp if any(
                hit is not None and tp_kinds.get(linear[hit]) == "column"
                for hit in first_linears(node.args[0], linear, False, run.is_tensor)) else 1
            for node in attention_nodes(graph)}


def check_context(plan: Plan, graph: fx.Graph, run: MetaRun,
                  tp_heads: dict[fx.Node, int] | None = None) -> None:
    """`tp_heads`: `heads_split_by_tp`'s answer (absent: tp splits no heads)."""
    cp = plan.mesh.cp
    tp_heads = tp_heads or {}
    if cp == 1:
        return
    key = "context.method" if "context.method" in plan.spans else "context"
    attention = attention_nodes(graph)
    if not attention and not region_nodes(graph):
        raise PlanError.at(plan, key, f"context parallel ({plan.context.method}) found no "
                           "attention op (scaled_dot_product_attention) in the captured graph",
                           "context parallel rewrites the model's SDPA calls; a model "
                           "without them cannot be split along the sequence")
    ring = plan.context.method == "ring"
    for node in attention:
        q, k = run.value(node.args[0]), run.value(node.args[1])
        if q.dim() != 4 or k.dim() != 4:
            raise PlanError.at(plan, key, f"attention `{node.name}` takes q of shape "
                               f"{tuple(q.shape)}, not [batch, heads, seq, head_dim]",
                               "context parallel splits dim 2 (the sequence) of 4-d q, k, v")
        if ring:
            _check_ring_call(plan, key, node, q, k)
            continue
        tp = tp_heads.get(node, 1)
        ways = f"cp = {cp}" if tp == 1 else f"tp * cp = {tp} * {cp}"
        for what, t in (("heads", q), ("KV heads", k)):
            if t.shape[1] % (tp * cp):
                raise PlanError.at(plan, "mesh.cp", f"{ways} does not divide the "
                                   f"{t.shape[1]} {what} of attention `{node.name}`",
                                   "Ulysses gives each cp rank heads/cp whole heads (of the "
                                   "heads/tp a tensor-parallel rank holds): pick cp (and tp) so "
                                   "that tp * cp divides the heads and KV heads")
        if isinstance(attn_mask(node), fx.Node) and not is_whole_mask(attn_mask(node)):
            raise PlanError.at(plan, key, f"attention `{node.name}` takes a mask tensor, "
                               "which the model computes on one rank's sequence slice; the "
                               "whole-sequence mask Ulysses needs is never built",
                               "context parallel supports attention with is_causal or no "
                               "mask (transformers models materialise their mask when "
                               "exported)")
    made = [n for n in graph.nodes if n.op == "call_function" and n.target in ARANGE
            and not n.meta.get(POSITIONS)  # cp_locality: renumbered at run time
            and not n.meta.get(SORTED_ROWS)]  # cp_rows: inverts a sort of local rows
    if made:
        raise PlanError.at(plan, key, f"the model makes positions itself (`{made[0].name}`: "
                           "arange over the local sequence), so every cp rank would number "
                           "its slice from 0",
                           "take positions as an input and feed them: model.inputs "
                           "{ input_ids = int64[batch, seq], position_ids = int64[batch, seq] } "
                           "with data inputs = { position_ids = positions }")


def _check_ring_call(plan: Plan, key: str, node: fx.Node, q, k) -> None:
    """What one SDPA call carries that ring attention could not honour."""
    a = sdpa_arguments(node.args, node.kwargs)
    if a["attn_mask"] is not None and not is_whole_mask(a["attn_mask"]):
        raise PlanError.at(plan, key, f"attention `{node.name}` takes a mask tensor; ring "
                           "attention computes each K/V block itself and honours only "
                           "is_causal", "build the model's attention with is_causal (or no "
                           "mask) instead of a mask tensor, or use method = ulysses")
    if isinstance(a["dropout_p"], fx.Node) or a["dropout_p"]:
        raise PlanError.at(plan, key, f"attention `{node.name}` has dropout_p = "
                           f"{a['dropout_p']}; ring attention's blocks run without dropout",
                           "set the model's attention dropout to 0")
    if q.shape[2] != k.shape[2]:
        raise PlanError.at(plan, key, f"attention `{node.name}` attends from {q.shape[2]} "
                           f"to {k.shape[2]} positions per rank, not over its own sequence",
                           "ring attention passes around keys of the same sequence as the "
                           "queries (self-attention); use method = ulysses")


def ring_traffic(plan: Plan, graph: fx.Graph, run: MetaRun,
                 tp_heads: dict[fx.Node, int] | None = None) -> dict[fx.Node, int]:
    """Bytes one rank sends per microbatch through each attention op's ring: its K and V
    blocks go cp-1 hops forward and again backward, and the dK/dV accumulators cp-1 hops
    (summed in at least float32, backends/parallel/cp/ring.py); of the 1/tp of the KV
    heads a tensor-parallel rank holds, where tp splits them."""
    cp, tp_heads = plan.mesh.cp, tp_heads or {}
    out = {}
    for node in attention_nodes(graph):
        k, v = run.value(node.args[1]), run.value(node.args[2])
        kv = k.numel() * k.element_size() + v.numel() * v.element_size()
        dkv = (k.numel() + v.numel()) * max(k.element_size(), 4)
        out[node] = (cp - 1) * (2 * kv + dkv) // tp_heads.get(node, 1)
    return out


def ulysses_traffic(plan: Plan, graph: fx.Graph, run: MetaRun,
                    tp_heads: dict[fx.Node, int] | None = None) -> dict[fx.Node, int]:
    """Bytes one rank sends per microbatch through each attention op's all-to-alls
    (forward and backward): q, k, v and the output go out and their gradients come
    back, each keeping 1/cp of its elements local (of the 1/tp of the heads a
    tensor-parallel rank holds, where tp splits them)."""
    cp, tp_heads = plan.mesh.cp, tp_heads or {}
    out = {}
    for node in attention_nodes(graph) + region_nodes(graph):
        moved = sum(run.value(a).numel() * run.value(a).element_size()
                    for a in (node.args[0], node.args[1], node.args[2], node))
        out[node] = 2 * moved * (cp - 1) // (cp * tp_heads.get(node, 1))
    return out


def exchanges(plan: Plan) -> tuple[int, int, int]:
    """Per attention op and microbatch on one cp rank: (collective calls, message latencies
    waited in the forward, in the backward), as backends/parallel/cp/ runs them. Ulysses:
    q, k, v in and the output back, forward and backward (their gradients), 8 all-to-alls,
    each cp - 1 pairwise exchanges; ring: K/V cp - 1 hops forward, K/V and the dK/dV
    accumulators cp - 1 hops each backward, one send (and receive) per hop."""
    cp = plan.mesh.cp
    if cp == 1:
        return 0, 0, 0
    if plan.context.method == "ring":
        return 3 * (cp - 1), cp - 1, 2 * (cp - 1)
    return 8, 4 * (cp - 1), 4 * (cp - 1)


def attach_context_costs(plan: Plan, stages: list, split, graph: fx.Graph, nodes: list,
                         run: MetaRun, tp_heads: dict[fx.Node, int] | None = None) -> None:
    """Per stage and microbatch: the all-to-all or ring bytes (StageSpec.cp_bytes), calls
    (cp_calls) and message latencies (cp_steps: forward, backward); `nodes`: the graph's
    compute nodes (partition.compute_nodes, the split's positions). What attention
    computes under cp is counted on its node (`attention_blocks`, costs.py)."""
    cp = plan.mesh.cp
    if cp == 1:
        return
    index = {n: i for i, n in enumerate(nodes)}
    ring = plan.context.method == "ring"
    traffic = (ring_traffic if ring else ulysses_traffic)(plan, graph, run, tp_heads)
    calls, forward, backward = exchanges(plan)
    for node, nbytes in traffic.items():
        st = stages[split.stage_of(index[node])]
        st.cp_bytes += nbytes
        st.cp_calls += calls
        st.cp_steps = (st.cp_steps[0] + forward, st.cp_steps[1] + backward)


def attention_blocks(plan: Plan, graph: fx.Graph) -> dict[fx.Node, float]:
    """How many times each attention op's meta-run work runs on one cp rank. The meta run
    costs each SDPA on the local slice with all heads ((S/cp)^2 * H, one block). Ulysses
    runs it on the whole sequence with H/cp heads (S^2 * H/cp): cp blocks. Ring runs cp
    blocks, or under is_causal its own block and cp-1 half blocks (the load-balanced
    layout): 1 + (cp-1)/2 blocks. An attention region run whole (cp_regions.py) already
    costs H/cp heads over S positions: not listed."""
    cp = plan.mesh.cp
    if cp == 1 or plan.context is None:
        return {}
    ring = plan.context.method == "ring"
    out = {}
    for node in attention_nodes(graph):
        if node.meta.get(REGION):
            continue
        causal = sdpa_arguments(node.args, node.kwargs)["is_causal"]
        out[node] = 1 + (cp - 1) / 2 if ring and causal else float(cp)
    return out
