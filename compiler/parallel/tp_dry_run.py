"""Tensor-parallel stages run once before launch: each stage as a rank's runtime rewrites it
(DTensor nodes: backends/parallel/tp), forward and backward on meta tensors in a world of
fake process groups (backends/parallel/pretrace.py, handed in by the commands that compile
before a launch), so that an op DTensor cannot run on the values the split hands it (an
in-place op that would need a placement change, an op with no sharding strategy) is refused
by `pipeplan check` at the tensor line -- the op, its source line and module named -- before
any process starts, not in the first step of every rank.

Meta tensors, not fake ones: under torch 2.13's FakeTensorMode, DTensor's strided-shard
redistribution reads back index tensors it makes (a data-dependent value there) where a real
run succeeds. Device arguments the graph's nodes name (`to(device=cpu)`) point at meta for
the run (nothing is computed). What meta tensors cannot run (a data-dependent size, a value
read back, an op without a meta kernel) ends that stage's run unjudged: only DTensor's own
refusals refuse. Stages alike in structure (a deep model's middle stages: the same code on
the same shapes, other layers' names) run once. The ranks of a tp group hold the same shapes,
so coordinate 0 stands for all; under sequence parallel a refused op is run again without it
to say which line to change.
"""
from __future__ import annotations

import contextlib
import dataclasses
import re
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.fx as fx
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from ...dsl.ast import Plan
from ...dsl.errors import PlanError
from ..capture.blocks import module_path
from ..compiled import BATCH, StageSpec
from ..graphs.joint import COLLECTIVES

_META = torch.device("meta")
_DTENSOR_REFUSALS = ("Sharding propagation failed", "does not have a sharding strategy",
                     "in-place operations that require placement changes",
                     # DTensor's redistribution (torch/distributed/tensor/_redistribute.py):
                     # HRM's vocab-split embedding output took a partial gradient it cannot
                     # turn back into the embedding's masked partial (check had passed)
                     "Redistribution from one partial type", "not supported yet")


@dataclass(frozen=True)
class Refused:
    """An op DTensor refused in a stage's forward (or the backward of `node`)."""
    stage: int
    node: Optional[fx.Node]
    backward: bool
    reason: str


@dataclass(frozen=True)
class DryRun:
    """One stage's run on meta: DTensor's refusal, or what meta tensors could not run
    (unjudged from there on), or neither: forward and backward ran through, issuing
    `collectives` (op -> calls, bytes handed in, per microbatch: DTensor's own, as
    compiler/graphs/joint.traced_collectives names them)."""
    stage: int
    refused: Optional[Refused] = None
    unjudged: Optional[str] = None
    collectives: Optional[dict] = None


def check_tp_runs(plan: Plan, stages: Sequence[StageSpec], graph: fx.Graph, values: dict,
                  experts: tuple, tp_kinds: dict, rewrite: Optional[Callable]) -> None:
    """Under tp, each distinct stage, rewritten in the fake world, is run forward and
    backward on meta tensors; the first op DTensor refuses is refused at the tensor line (`values`: the
    capture's meta value of each node of `graph`). Nothing without `rewrite` (inside a
    running world the ranks rewrite their own)."""
    if plan.mesh.tp <= 1 or rewrite is None:
        return
    values = {n.target if n.op == "placeholder" else n.name: values.get(n) for n in graph.nodes}
    runs = dry_runs(plan, stages, values, experts, tp_kinds, rewrite)
    refused = next((r.refused for r in runs if r.refused), None)
    if refused is None:
        # the collectives' bytes: autocast (bf16) does not act on meta tensors, so a bf16
        # plan's run moves float32 values; its counts are not kept
        by_index = {r.stage: r.collectives for r in runs} \
            if plan.train.precision != "bf16" else {}
        ran = {r.stage: r.unjudged or "" for r in runs}
        for st in stages:  # (compiled graphs trace their own after this)
            st.traced_collectives = by_index.get(st.index)
            st.tp_run = ran.get(st.index)
        return
    where = module_path(refused.node) if refused.node is not None else ""
    whole = f"`{where}`" if where else "the module holding it"
    if plan.tensor.plan == "auto":
        key, hint = "tensor.plan", f"write the column / row patterns yourself, leaving " \
            f"{whole} whole, or use mesh.tp = 1"
    else:
        key, hint = _pattern_key(plan), f"leave {whole} whole (out of the tensor " \
            "patterns), or use mesh.tp = 1"
    if plan.tensor.sequence_parallel:
        plain = dataclasses.replace(plan, tensor=dataclasses.replace(
            plan.tensor, sequence_parallel=False))
        again = dry_runs(plain, [s for s in stages if s.index == refused.stage], values,
                         experts, tp_kinds, rewrite)
        if not any(r.refused or r.unjudged for r in again):
            key, hint = "tensor.sequence_parallel", \
                "set sequence_parallel = false (the stage runs without it: checked)"
    raise PlanError.at(plan, key, _message(refused), hint)


def dry_runs(plan: Plan, stages: Sequence[StageSpec], values: dict, experts: tuple,
             tp_kinds: dict, rewrite: Callable) -> list[DryRun]:
    """Each stage of the first world `rewrite` stands up (the runs of later ones, cp ranks,
    judged too), run on meta (`values`: meta values by stage input name): a stage alike in
    structure (`_structure`) to one run before takes its outcome. Stops at the first
    refusal."""
    seen: dict = {}
    runs: dict[int, DryRun] = {}
    with contextlib.closing(rewrite(plan, experts, tp_kinds, stages)) as worlds:
        for modules in worlds:
            for st in stages:
                module = modules[st.index]
                inputs = [values[r.name] for r in st.inputs]
                needs = [r.source != BATCH and r.requires_grad for r in st.inputs]
                key = _structure(module, inputs, needs)
                if key not in seen:
                    seen[key] = _run_on_meta(st.index, module, inputs, needs)
                    if seen[key].refused is not None:
                        return list(runs.values()) + [seen[key]]
                runs.setdefault(st.index, dataclasses.replace(seen[key], stage=st.index))
    return list(runs.values())


def _pattern_key(plan: Plan) -> str:
    t = plan.tensor
    return next((f"tensor.{k}" for k in ("column", "row", "vocab") if getattr(t, k)), "mesh.tp")


def _message(r: Refused) -> str:
    n = r.node
    op = str(n.target) if n is not None else "an op"
    where = module_path(n) if n is not None else ""
    src = _source(n) if n is not None else ""
    return (f"stage {r.stage} cannot run under tensor parallel: DTensor refuses "
            f"{'the backward of ' if r.backward else ''}`{op}`"
            + (f" (node `{n.name}`" if n is not None else "")
            + (f" in module `{where}`" if where else "") + (")" if n is not None else "")
            + (f" at {src}" if src else "") + f": {r.reason}")


def _source(node: fx.Node) -> str:
    """The model's source line a node was traced from (file:line, from site-packages on)."""
    found = re.findall(r'File "([^"]+)", line (\d+)', node.meta.get("stack_trace") or "")
    if not found:
        return ""
    path, line = found[-1]
    return f"{path.split('site-packages/')[-1]}:{line}"


def _structure(module: torch.nn.Module, inputs: Sequence, needs: Sequence[bool]):
    """What DTensor's run of a stage depends on: its code with the digits of names and
    quoted paths dropped (layer indices: `getattr(self.layers, "10")`), its tensors'
    shapes and dtypes in order, its inputs'."""
    code = module.code if isinstance(module, fx.GraphModule) else id(module)
    code = re.sub(r'[A-Za-z_][A-Za-z0-9_]*|"[^"]*"', lambda m: re.sub(r"\d+", "#", m.group()),
                  code) if isinstance(code, str) else code
    tensors = [(tuple(t.shape), t.dtype, t.requires_grad)
               for _, t in list(module.named_parameters()) + list(module.named_buffers())]
    return code, tuple(tensors), tuple((tuple(x.shape), x.dtype, g)
                                       for x, g in zip(inputs, needs))


class _Running(fx.Interpreter):
    """Runs a stage graph node by node on meta tensors, knowing which node runs and, in the
    backward, whose gradient function last started. A device a node names (the graph's
    `to(device=cpu)`, its factories) is meta; DTensor's own bookkeeping (index tensors it
    makes and reads back) stays on the host."""

    def __init__(self, module: fx.GraphModule):
        super().__init__(module)
        self.current: Optional[fx.Node] = None
        # the backward's last started node, by name: a hook holding the interpreter (its
        # values, whose grad_fns hold the hook) would be a cycle through C++ that Python's
        # collector cannot free
        self.started: list[Optional[str]] = [None]

    @property
    def backward(self) -> Optional[fx.Node]:
        name = self.started[0]
        return next((n for n in self.graph.nodes if n.name == name), None)

    def run_node(self, n: fx.Node):
        self.current = n
        with self._set_current_node(n):
            args, kwargs = tree_map(lambda x: _META if isinstance(x, torch.device) else x,
                                    self.fetch_args_kwargs_from_env(n))
            out = getattr(self, n.op)(n.target, args, kwargs)
        started, name = self.started, n.name
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor) and t.grad_fn is not None:
                t.grad_fn.register_prehook(
                    lambda grads, name=name: started.__setitem__(0, name))
        return out


def _run_on_meta(index: int, module: torch.nn.Module, inputs: Sequence,
                 needs: Sequence[bool]) -> DryRun:
    if not isinstance(module, fx.GraphModule):
        return DryRun(index, unjudged=f"a {type(module).__name__}, not a stage graph")
    args = [torch.empty(x.shape, dtype=x.dtype, device=_META)
            .requires_grad_(bool(g) and x.is_floating_point()) for x, g in zip(inputs, needs)]
    running = _Running(module)
    forward = True
    counted = _Collectives()
    try:
        with torch.enable_grad(), counted:
            out = running.run(*args)
            outs = [o for o in (out if isinstance(out, (tuple, list)) else (out,))
                    if isinstance(o, torch.Tensor) and o.requires_grad]
            forward = False
            if outs:
                torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
    except Exception as e:  # noqa: BLE001 -- only DTensor's own refusals are judged
        node = running.current if forward else running.backward
        running.env.clear()
        reason = _dtensor_refusal(e)
        if reason is None:  # meta cannot run it
            first = str(e).strip().split("\n")[0][:200]
            return DryRun(index, unjudged=f"{'backward of ' if not forward else ''}"
                          f"{node.name if node is not None else '?'}: {type(e).__name__}: "
                          f"{first}")
        return DryRun(index, Refused(index, node, not forward, reason))
    running.env.clear()
    return DryRun(index, collectives=counted.found)


class _Collectives(TorchDispatchMode):
    """Counts the functional collectives DTensor issues (op -> calls, bytes handed in)."""

    def __init__(self):
        super().__init__()
        self.found: dict[str, tuple[int, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor runs the op with this mode on: its collectives
        op = COLLECTIVES.get(func._opname) if func.namespace == "_c10d_functional" else None
        if op is not None and isinstance(args[0], torch.Tensor):
            calls, nbytes = self.found.get(op, (0, 0))
            self.found[op] = (calls + 1, nbytes + args[0].numel() * args[0].element_size())
        return func(*args, **(kwargs or {}))


def _dtensor_refusal(e: Exception) -> Optional[str]:
    """DTensor's reason, when `e` is its refusal of an op's placements (not a meta kernel's
    failure, which DTensor's propagation also reports)."""
    text = str(e)
    if not any(s in text for s in _DTENSOR_REFUSALS) or "meta tensor" in text.lower() \
            or "'Meta' backend" in text or "data-dependent" in text.lower():
        return None
    first = text.split("\n\n")[0].strip()
    return first.split("\n")[0][:400]
