"""CompiledPlan: what the compiler hands the runtime (and writes to a build directory).

The contract between compiler/ and backends/:

* `stages[k].module` is a torch.fx.GraphModule whose parameters and buffers
  keep the unmodified model's qualified names (its state_dict keys are a subset
  of the model's). Its forward takes the values named by `stages[k].inputs`
  positionally, in that order, and returns a tuple of the values named by
  `stages[k].outputs`, in that order.
* An input comes either from the batch (`ValueRef.source == BATCH`, field name
  e.g. "input_ids" or "targets"), read locally by whichever rank runs the stage,
  or from an earlier stage's output (`source == producer stage index`). Values
  used by a later non-adjacent stage are forwarded through the stages between
  (each stage's inputs come from the batch or from stage k-1 only).
* The last stage returns exactly one output, "loss": the scalar loss of one
  microbatch (mean over its tokens, MoE aux losses added), unscaled. The
  runtime scales it by 1 / (microbatches * dp).
* Parameters tied across stages (same Parameter object in the model, e.g. the
  embedding and the LM head) are listed in `tied`; the runtime sums their
  gradients between the holding ranks every step.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

from ..dsl.ast import Plan

BATCH = "batch"  # ValueRef.source of a batch field; node.meta[BATCH] on its stage placeholder
CONSTANT = "pipeplan_constant"  # node.meta: a get_attr of a tensor export lifted from the forward


@dataclass(frozen=True)
class ValueSpec:
    """A value crossing a stage boundary, per microbatch."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype name, e.g. "float32"
    requires_grad: bool = True  # False: no gradient flows back for it (ids, masks, positions)


@dataclass(frozen=True)
class ValueRef:
    name: str  # the value's name (an fx node name, or a batch field)
    source: Union[str, int]  # BATCH, or the producing stage's index
    requires_grad: bool = True  # a received value a gradient flows back to (not RoPE tables)


@dataclass
class StageSpec:
    index: int
    rank: int  # pipeline rank (pp coordinate) that runs this stage
    inputs: tuple[ValueRef, ...]
    outputs: tuple[ValueSpec, ...]
    param_names: tuple[str, ...]  # original qualified names held by this stage
    buffer_names: tuple[str, ...] = ()
    module_names: tuple[str, ...] = ()  # top-level blocks in this stage, in order
    code: str = ""  # readable generated Python of the stage's forward
    module: Any = None  # torch.fx.GraphModule (not serialised)
    flops: float = 0.0  # forward FLOPs per microbatch
    activation_bytes: int = 0  # bytes saved for backward per microbatch
    recompute_flops: float = 0.0  # forward FLOPs rerun in backward per microbatch (recompute)
    ops: int = 0  # aten ops the forward dispatches per microbatch (host time per op)
    recompute_ops: int = 0  # ... rerun in backward per microbatch
    cp_bytes: int = 0  # context parallel: bytes a rank's all-to-alls / ring hops send per microbatch (F+B)
    cp_calls: int = 0  # ... its all-to-alls / ring sends per microbatch (F+B)
    cp_steps: tuple = (0, 0)  # ... the message latencies it waits per microbatch (F, B)
    made: int = 0  # values its forward makes from no input or parameter (masks, positions)
    # that meet ones that are: eager tp wraps each per microbatch (parallel/tp.graph_made)
    joint: Any = None  # compile.mode = graphs: the stage's joint graph (compiler/graphs/joint.py; not serialised)
    # compile.mode = graphs under tp / ep / cp, the stage rewritten in a fake world: the
    # collectives its own graph issues per microbatch, {op: (calls, bytes)} (DTensor's own)
    traced_collectives: Any = None
    # under tp, the stage's run at check (compiler/parallel/tp_dry_run.py): "" when its
    # forward and backward ran through, else where it stopped unjudged; None: not run
    tp_run: Optional[str] = None


@dataclass(frozen=True)
class TiedParam:
    """One parameter held by several stages (by possibly different names)."""

    names: tuple[str, ...]  # e.g. ("tok_emb.weight", "lm_head.weight")
    stages: tuple[int, ...]  # stage index holding each name, same order


@dataclass(frozen=True)
class ExpertPlacement:
    """For one MoE layer: the global expert indices each EP rank holds."""

    module: str  # qualified module name, e.g. "layers.0.moe"
    shards: tuple[tuple[int, ...], ...]  # shards[ep_rank] = expert indices
    # the experts module expert parallelism shards (qualified, e.g. "layers.0.moe.experts");
    # None: the layer offers none and runs whole (compiler/parallel/ep.py)
    experts: Optional[str] = None


@dataclass
class RankEstimate:
    """Bytes and FLOPs for one global rank per optimizer step."""

    rank: int
    param_bytes: int = 0
    grad_bytes: int = 0
    optimizer_bytes: int = 0
    activation_bytes: int = 0
    flops: float = 0.0
    comm_bytes: dict = field(default_factory=dict)  # {"p2p": n, "dp": n, "tp": n, "ep": n}
    # Bytes handed to each collective per step, {(group, op): n} as backends' CommMeter
    # counts them (group: "dp", "edp" (experts' data parallel), "tp", "ep"; op: "allreduce",
    # "allgather", "reduce_scatter", "alltoall"); comm_bytes above are what travels.
    collectives: dict = field(default_factory=dict)
    # How many calls of each tp / ep collective per step (the same keys' calls).
    collective_calls: dict = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        """What the rank holds at its peak: parameters, gradients, optimizer states and the
        activations the schedule keeps."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.activation_bytes


@dataclass
class Estimates:
    ranks: list[RankEstimate]
    bubble: float  # whole-iteration: 1 - sum busy / (ranks * makespan)
    step_time_s: float
    device_model: dict  # DeviceModel as a dict: peak flops_per_s, links, latency, hardware
    simulation: Any = field(default=None, repr=False)  # schedules.SimResult, times in seconds
    sync: Any = None  # sync_estimate.SyncEstimate under DiLoCo (dp bytes per step are averaged)
    # Per stage, the tp / ep collectives its rewrite implies per step on each of its ranks:
    # {(group, op): (calls, bytes handed in)} (estimates.stage_collectives).
    stage_collectives: list = field(default_factory=list)
    # Per stage, the same as the stage's rewrite issued them when `check` ran it (the tp dry
    # run or the compiled graphs' trace: StageSpec.traced_collectives, over a step, with
    # sequence parallel's once-a-step gradient sums as above); None where it did not run
    issued_collectives: list = field(default_factory=list)
    prepass_s: float = 0.0  # experts.balance = step: the routing pre-pass, in step_time_s
    # estimate/predict.py: the step per pipeline rank (compute / exposed comm / bubble /
    # optimizer), predicted MFU and TFLOP/s per GPU (None when a cost file times the plan)
    prediction: Any = None

    @property
    def peak_bytes(self) -> int:
        """The most any rank holds (RankEstimate.total_bytes)."""
        return max(r.total_bytes for r in self.ranks)
    timing: Any = field(default=None, repr=False)  # predict.Timing: re-time on any device
    # per pipeline rank, (stage, bytes, holders) of each tied gradient it sums with the other
    # pipeline ranks holding it (estimates.tied_sums)
    tied: list = field(default_factory=list)


@dataclass
class CompiledPlan:
    plan: Plan
    stages: list[StageSpec]
    schedule: Any  # pipeplan.schedules.Schedule
    tied: tuple[TiedParam, ...] = ()
    experts: tuple[ExpertPlacement, ...] = ()
    tp_rewrites: dict = field(default_factory=dict)  # qualified module -> "column"|"row"|"vocab"
    # tensor.plan = auto: the Linears left whole as tp could not keep them split -> why
    tp_whole: dict = field(default_factory=dict)
    capture: str = "fx"  # how the graph was captured, and why when auto
    gradless: tuple[str, ...] = ()  # parameters read only through detach: trained frozen
    capture_reason: str = ""
    split_text: str = ""  # the chosen split in plan syntax, to pin it
    split_points: tuple[str, ...] = ()  # the same: module names where stages 1..S-1 begin
    estimates: Optional[Estimates] = None

    def stages_of_rank(self, pp_rank: int) -> list[StageSpec]:
        return [s for s in self.stages if s.rank == pp_rank]
