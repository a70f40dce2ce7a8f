"""The runtime's entry to per-stage parallelism: checks, groups, stage rewrite, ZeRO wiring.

What the runtime calls, per rank (calls marked *collective* must be made by
every rank of the world, in the same order):

* compile time (compiler/parallel/checks.py): `check_parallel_model(plan, model)`:
  PlanErrors at plan lines, before any process starts.
* `build_parallel_groups(mesh, tp_group, dp_group)` (*collective*): tp and dp
  come from the runtime's DeviceMesh; expert parallelism re-divides the ranks
  of a pipeline stage into EP groups (dsl/layout.py): `ep` consecutive dp
  ranks of one tp coordinate when ep divides dp, else (EP across TP) `ep`
  consecutive ranks of the stage's dp x tp block; ranks with the same ep rank
  hold the same experts and form the expert-data-parallel group.
* `parallelize_stage(module, plan, groups)` on each own stage module before
  its runner: the experts module of each MoE layer (the call the capture kept
  opaque, compiler/parallel/ep.py) becomes `ExpertParallelExperts` around the
  model's own experts code (expert_parallel.py), then the `tensor` patterns
  apply (backends/parallel/tp/: a DTensor rewrite of the stage graph; under EP across
  TP each TP rank's experts call takes its 1/tp share of the tokens).
  Parameter names are unchanged.
* after a stage's last backward of the step: `sync_sequence_parallel()`; then
  gradient sums per `grad_group(param)` (experts over expert-DP, the rest
  over dp), or with zero > 0 `build_zero_optimizer(...)` -> `StageZero`
  (zero.py): `PrefetchWindow` around each action at stage 3,
  `reduce_gradients()`, `clip_grad_norm_()`, `step()`, `zero_grad()`.

Aux losses are the model's own, computed by its code over the tokens of one
call (one microbatch of one dp rank), so the reference runs one chunk at a
time (backends/verify/reference.py: `chunk_groups`); under `experts.balance = step` their
statistics cover the whole step (backends/runtime/balance.py) and the reference runs
the whole global batch at once (reference.chunk_groups).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn

from ...dsl.ast import MeshSpec, Plan
from ...dsl.layout import ep_across_tp, ep_fits, global_rank, group_sizes, groups, mesh_layout
from ...compiler.compiled import ExpertPlacement
from ...compiler.parallel.checks import rewrites_stages
from ...compiler.parallel.ep import experts_dispatched
from ...compiler.parallel.zero import EXPERT, REPLICATED, TENSOR_PARALLEL, group_shards
from ...errors import PipeplanError
from ..runtime.topology import new_groups
from .layout import StageLayout
from .ep.experts import ExpertParallelExperts, gather_experts
from .tp import (ParameterSlicer, TensorParallelResult, TensorParallelRules, apply_tensor_parallel,
                 gather_full_state, tp_shard_dims)
from .tp.params import sync_partial_grads
from .zero.sharding import FlatShard, PrefetchWindow, StageZero, ZeroOptimizer  # noqa: F401 (re-exported)


# ------------------------------------------------------- compile-time checks
# What only the rewrites here know; tp dividing features, heads and vocabulary,
# tied weights split alike, and the expert count, are checked by
# compiler/parallel/tp.py and compiler/parallel/ep.py.
def replace_submodule(root: nn.Module, name: str, new: nn.Module) -> None:
    """Put `new` where the submodule `name` is (its attribute on its parent)."""
    parent, _, leaf = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, leaf, new)


# ------------------------------------------------------------------ groups
@dataclass(frozen=True)
class ParallelGroups:
    """The process groups one rank's stages use (None: a group of one)."""

    mesh: MeshSpec
    tp: Optional[dist.ProcessGroup] = None
    dp: Optional[dist.ProcessGroup] = None
    ep: Optional[dist.ProcessGroup] = None
    expert_dp: Optional[dist.ProcessGroup] = None
    # Sequence parallel with MoE layers: the EP group x the TP group, whose tokens
    # (sequence shards) the aux statistics cover.
    expert_stats: Optional[dist.ProcessGroup] = None
    # One per rank: slices each full parameter once over all the rank's stages ...
    slicer: Optional[ParameterSlicer] = field(default=None, compare=False)
    # ... and sums each partial (sequence-parallel) gradient once over them.
    partial_grads: Optional["PartialGrads"] = field(default=None, compare=False)


class PartialGrads:
    """Sums partial gradients over tp once per step, after every stage holding them is done.

    Under sequence parallel a replicated parameter's gradient on one TP rank
    covers only its sequence shard. A parameter held by two stages of this
    rank (a tied weight) is summed when the later of them finishes, not twice.
    """

    def __init__(self, group):
        self.group = group
        self._holders: dict[int, int] = {}
        self._done: dict[int, int] = {}

    def register(self, params: Sequence[nn.Parameter]) -> None:
        for p in params:
            self._holders[id(p)] = self._holders.get(id(p), 0) + 1

    def stage_done(self, params: Sequence[nn.Parameter]) -> None:
        for p in params:
            done = self._done.get(id(p), 0) + 1
            if done == self._holders[id(p)]:
                if p.grad is not None:
                    dist.all_reduce(p.grad, group=self.group)
                done = 0
            self._done[id(p)] = done


def check_expert_mesh(mesh: MeshSpec) -> None:
    if not ep_fits(mesh):  # dsl/checks.py refuses it at the plan line; here for Plans built in code
        raise PipeplanError(
            f"expert parallel size {mesh.ep} must divide dp ({mesh.dp}) or dp x tp "
            f"({mesh.dp * mesh.tp}): EP groups re-divide the ranks of a pipeline stage "
            f"(dsl/layout.py)")


def expert_group_ranks(mesh: MeshSpec) -> tuple[list[list[int]], list[list[int]]]:
    """(EP groups, expert-DP groups) as global rank lists, for the whole world.

    Taken from the plan's mesh layout (`pipeplan check` prints the same groups).
    """
    layout = mesh_layout(mesh)
    return ([list(g) for g in groups(layout, "ep", mesh.islands)],
            [list(g) for g in groups(layout, "edp", mesh.islands)])


def expert_stats_ranks(mesh: MeshSpec) -> list[list[int]]:
    """Sequence parallel: each EP group together with its TP peers, as global rank lists."""
    return [[global_rank(mesh, pp, block * mesh.ep + e, tp)
             for e in range(mesh.ep) for tp in range(mesh.tp)]
            for pp in range(mesh.pp) for block in range(mesh.dp // mesh.ep)]


def build_parallel_groups(mesh: MeshSpec, tp_group=None, dp_group=None,
                          sequence_parallel_experts: bool = False) -> ParallelGroups:
    """Collective. `tp_group`/`dp_group`: the runtime's DeviceMesh groups;
    `sequence_parallel_experts`: the plan has MoE layers and sequence parallel on."""
    check_expert_mesh(mesh)
    ep = edp = stats = None
    if mesh.ep > 1:
        ep_lists, edp_lists = expert_group_ranks(mesh)
        _, ep = new_groups(ep_lists)
        if group_sizes(mesh).edp > 1:
            _, edp = new_groups(edp_lists)
    elif not mesh.islands:
        edp = dp_group
    if sequence_parallel_experts and mesh.tp > 1:
        stats = tp_group if mesh.ep == 1 else new_groups(expert_stats_ranks(mesh))[1]
    tp = tp_group if mesh.tp > 1 else None
    # with context parallel dp_group is the flattened dp x cp group (backends/runtime/topology.py);
    # DiLoCo islands sum no gradient over dp (edp: the island's own expert replicas)
    dp = dp_group if mesh.dp * mesh.cp > 1 and not mesh.islands else None
    return ParallelGroups(mesh, tp, dp, ep, edp, stats,
                          ParameterSlicer(tp) if tp is not None else None,
                          PartialGrads(tp) if tp is not None else None)


# ------------------------------------------------------------ stage rewrite
@dataclass
class ParallelStage:
    """A stage module after its rewrite, and what its gradient sync needs to know."""

    module: nn.Module
    groups: ParallelGroups
    tensor: Optional[TensorParallelResult] = None
    experts: dict = field(default_factory=dict)  # experts module name -> ExpertParallelExperts

    def expert_params(self) -> list[nn.Parameter]:
        return [p for layer in self.experts.values() for p in layer.parameters()]

    def grad_group(self, param: nn.Parameter):
        """The group this parameter's gradient is summed over (None: no reduction)."""
        if any(param is p for p in self.expert_params()):
            return self.groups.expert_dp
        return self.groups.dp

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The stage's state under the reference's names and full shapes (collective over
        the tp and ep groups; with ZeRO-3, call between `gather` and `release`)."""
        state = gather_full_state(self.module, self.groups.tp) if self.tensor is not None \
            else dict(self.module.state_dict())
        for name, layer in self.experts.items():
            for key, value in gather_experts(layer).items():
                state[f"{name}.{key}"] = value
        return state

    def sync_sequence_parallel(self) -> None:
        """Once per step, when this stage's backwards are done: partial gradients over tp."""
        if self.tensor is None or not self.tensor.sequence_partial:
            return
        if self.groups.partial_grads is None:
            sync_partial_grads(self.partial_params(), self.groups.tp)
            return
        self.groups.partial_grads.stage_done(self.partial_params())

    def partial_params(self) -> list[nn.Parameter]:
        params = dict(self.module.named_parameters(remove_duplicate=False))
        found = [params[n] for n in (self.tensor.sequence_partial if self.tensor else ())]
        return list({id(p): p for p in found}.values())


def _apply_experts(module: nn.Module, plan: Plan, groups: ParallelGroups,
                   placements: tuple[ExpertPlacement, ...]) -> dict:
    """Each experts module the compiled plan placed (ExpertPlacement.experts) that this
    stage calls becomes this rank's EP shard of it, the experts the placement gives it."""
    spec = plan.experts
    called = {n.target for n in module.graph.nodes if n.op == "call_module"} \
        if isinstance(module, fx.GraphModule) else {n for n, _ in module.named_modules()}
    capacity = None if spec.dropless else spec.capacity_factor
    ep_rank = dist.get_rank(groups.ep) if groups.ep is not None else 0
    layers = {}
    for placed in placements:
        name = placed.experts
        if name is None or name not in called:
            continue
        layer = ExpertParallelExperts(module.get_submodule(name), spec.num_experts, groups.ep,
                                      capacity, spec.drop_policy, placed.shards[ep_rank],
                                      static=plan.compile.graphs)
        replace_submodule(module, name, layer)
        layers[name] = layer
    return layers


def parallelize_stage(module: nn.Module, plan: Plan, groups: ParallelGroups,
                      experts: tuple[ExpertPlacement, ...] = (),
                      tp_kinds: Optional[dict[str, str]] = None) -> ParallelStage:
    """Rewrite one stage module in place for this rank's EP and TP groups; `experts` and
    `tp_kinds`: the compiled plan's expert placement and TP kinds (CompiledPlan.experts,
    .tp_rewrites; without kinds, the plan's patterns are matched here, as tests do on
    modules they build by hand)."""
    stage = ParallelStage(module, groups)
    if experts_dispatched(plan):
        if not experts:
            raise PipeplanError("the plan distributes experts, but no expert placement was "
                                "given: pass the compiled plan's (CompiledPlan.experts)")
        stage.experts = _apply_experts(module, plan, groups, experts)
    rules = TensorParallelRules.from_plan(plan.tensor) if tp_kinds is None else \
        TensorParallelRules.compiled(tp_kinds, plan.tensor.sequence_parallel)
    if plan.mesh.tp > 1:
        stage.tensor = apply_tensor_parallel(module, rules, groups.tp, groups.slicer,
                                             frozenset(stage.experts),
                                             split_tokens=ep_across_tp(plan.mesh))
        if groups.partial_grads is not None:
            groups.partial_grads.register(stage.partial_params())
    return stage


# --------------------------------------------------------------------- ZeRO
def _zero_kind(st: ParallelStage) -> dict[int, str]:
    """id(parameter) -> its ZeRO kind (compiler/parallel/zero.py): experts, TP slices, the rest."""
    experts = {id(p) for p in st.expert_params()}
    params = dict(st.module.named_parameters(remove_duplicate=False))
    tp_sharded = {id(params[n]) for n in tp_shard_dims(st.module) if n in params}
    return {id(p): EXPERT if id(p) in experts else TENSOR_PARALLEL if id(p) in tp_sharded
            else REPLICATED for p in st.module.parameters()}


def _zero_groups(groups: ParallelGroups, kind: str):
    """(reduce group, spread group) of a kind. Spread group: the ranks holding *other*
    parts of the same kind (TP slices: the TP group; experts: the EP group), over which
    the global norm sums."""
    if kind == EXPERT:
        return groups.expert_dp, groups.ep
    return groups.dp, (groups.tp if kind == TENSOR_PARALLEL else None)


def build_zero_optimizer(stages: dict[int, ParallelStage], plan: Plan,
                         make_optimizer, device: Optional[torch.device] = None) -> "StageZero":
    """One flat shard per (stage, kind): replicated and TP-sharded parameters over dp,
    experts over expert-dp, so each shard's norm sums over one spread group. The grouping
    is `zero_layout.group_shards`, the same the compiler's memory estimate uses.

    A parameter held by two stages of this rank (a tied embedding in a V
    schedule) lives in the first stage's shard; `gather(stage)` gathers every
    shard the stage reads. Meta parameters (the runtime's start-up) get only the
    buffers this rank holds, on `device`, to be filled from `fill_targets()`.
    """
    params: dict[int, nn.Parameter] = {}
    listed = []
    for index, st in stages.items():
        kinds = _zero_kind(st)
        named = [p for _, p in st.module.named_parameters() if p.requires_grad]
        params.update((id(p), p) for p in named)
        listed.append((index, [(id(p), kinds[id(p)]) for p in named]))
    layout, uses = group_shards(listed)
    names = {id(p): n for st in stages.values() for n, p in st.module.named_parameters()}
    shards = []
    for g in layout:
        group, spread = _zero_groups(stages[g.stage].groups, g.kind)
        shards.append(FlatShard([(names[k], params[k]) for k in g.keys], group, plan.zero,
                                spread, device))
    return StageZero(ZeroOptimizer(shards, make_optimizer),
                     {s: [shards[i] for i in uses.get(s, [])] for s in stages})


# ------------------------------------------------------------- the one entry
def rewrite_stages(plan: Plan, topo, modules: dict[int, nn.Module],
                   experts: tuple[ExpertPlacement, ...], tp_kinds: Optional[dict[str, str]]
                   ) -> Optional[tuple[ParallelGroups, dict[int, ParallelStage]]]:
    """Steps 1 and 2 of `parallelize` (the stage modules rewritten in place, cp first);
    (groups, stages) where ep / tp rewrite them, else None. Also what pretrace.py runs in
    a fake world before launch (collective)."""
    if plan.mesh.cp > 1:
        from .cp.ring import apply_ring
        from .cp.ulysses import apply_ulysses

        from .cp.positions import cp_columns, gather_masks, renumber_positions

        apply = apply_ring if plan.context.method == "ring" else apply_ulysses
        for m in modules.values():
            apply(m, topo.cp_group)
            renumber_positions(m, cp_columns(plan, topo.coords.cp))  # the model's own arange
            gather_masks(m, plan, topo.cp_group)  # the model's own mask, on the whole sequence
    if not rewrites_stages(plan):
        return None
    groups = build_parallel_groups(
        plan.mesh, topo.tp_group, topo.dp_group,
        sequence_parallel_experts=plan.tensor.sequence_parallel and plan.experts is not None)
    return groups, {s: parallelize_stage(modules[s], plan, groups, experts, tp_kinds)
                    for s in sorted(modules)}


def parallelize(plan: Plan, topo, modules: dict[int, nn.Module], device: torch.device,
                experts: tuple[ExpertPlacement, ...], tp_kinds: Optional[dict[str, str]],
                make_optimizer) -> tuple[StageLayout, Optional[StageZero]]:
    """This rank's stage modules (still on meta) made parallel in place, axis by axis, in
    the one order that works (collective: every rank calls it):

    1. context parallel (cp/): each SDPA call of the captured stage graph becomes Ulysses
       or ring attention over the cp group (a written-out attention region gets Ulysses'
       all-to-alls), each arange the compiler tied to the sequence numbers the rank's
       global positions, and each whole-sequence mask gathers its inputs over the cp
       group (cp/positions.py); it wraps the graph's
       own attention nodes, so it goes first, on the graph as captured;
    2. expert parallel, then tensor parallel (`parallelize_stage`: ep/, tp/): the experts modules are wrapped first so that TP's DTensor rewrite of the
       stage graph leaves each one an opaque call;
    3. ZeRO (zero/): flat buffers laid out over the parameters as the rewrites left them
       (TP slices, this rank's experts) while they are still meta.

    Weights come after all three, outside (state/materialize.py: `fill_stages`), so a rank
    gives storage only to the shards it owns. Returns the layout (where each gradient is
    summed) and the ZeRO optimizer (None at zero = 0)."""
    rewritten = rewrite_stages(plan, topo, modules, experts, tp_kinds)
    if rewritten is None:
        return StageLayout.build(topo, modules, device), None
    groups, parallel = rewritten
    layout = StageLayout.build(topo, modules, device, groups, parallel)
    zero = build_zero_optimizer(layout.parallel, plan, make_optimizer, device) \
        if plan.zero > 0 else None
    return layout, zero
