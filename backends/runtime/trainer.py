"""One rank's training loop: its stages, optimizer, executor and gradient sync.

`PipelineTrainer(plan, compiled, topo)` keeps only this rank's stages of the
compiled plan, rewrites them for TP / EP while their parameters are still meta,
then gives storage to exactly the shards this rank holds (model.fill_stages:
the reference's initial weights, sliced) and
`step(t)` runs one optimizer step: the scheduled actions, the DP/tied
gradient sync, global-norm clipping, the optimizer and LR schedule. Every
rank of the world must construct it (tied-parameter groups are collective).
The plan's precision (bf16 autocast, precision.py) and recompute rules
(recompute.py) apply inside each stage runner.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import time
import warnings
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from ...compiler.compiled import CompiledPlan
from ...dsl.ast import Plan
from . import data
from ..state.checkpoint import parameter_shapes
from .comm import op_name, plan_rank
from .executor import ActionTiming, Executor, Span, StepResult
from .memory import held_bytes
from .grads import GradSync, ZeroSync, build_tied_groups
from ..parallel import parallelize
from ..state.materialize import fresh_meta
from ..state.model import fill_stages
from .nonfinite import NonFiniteError, locate_non_finite
from .optim import build_lr_scheduler, build_optimizer
from .draws import draw_offsets, microbatch as microbatch_draws
from .precision import autocast_for, boundary_specs
from .stage import StageRunner
from .topology import Topology


@dataclass(frozen=True)
class StepReport:
    step: int
    loss: float  # the global step loss (mean over microbatches and DP), as the reference's;
    # under DiLoCo the island's own loss (mean over its share of the batch)
    grad_norm: Optional[float]  # the global norm, computed only when the plan clips
    lr: float
    step_time: float  # seconds, this rank
    tokens: int  # tokens in the global batch
    timings: tuple[ActionTiming, ...]
    spans: tuple[Span, ...] = ()  # sends, gradient sync, norm, loss all-reduce, optimizer
    sync_events: tuple = ()  # DiLoCo: the syncs after this step (diloco.SyncEvent)
    cpu_time: float = 0.0  # CPU seconds of this rank's process in the step (all its threads:
    # its own and gloo's), what ranks sharing a machine's cores take of them


def _boundary_specs(plan: Plan, stages) -> list:
    """The stage specs with the dtypes crossing stages under the plan's autocast, derived on
    fake copies of every stage (shapes and dtypes only: other ranks' stages have no weights
    here)."""
    if plan.train.precision == "fp32":
        return list(stages)
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ..state.materialize import fake_copy

    with FakeTensorMode(allow_non_fake_inputs=True):
        specs = boundary_specs(plan, [dataclasses.replace(s, module=fake_copy(s.module))
                                      for s in stages])
    return [dataclasses.replace(spec, module=s.module) for spec, s in zip(specs, stages)]


def make_runner(plan: Plan, spec, module, is_last: bool, scale: float, rules, autocast,
                device_type: str) -> StageRunner:
    """The stage runner `compile.mode` asks for: eager autograd (stage.py), or the
    partitioned joint graph (graph_stage.py; inductor.py compiles its graphs). The
    compiler's trace of the stage (`spec.joint`) is reused where it traced for this
    device type without autocast."""
    if not plan.compile.graphs:
        return StageRunner(spec, module, is_last, scale, recompute=rules, autocast=autocast)
    from ...compiler.graphs.joint import TRACE_DEVICE
    from .graph_stage import GraphStageRunner

    compile_part = None
    if plan.compile.mode == "inductor":
        from .inductor import compile_part
    joint = spec.joint if plan.train.precision != "bf16" and device_type == TRACE_DEVICE \
        else None  # (None under tp / ep: the compiler traced the stage before the rewrite)
    return GraphStageRunner(spec, module, is_last, scale, autocast=autocast,
                            compile_part=compile_part, joint=joint, recompute=rules)


def _stage_order_by_last_grad(order, stages_here) -> list[int]:
    last = {s: -1 for s in stages_here}
    for i, a in enumerate(order):
        if op_name(a) in ("W", "BW"):
            last[a.stage] = i
    return sorted(stages_here, key=lambda s: last[s])


class _Spans:
    """Records the step's non-action intervals (wall clock, as the executor's) into `spans`."""

    def __init__(self, spans: list):
        self.spans, self.open = spans, None

    def begin(self, kind: str, name: str) -> None:
        self.open = (kind, name, time.time())

    def end(self) -> None:
        kind, name, t = self.open
        self.spans.append(Span(kind, name, t, time.time()))

    @contextlib.contextmanager
    def __call__(self, kind: str, name: str):
        self.begin(kind, name)
        yield
        self.end()


class PipelineTrainer:
    @classmethod
    def for_plan(cls, plan: Plan, device: torch.device = torch.device("cpu")) -> "PipelineTrainer":
        """This rank's trainer, built as `pipeplan run` builds it: the plan compiled on the
        meta device with the leaves the stage rewrites need, then only this rank's stages
        materialised with the reference's initial weights (collective: every rank of the
        process group calls it)."""
        from ...compiler.driver import compile_plan
        from .topology import build_topology

        topo = build_topology(plan.mesh, device.type)
        compiled = compile_plan(plan)  # meta: no weights anywhere
        return cls(plan, compiled, topo, device)  # materialises this rank's shards only

    def __init__(self, plan: Plan, compiled: CompiledPlan, topo: Topology,
                 device: torch.device = torch.device("cpu")):
        self.plan, self.topo, self.device = plan, topo, device
        schedule = compiled.schedule
        pp = topo.coords.pp
        last = len(compiled.stages) - 1
        # DiLoCo: an island's gradient is the mean over its own share (no dp all-reduce);
        # context parallel: cp ranks hold equal slices of each microbatch's tokens
        islands = plan.sync.diloco
        scale = 1.0 / (schedule.microbatches * (1 if islands else plan.mesh.dp) * plan.mesh.cp)
        self.autocast = autocast_for(plan.train.precision, device)
        specs = _boundary_specs(plan, compiled.stages)
        # each stage's draws seeded by (seed, step, chunk, k) (draws.py): its first k, from
        # every stage before the rewrites and the weights
        offsets = draw_offsets(plan, compiled.stages)
        self._draw_step = 0  # the step whose draws the stages make
        modules = {s.index: s.module for s in compiled.stages_of_rank(pp)}
        deferred = any(p.device.type == "meta" for m in modules.values() for p in m.parameters())
        if deferred:
            fresh_meta(modules.values())  # fill_stages swaps storage into these objects
        else:  # stages compiled with weights (tests): moved whole, then sliced
            modules = {s: m.to(device) for s, m in modules.items()}
        for m in modules.values():  # what the model gives no gradient is never stepped
            for name, p in m.named_parameters():
                if name in compiled.gradless:
                    p.requires_grad_(False)
        # every parameter's name and global shape, before the rewrites shard them (checkpoints)
        self.global_shapes, self.first_stage = parameter_shapes(compiled)
        # cp, then ep and tp, then ZeRO, in place (backends/parallel: parallelize)
        self.layout, self.zero = parallelize(plan, topo, modules, device, compiled.experts,
                                             compiled.tp_rewrites,
                                             lambda ps: build_optimizer(ps, plan.train))
        # Only now does this rank's part get storage: its TP slices and its experts (under
        # ZeRO-3 its flat shard of them alone), each drawn by its module's init and sliced,
        # module by module (model.fill_stages).
        self.param_bytes = fill_stages(plan, modules.values(), device,
                                       self.zero.fill_targets() if self.zero else None)
        if self.zero is not None:  # the flat buffers hold every trainable parameter
            frozen = {id(p): p for m in modules.values() for p in m.parameters()
                      if not p.requires_grad}  # held whole beside them
            self.param_bytes = self.zero.param_bytes() + sum(
                p.numel() * p.element_size() for p in frozen.values())
        rules = tuple(r for r in plan.recompute if r.mode != "none")
        self.grad_bytes = None  # set at the first optimizer step (memory report)
        self.runners = {s: make_runner(plan, specs[s], m, s == last, scale, rules,
                                       self.autocast, device.type) for s, m in modules.items()}
        for s, runner in self.runners.items():
            if offsets[s] is not None:
                runner.draws = functools.partial(self._draws, offsets[s],
                                                 topo.coords.dp * schedule.microbatches)
        # Keep the specs without the other ranks' modules so their weights can be freed.
        self.specs = [dataclasses.replace(s, module=None) for s in specs]
        planned = plan_rank(schedule, self.specs, pp)
        tied = build_tied_groups(compiled.tied, self.runners, schedule.stage_to_rank, topo)
        around = None
        if self.zero is not None:
            self.sync = ZeroSync(self.zero, self.layout, tied)
            self.optimizer = self.zero.optimizer.optimizer
            if plan.zero == 3:  # gathered around each action, the next one's prefetched
                from ..parallel.zero.sharding import PrefetchWindow

                around = PrefetchWindow(self.zero, [p.action.stage for p in planned])
                for s in self.runners:
                    self.zero.release(s)
        else:
            order = _stage_order_by_last_grad(schedule.order[pp], list(self.runners))
            self.sync = GradSync(self.runners, self.layout, tied, order)
            self.optimizer = build_optimizer(self.sync.params, plan.train) if self.sync.params else None
        self.scheduler = build_lr_scheduler(self.optimizer, plan.train) if self.optimizer else None
        self.executor = Executor(planned, self.runners, self.specs,
                                 schedule.microbatches, topo.peer, device, self.sync.stage_done,
                                 around)
        self.holds_loss = last in self.runners and topo.coords.tp == 0
        self.eval_executor: Optional[Executor] = None  # train.eval's forward-only pass
        self.prepass = None  # experts.balance = step: the routing pre-pass (balance.py)
        if plan.experts is not None and plan.experts.balance == "step":
            from .balance import RoutingPrepass

            self.prepass = RoutingPrepass(planned, self.runners, self.specs, schedule.microbatches,
                                          topo.peer, device, topo.dp_group, plan.mesh.dp)
        self.diloco, self.island_group = None, None  # DiLoCo: the island (loss, checkpoints)
        if islands:
            from ..parallel.diloco.sync import build_diloco, island_groups

            self.island_group = island_groups(plan.mesh)[1]
            self.diloco = build_diloco(plan, self.runners, compiled.tied, topo)

    def _draws(self, offset: int, first_chunk: int, mb: int):
        return microbatch_draws(offset, self.plan.train.seed, self._draw_step, first_chunk + mb,
                                self.device, split=self.plan.mesh.tp > 1)

    def step(self, t: int) -> StepReport:
        """One optimizer step. The host waits on the device once for the loss (and once for
        the gradient norm when the plan clips). A rank whose weight gradients turned
        non-finite sends NaN in place of its loss, so every rank sees it in the one
        all-reduce: then (or when the norm or the loss is not finite) the step stops before
        the optimizer, naming where the first non-finite value appeared (`NonFiniteError`)."""
        start, cpu = time.perf_counter(), time.process_time()
        self._draw_step = t
        batches = data.dp_microbatches(self.plan, t, self.topo.coords.dp, self.topo.coords.cp)
        rng = _rng_state(self.device)  # a failed step is rerun from it (_rerun_checked)
        begun = time.time()
        with self.prepass.run(batches) if self.prepass else contextlib.nullcontext():
            ran = time.time()
            result = self.executor.run_step(batches)
        if self.prepass:  # the trace's lane of non-action intervals shows it
            result.spans.insert(0, Span("pre-pass", "routing pre-pass", begun, ran))
        spans = _Spans(result.spans)
        mine = result.loss if self.holds_loss else torch.zeros_like(result.loss)
        loss = torch.where(result.grads_non_finite(), math.nan, mine)
        summed = dist.all_reduce(loss, group=self.island_group, async_op=True)  # with the sync
        with spans("grad sync", "finish"):
            self.sync.finish()
        clip = self.plan.train.grad_clip
        norm = None
        if clip is not None:
            with spans("grad sync", "grad norm"):
                norm = self.sync.clip(clip)
        with spans("grad sync", "loss all-reduce"):
            summed.wait()
            loss_value = float(loss)
        if not (math.isfinite(loss_value) and (norm is None or math.isfinite(norm))):
            dist.all_reduce(mine, group=self.island_group)  # what the loss was, and the norm
            norm = self.sync.norm() if norm is None else norm
            result = self._rerun_checked(batches, rng)
            raise NonFiniteError(locate_non_finite(t, result, float(mine), norm))
        lr = self.plan.train.optimizer.lr
        if self.grad_bytes is None:  # measured once, for the run's memory report
            self.grad_bytes = held_bytes(self._grads())
        spans.begin("optimizer", "optimizer step")
        if self.optimizer is not None:
            lr = self.optimizer.param_groups[0]["lr"]
            if self.zero is not None:
                self.zero.step()
                self.zero.zero_grad()
            else:
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
            self.scheduler.step()
        spans.end()
        events = tuple(self.diloco.after_step(t)) if self.diloco is not None else ()
        return StepReport(t, loss_value, norm, lr, time.perf_counter() - start,
                          self.plan.train.global_batch * self.plan.data.seq_len,
                          tuple(result.timings), tuple(result.spans), events,
                          time.process_time() - cpu)

    def _grads(self):
        """Every gradient this rank holds: its stages' parameters' and its optimizer's."""
        groups = self.optimizer.param_groups if self.optimizer is not None else ()
        yield from (p.grad for runner in self.runners.values() for p in runner.params)
        yield from (p.grad for g in groups for p in g["params"])

    def optimizer_bytes(self) -> int:
        """Bytes of the optimizer's state (moments, steps) on this rank."""
        if self.optimizer is None:
            return 0
        return held_bytes(v for state in self.optimizer.state.values() for v in state.values()
                          if isinstance(v, torch.Tensor))

    def evaluate(self, count: int) -> float:
        """The held-out loss (`train.eval`): the mean over `count` held-out global batches of
        the loss as the step computes it, forward only, through this run's own stages and
        pipeline (the schedule's F actions in its order, no gradients kept). Collective:
        every rank calls it together."""
        if self.eval_executor is None:
            self.eval_executor = self._forward_only_executor()
        total = 0.0
        for k in range(count):
            batches = data.dp_eval_microbatches(self.plan, k, self.topo.coords.dp,
                                                self.topo.coords.cp)
            with self.prepass.run(batches) if self.prepass else contextlib.nullcontext(), \
                    torch.no_grad():
                result = self.eval_executor.run_step(batches)
            mine = result.loss if self.holds_loss else torch.zeros_like(result.loss)
            dist.all_reduce(mine, group=self.island_group)
            total += float(mine)
        return total / count

    def _forward_only_executor(self) -> Executor:
        """An executor of this rank's F actions alone, in the schedule's order (dropping the
        backward keeps each rank's receives in an order the verified schedule allows)."""
        forwards = [p for p in self.executor.planned if op_name(p.action) == "F"]
        around = None
        if self.zero is not None and self.plan.zero == 3:
            from ..parallel.zero.sharding import PrefetchWindow

            around = PrefetchWindow(self.zero, [p.action.stage for p in forwards])
        return Executor(forwards, self.runners, self.specs, self.plan.microbatches,
                        self.topo.peer, self.device, around_action=around)

    def _rerun_checked(self, batches, rng) -> StepResult:
        """The failed step once more with every action's values checked (executor
        `check_every_action`; every rank gets here together, as all saw the non-finite
        loss): from the same weights (no optimizer step ran), batches and random state it
        computes the same values, so the first non-finite one is named exactly, while the
        hot path only flags the loss and each stage's weight gradients at its last W/BW."""
        if self.zero is not None:
            self.zero.zero_grad()
        for runner in self.runners.values():
            for p in runner.params:
                p.grad = None
        _set_rng_state(rng, self.device)
        self.executor.check_every_action = True
        try:
            with self.prepass.run(batches) if self.prepass else contextlib.nullcontext():
                result = self.executor.run_step(batches)
            self.sync.finish()  # drain the collectives the rerun started
        finally:
            self.executor.check_every_action = False
        return result

    def resume(self, steps_done: int) -> None:
        """After restoring a checkpoint: the LR schedule continues where it stopped."""
        with warnings.catch_warnings():  # no optimizer step ran yet in this process: torch
            warnings.filterwarnings(  # warns, but replaying the schedule's steps is exact
                "ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
            for _ in range(steps_done if self.scheduler else 0):
                self.scheduler.step()

    def parameters_by_name(self) -> dict[str, torch.nn.Parameter]:
        """This rank's own parameters under every reference name they have here."""
        out: dict[str, torch.nn.Parameter] = {}
        for s in sorted(self.runners):
            for name, p in self.runners[s].module.named_parameters(remove_duplicate=False):
                out.setdefault(name, p)
        return out

    def named_buffers(self) -> dict[str, torch.Tensor]:
        """This rank's stages' buffers by their names in the unmodified model (running
        statistics and other state a forward writes live here; never sharded)."""
        out: dict[str, torch.Tensor] = {}
        for s in sorted(self.runners):
            for name, b in self.runners[s].module.named_buffers(remove_duplicate=False):
                out.setdefault(name, b)
        return out

    def named_parameters(self) -> dict[str, torch.Tensor]:
        """This rank's parameters at full shape by their names in the unmodified model.

        Collective over TP/EP/ZeRO-3 groups when those shard parameters.
        """
        if self.zero is not None and self.plan.zero == 3:
            for s in sorted(self.runners):
                self.zero.gather(s)
        try:
            return self.layout.full_parameters()
        finally:
            if self.zero is not None and self.plan.zero == 3:
                for s in sorted(self.runners):
                    self.zero.release(s)


def _rng_state(device: torch.device) -> tuple:
    """The random state a step starts from (dropout): the CPU generator's, and the device's."""
    return (torch.get_rng_state(),
            torch.cuda.get_rng_state(device) if device.type == "cuda" else None)


def _set_rng_state(state: tuple, device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)
