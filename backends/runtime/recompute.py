"""Activation recompute: a stage forward that saves less and reruns parts of itself in backward.

The plan's `recompute` rules name modules (`layers.* = full`). A traced stage
graph keeps each node's module path, so the nodes traced inside one matched
module form a *region*, run as one unit by `StageProgram` (the stage graph
executed node by node, an `fx.Interpreter` in spirit, installed as the
module's forward so its hooks, e.g. sequence parallel's, still run). Inside
a region a node is *dropped* or *kept*:

* `full`: every node is dropped; the region keeps only its inputs.
* `selective`: nodes that do no matmul work (norms, activations, adds,
  views; FLOPs counted by torch's FlopCounterMode in one dry run of the region
  at its first call) and the
  attention core (SDPA) are dropped; matmul nodes (Linear, bmm...) keep what
  they save, and their outputs stay as recompute inputs where needed.
* The nodes tensor parallelism inserts belong to the module of the node they
  serve (a region stays whole). Its collectives are dropped under `full` (the
  region keeps its inputs alone, a sequence-parallel input as its shard, and
  the rerun in backward all-gathers and reduces again, on every TP rank at the
  same unpack: the ranks run one graph) and kept under `selective` (no
  communication in backward).

The rules are compiler/recompute.py's; compiler/estimate/activations.py
counts what they keep, and tests compare it with `SavedBytes` byte for byte.

Autograd's saved-tensor hooks do the dropping: a tensor a dropped node saves
is replaced by a placeholder, unless it is a parameter, a region input or a
kept node's output (holding those costs nothing extra). The first unpack of
a placeholder in backward reruns, once, the dropped nodes that saved
something (and the dropped nodes they depend on) from the kept values, with
the forward's RNG state (its stage's seeded draws, draws.py) and autocast, and
caches what they save, in the same order as the forward.

Split backward (B then W): B's unpacks keep the cache, W's and BW's take
entries out of it. So W after B never recomputes a second time and never
finds a saved tensor gone; the cache dies with the microbatch's graph.

`SavedBytes` measures what a forward keeps for backward (unique storages, a
DTensor's local one; parameters excluded: the compiler's rule).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Optional, Sequence

import torch
from torch.distributed.tensor import DTensor
import torch.fx as fx
from torch.utils.flop_counter import FlopCounterMode

from ...compiler.capture.blocks import COLLECTIVE
from ...compiler.recompute import (Region, check_no_inplace_on_inputs, draws_random, dropped,
                                   find_regions)
from ...dsl.ast import RecomputeRule
from . import draws


# ------------------------------------------------------------ measurement
class SavedBytes:
    """Bytes autograd keeps for backward during a forward: unique storages, parameters excluded."""

    def __init__(self, params: Sequence[torch.Tensor]):
        self._params = {_storage(p) for p in params}
        self._seen: set[int] = set()
        self.bytes = 0

    def add(self, t: torch.Tensor) -> None:
        key = _storage(t)
        if key in self._params or key in self._seen:
            return
        self._seen.add(key)
        self.bytes += _local(t).untyped_storage().nbytes()

    def hooks(self) -> ContextManager:
        """Count every tensor packed under this context (outside recompute regions)."""
        def pack(t):
            self.add(t)
            return t
        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A tensor-parallel stage's values: the local tensor (its storage is what this rank
    holds; a DTensor's own is the global size)."""
    return t._local_tensor if isinstance(t, DTensor) else t


def _storage(t: torch.Tensor) -> int:
    return _local(t).untyped_storage().data_ptr()


def _never(_):
    raise RuntimeError("a recompute's own graph is never differentiated")


def _detached(v: Any) -> tuple[Any, bool]:
    if isinstance(v, torch.Tensor):
        return v.detach(), v.requires_grad
    return v, False


# ---------------------------------------------------------------- regions


@dataclass
class Phase:
    """Which backward is running: B keeps recomputed tensors for W; W and BW consume them."""

    final: bool = True


# --------------------------------------------------------------- execution
class StageProgram:
    """Runs a stage GraphModule node by node, recompute regions as units."""

    def __init__(self, module: fx.GraphModule, rules: Sequence[RecomputeRule],
                 autocast: Callable[[], ContextManager], phase: Phase):
        self.module = module
        self.autocast = autocast
        self.phase = phase
        self.regions = {r.nodes[0]: r for r in find_regions(module.graph, rules)}
        for r in self.regions.values():
            check_no_inplace_on_inputs(r)
        self._flops: dict[fx.Node, float] = {}  # selective: measured once per node
        nodes = list(module.graph.nodes)
        self._position = {n: i for i, n in enumerate(nodes)}
        last_use = {n: n for n in nodes}
        for n in nodes:
            for a in n.all_input_nodes:
                last_use[a] = n
        # position -> the values whose last user is that node (freed after it, as
        # fx.Interpreter does)
        self._dies_at: list[list[fx.Node]] = [[] for _ in nodes]
        for n, user in last_use.items():
            self._dies_at[self._position[user]].append(n)
        self.meter: Optional[SavedBytes] = None

    def __call__(self, *args):
        env: dict[fx.Node, Any] = {}
        args = iter(args)
        node = next(iter(self.module.graph.nodes), None)
        while node is not None:
            if node.op == "output":
                return fx.node.map_arg(node.args[0], env.__getitem__)
            region = self.regions.get(node)
            if node.op == "placeholder":
                env[node] = next(args)
                last = node
            elif region is not None:
                _RegionCall(self, region).forward(env)
                last = region.nodes[-1]
            else:
                env[node] = self.run_node(node, env)
                last = node
            for p in range(self._position[node], self._position[last] + 1):
                for n in self._dies_at[p]:
                    env.pop(n, None)
            node = last.next
        raise RuntimeError("stage graph has no output node")

    def run_node(self, node: fx.Node, env: dict) -> Any:
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), env.__getitem__)
        if node.op == "get_attr":
            obj = self.module
            for part in node.target.split("."):
                obj = getattr(obj, part)
            return obj
        if node.op == "call_function":
            return node.target(*args, **kwargs)
        if node.op == "call_method":
            return getattr(args[0], node.target)(*args[1:], **kwargs)
        if node.op == "call_module":
            return self.module.get_submodule(node.target)(*args, **kwargs)
        raise AssertionError(f"unexpected node op {node.op}")

    def dropped(self, region: Region, node: fx.Node) -> bool:
        """Whether `node` drops what it saves and reruns (compiler/recompute.py's rule)."""
        return dropped(region, node, self._flops.get(node, 0.0))

    def measure(self, region: Region, env: dict) -> None:
        """Selective, first call: each node's FLOPs (torch's FlopCounterMode), from one dry
        run of the region without autograd and with the RNG state put back."""
        if region.mode != "selective" or all(n in self._flops for n in region.nodes):
            return
        scratch = dict(env)
        with torch.random.fork_rng(devices=[]), torch.no_grad(), self.autocast():
            for node in region.nodes:
                if node.meta.get(COLLECTIVE):  # never rerun: a stand-in, no communication
                    scratch[node] = self.module.get_submodule(node.target).stand_in(
                        scratch[node.args[0]])
                    continue
                counter = FlopCounterMode(display=False)
                with counter:
                    scratch[node] = self.run_node(node, scratch)
                self._flops[node] = float(counter.get_total_flops())


class _RegionCall:
    """One region on one microbatch: the forward's placeholders and the recompute cache."""

    def __init__(self, program: StageProgram, region: Region):
        self.program, self.region = program, region
        # what a recompute starts from: values detached (holding their graph would make a
        # cycle through the nodes holding this call's placeholders), with requires_grad
        self.values: dict[fx.Node, tuple[Any, bool]] = {}
        self.packed: dict[fx.Node, list] = {}  # dropped node -> its packs (tensor or None)
        self.cache: dict[tuple[fx.Node, int], torch.Tensor] = {}
        self.rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None
        self.whole = draws.whole_draws_active()  # tp's whole draws (draws.py), rerun alike

    # ----------------------------------------------------------- forward
    def forward(self, env: dict) -> None:
        program, region = self.program, self.region
        program.measure(region, env)
        inside = set(region.nodes)
        outer = {a: env[a] for n in region.nodes for a in n.all_input_nodes if a not in inside}
        keep = {_storage(p) for p in program.module.parameters()}
        keep |= {_storage(v) for v in outer.values() if isinstance(v, torch.Tensor)}
        dropped_nodes = []
        for node in region.nodes:
            if not program.dropped(region, node):
                env[node] = program.run_node(node, env)  # saves as usual (and is measured)
                if isinstance(env[node], torch.Tensor):
                    keep.add(_storage(env[node]))
                continue
            packs: list = []

            def pack(t, packs=packs, node=node):
                if _storage(t) in keep:  # alive anyway: holding it costs nothing
                    packs.append(t.detach())
                    return t.detach()
                packs.append(None)
                return (self, node, len(packs) - 1)

            with torch.autograd.graph.saved_tensors_hooks(pack, self._unpack):
                env[node] = program.run_node(node, env)
            self.packed[node] = packs
            dropped_nodes.append(node)
        self._plan_recompute(env, dropped_nodes)

    def _plan_recompute(self, env: dict, dropped_nodes: list) -> None:
        """Which dropped nodes rerun (those whose saves were dropped, and the dropped nodes
        they read), and which values they start from (kept for backward)."""
        needed: set[fx.Node] = set()
        stack = [n for n in dropped_nodes if any(p is None for p in self.packed[n])]
        while stack:
            n = stack.pop()
            if n in needed:
                continue
            needed.add(n)
            for a in n.all_input_nodes:
                if a in self.packed and a not in needed:
                    stack.append(a)
                elif a not in self.packed:
                    self.values[a] = _detached(env[a])
        if any(draws_random(n) for n in dropped_nodes):  # same random numbers: rerun in full order
            needed = set(dropped_nodes)
            for n in dropped_nodes:
                self.values.update({a: _detached(env[a]) for a in n.all_input_nodes
                                    if a not in self.packed})
        self.rerun = [n for n in self.region.nodes if n in needed]
        meter = self.program.meter
        if meter is not None:
            for n in dropped_nodes:
                for t in self.packed[n]:
                    if t is not None:
                        meter.add(t)
            for v, _ in self.values.values():
                if isinstance(v, torch.Tensor):
                    meter.add(v)
        # only the placeholders' positions are needed from here on
        self.packed = {n: (len(p), {k for k, t in enumerate(p) if t is None})
                       for n, p in self.packed.items()}

    # ---------------------------------------------------------- backward
    @staticmethod
    def _unpack(handle):
        if isinstance(handle, torch.Tensor):
            return handle.detach()
        call, node, k = handle
        return call._get(node, k)

    def _get(self, node: fx.Node, k: int) -> torch.Tensor:
        if (node, k) not in self.cache:
            self._recompute()
        # a fresh alias: autograd may attach its node to what an unpack returns, and a
        # tensor held here would then keep the graph (and this call) alive in a cycle
        if self.program.phase.final:
            return self.cache.pop((node, k)).detach()
        return self.cache[(node, k)].detach()

    def _recompute(self) -> None:
        program = self.program
        env = {n: v.detach().requires_grad_(grad) if grad else v
               for n, (v, grad) in self.values.items()}
        with torch.random.fork_rng(devices=[] if self.cuda_rng is None else None):
            torch.set_rng_state(self.rng)
            if self.cuda_rng is not None:
                torch.cuda.set_rng_state(self.cuda_rng)
            with torch.enable_grad(), program.autocast(), \
                    draws.WholeDraws() if self.whole else contextlib.nullcontext():
                for node in self.rerun:
                    packs: list = []

                    def pack(t, packs=packs):  # only the values matter: this graph is
                        packs.append(t.detach())  # never differentiated
                        return None

                    with torch.autograd.graph.saved_tensors_hooks(pack, _never):
                        env[node] = program.run_node(node, env)
                    count, placeholders = self.packed[node]
                    if len(packs) != count:
                        raise RuntimeError(f"recompute of {node.name} saved {len(packs)} tensors, "
                                           f"its forward {count}")
                    for k in placeholders:
                        self.cache[(node, k)] = packs[k]
