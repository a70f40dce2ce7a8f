"""The typed plan: what a plan file means, after parsing and semantic checks.

Every later phase (compiler, schedules, backends) reads these frozen
dataclasses, never raw text or dicts. Source positions are kept apart from the
values in `Plan.spans` (dotted key -> Span) so two plans that say the same
thing compare equal wherever their text sits, and any later phase can still
point an error at the plan line through `Plan.span_of`.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping, Optional, Sequence, Union

# A constructor/optimizer argument value as written in the plan.
Scalar = Union[int, float, str, bool, None]
Value = Union[Scalar, tuple]  # tuples hold Values (lists in the plan)


@dataclass(frozen=True)
class Span:
    """Where a node sits in its source file (1-based line and column)."""

    file: str
    line: int
    col: int
    end_line: int
    end_col: int

    @staticmethod
    def unknown(file: str = "<plan>") -> "Span":
        return Span(file, 1, 1, 1, 1)


def _frozen_map(d: Optional[Mapping] = None) -> Mapping:
    return MappingProxyType(dict(d or {}))


# --------------------------------------------------------------------- model
@dataclass(frozen=True)
class InputSpec:
    """One example input of the model: shape dims are ints or symbolic names.

    Symbolic dims: "batch" (the microbatch size) and "seq" (data.seq_len).
    """

    name: str
    dtype: str  # torch dtype name: "int64", "float32", ...
    shape: tuple[Union[int, str], ...]


@dataclass(frozen=True)
class ModelSpec:
    # "path/to/file.py:Class" (relative to the plan file), "pkg.mod:Class", or a Hugging Face
    # model folder (config.json; `save_pretrained`): built from its config, random init
    source: str
    args: Mapping[str, Value] = field(default_factory=_frozen_map)
    inputs: tuple[InputSpec, ...] = (InputSpec("input_ids", "int64", ("batch", "seq")),)
    capture: str = "auto"  # auto | fx | export
    leaf_modules: tuple[str, ...] = ()  # module-path patterns traced as leaves
    loss: str = "cross_entropy"  # cross_entropy | mse | model (the model returns its loss)
    # initial weights from a safetensors file or a Hugging Face `save_pretrained` folder
    # (relative to the plan file); None: the model's own per-module init (backends/state/weights.py)
    weights: Optional[str] = None


# ---------------------------------------------------------------------- data
@dataclass(frozen=True)
class DataSpec:
    kind: str = "synthetic"  # synthetic | file | text
    seq_len: int = 128
    seed: int = 0  # synthetic only
    vocab: int = 256  # synthetic only
    path: Optional[str] = None  # file only: .bin (uint16 tokens) or .npy, memory-mapped
    # file only: read past the file's end from its start again (else a file too short
    # for the run is refused by `pipeplan check`)
    wrap: bool = False
    # text only (compiler/text.py): documents in .txt/.md (split by a blank line), .jsonl,
    # .parquet or save_to_disk folders, tokenised by `tokenizer` into a cached token file
    files: tuple[str, ...] = ()
    tokenizer: Optional[str] = None  # a save_pretrained folder or a tokenizer.json
    field: str = "text"  # the JSONL field / Parquet or dataset column holding the text
    eos: Optional[str] = None  # the token after each document (default: the tokenizer's)
    holdout: float = 0.0  # share of documents held out (train.eval reads them)
    shuffle: bool = True  # windows in a seeded order (train.seed), another each epoch
    cache: str = ".pipeplan-cache"  # where the token files go (relative to the plan)
    # (model input, data field) pairs: which field of the data each model input reads
    # (fields: tokens positions mask targets, see backends/runtime/data.py); a model input not
    # named here reads `tokens` if it is the first, and is an error otherwise
    inputs: tuple[tuple[str, str], ...] = ()

    def feeds(self, names: "Sequence[str]") -> tuple[tuple[str, Optional[str]], ...]:
        """(model input, data field or None when unbound) for the model's input `names`."""
        given = dict(self.inputs)
        return tuple((n, given.get(n, "tokens" if i == 0 else None)) for i, n in enumerate(names))


# ---------------------------------------------------------------------- mesh
@dataclass(frozen=True)
class MeshSpec:
    """Named device-mesh axes; pp outermost, then dp, cp, tp innermost. ep re-divides dp
    (adds no ranks). cp (context parallel) splits every sequence over cp ranks.

    `islands` is not a plan key: `Plan` sets it from `sync` (DiLoCo makes each dp replica
    an island, so no group but dp's may cross them: EP then re-divides each island's tp
    ranks, dsl/layout.py)."""

    pp: int = 1
    dp: int = 1
    tp: int = 1
    ep: int = 1
    cp: int = 1
    islands: bool = False

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp


# ------------------------------------------------------------------- context
@dataclass(frozen=True)
class ContextSpec:
    """Context parallelism over mesh.cp: how attention sees the whole sequence.

    ulysses: one all-to-all before each attention op (sequence shards -> head shards)
    and one after (back). ring: each rank keeps its queries and K/V blocks pass around
    the cp ring (backends/parallel/cp/ring.py); the sequence is laid out in 2*cp chunks."""

    method: str = "ulysses"  # ulysses | ring


# ------------------------------------------------------------------ pipeline
@dataclass(frozen=True)
class LayerRange:
    """`layers[0:6]`: modules prefix.0 .. prefix.5 (stop exclusive)."""

    prefix: str
    start: int
    stop: int


@dataclass(frozen=True)
class SplitSpec:
    kind: str = "auto"  # auto | points | ranges
    basis: str = "flops"  # auto only: flops | params | profile
    points: tuple[str, ...] = ()  # points: module names where stages 1..S-1 begin
    ranges: tuple[LayerRange, ...] = ()  # ranges: one per stage


@dataclass(frozen=True)
class MemoryLimit:
    """Activation memory per rank: in microbatches of the rank's layers, or bytes."""

    amount: float
    in_bytes: bool = False


@dataclass(frozen=True)
class PipelineSpec:
    schedule: str = "1f1b"  # gpipe 1f1b interleaved zbh1 zbh2 zbv vhalf vmin dualpipev auto
    microbatches: Optional[int] = None  # count ...
    microbatch_size: Optional[int] = None  # ... or size (exactly one is set after checks)
    virtual: int = 1  # stages per rank
    split: SplitSpec = field(default_factory=SplitSpec)
    memory_limit: Optional[MemoryLimit] = None
    profile: Optional[str] = None  # a cost file from `pipeplan profile` (relative to the plan)
    costs: Optional[tuple[tuple[float, float, float], ...]] = None  # relative [F, B, W] per stage


# ------------------------------------------------------------------- experts
@dataclass(frozen=True)
class ExpertsSpec:
    modules: tuple[str, ...]  # module-path patterns of the MoE layers, e.g. "blocks.*.moe"
    num_experts: int
    top_k: int = 2
    dropless: bool = True
    capacity_factor: Optional[float] = None  # only when dropless is false
    drop_policy: str = "probs"  # probs | position
    aux_loss: float = 0.0  # load-balancing loss coefficient
    z_loss: float = 0.0  # router z-loss coefficient
    dispatcher: str = "alltoall"  # alltoall | allgather
    shared_experts: int = 0
    # the model's load-balancing statistics over: one microbatch of one dp rank (the model's
    # own call) | the whole step (all microbatches and dp/ep ranks; compiler/parallel/ep_balance.py)
    balance: str = "microbatch"


# -------------------------------------------------------------------- tensor
@dataclass(frozen=True)
class TensorSpec:
    column: tuple[str, ...] = ()  # module-path patterns made column-parallel
    row: tuple[str, ...] = ()  # ... row-parallel
    vocab: tuple[str, ...] = ()  # ... vocab-parallel (embedding, LM head)
    sequence_parallel: bool = False
    # "model": the Hugging Face model's own plan (tp_plan / config.base_model_tp_plan);
    # "auto": Megatron's column/row pairs found in the captured graph (tp_auto.py);
    # "patterns": the lists above only; None: the lists, else the model's own
    plan: Optional[str] = None


# ------------------------------------------------------------------- compile
COMPILE_MODES = ("eager", "graphs", "inductor")


@dataclass(frozen=True)
class CompileSpec:
    """How each stage runs (docs/compiler.md, "Compiled stages"). eager: the stage graph op
    by op under autograd. graphs: its joint forward+backward graph, partitioned into F, B,
    W and BW graphs called with explicit saved values (no autograd tape). inductor: those
    graphs compiled by torch's inductor (cached on disk)."""

    mode: str = "eager"  # eager | graphs | inductor

    @property
    def graphs(self) -> bool:
        return self.mode != "eager"


@dataclass(frozen=True)
class RecomputeRule:
    pattern: str
    mode: str  # none | full | selective


# --------------------------------------------------------------------- train
@dataclass(frozen=True)
class OptimizerSpec:
    name: str = "adamw"  # adamw | sgd
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    momentum: float = 0.0  # sgd only


@dataclass(frozen=True)
class LRScheduleSpec:
    kind: str = "constant"  # constant | cosine
    warmup: int = 0  # steps of linear warm-up
    min_lr: float = 0.0  # cosine floor


@dataclass(frozen=True)
class CheckpointSpec:
    every: int
    dir: str
    keep: int = 2


@dataclass(frozen=True)
class EvalSpec:
    """`train { eval { every = N  batches = K } }`: after every N-th step, K global batches of
    held-out windows, forward only, through the run's own pipeline."""

    every: int
    batches: int = 1


@dataclass(frozen=True)
class TrainSpec:
    steps: int = 10
    global_batch: int = 8  # sequences per optimizer step, over all dp ranks
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    lr_schedule: LRScheduleSpec = field(default_factory=LRScheduleSpec)
    grad_clip: Optional[float] = None  # max global L2 norm
    precision: str = "fp32"  # fp32 | bf16 | fp64
    seed: int = 0
    checkpoint: Optional[CheckpointSpec] = None
    log_dir: Optional[str] = None
    eval: Optional["EvalSpec"] = None  # held-out loss every N steps (needs data holdout)
    log: tuple[str, ...] = ("jsonl",)  # trackers: jsonl tensorboard wandb (observe/trackers.py)


# ---------------------------------------------------------------------- sync
@dataclass(frozen=True)
class OuterOptimizerSpec:
    """DiLoCo's outer optimizer on the pseudo-gradients: SGD, Nesterov or heavy-ball."""

    name: str = "nesterov"  # nesterov | sgd
    lr: float = 0.7
    momentum: float = 0.9


@dataclass(frozen=True)
class SyncSpec:
    """How data-parallel replicas agree (backends/parallel/diloco/sync.py): every step (gradient all-reduce)
    or DiLoCo (each dp replica, an island, takes `inner_steps` optimizer steps alone, then the
    islands average their pseudo-gradients and an outer optimizer applies them)."""

    mode: str = "every_step"  # every_step | diloco
    inner_steps: int = 1  # H
    outer_optimizer: OuterOptimizerSpec = field(default_factory=OuterOptimizerSpec)
    fragments: int = 1  # streaming DiLoCo: K stage fragments synchronised at staggered steps
    decoupled: bool = False  # a sync goes on with the islands present within `timeout`
    timeout: float = 30.0  # seconds (decoupled only)

    @property
    def diloco(self) -> bool:
        return self.mode == "diloco"


# -------------------------------------------------------------------- device
@dataclass(frozen=True)
class DeviceSpec:
    """The device the compiler's time model costs ops on: a built-in profile by name
    (compiler/estimate/devices.py: a100, a100-40gb, h100, h200, b200), each key written here
    overriding the profile's value (None: the profile's). No name and no key: this machine's
    measured CPU without CUDA, else h100. MFU is an output of the model, not a key."""

    name: Optional[str] = None  # a built-in profile
    flops: Optional[float] = None  # peak dense FLOP/s per device in the compute precision
    memory_bandwidth: Optional[float] = None  # bytes/s of device memory
    intra_node: Optional[float] = None  # bytes/s per device inside a node, one direction
    inter_node: Optional[float] = None  # bytes/s per device between nodes, one direction
    latency: Optional[float] = None  # seconds per point-to-point message
    # ranks sharing a node (global ranks numbered node by node); None: the profile's
    ranks_per_node: Optional[int] = None


# ---------------------------------------------------------------------- plan
@dataclass(frozen=True)
class Plan:
    model: ModelSpec
    data: DataSpec = field(default_factory=DataSpec)
    mesh: MeshSpec = field(default_factory=MeshSpec)
    pipeline: PipelineSpec = field(default_factory=PipelineSpec)
    experts: Optional[ExpertsSpec] = None
    context: Optional[ContextSpec] = None
    tensor: TensorSpec = field(default_factory=TensorSpec)
    compile: CompileSpec = field(default_factory=CompileSpec)
    zero: int = 0
    sync: SyncSpec = field(default_factory=SyncSpec)
    recompute: tuple[RecomputeRule, ...] = ()
    train: TrainSpec = field(default_factory=TrainSpec)
    device: DeviceSpec = field(default_factory=DeviceSpec)
    # Where the plan came from; relative model/data paths resolve against its folder.
    path: str = field(default="<plan>", compare=False)
    # Dotted key ("pipeline.microbatches", "model.args.dim", "pipeline") -> Span.
    spans: Mapping[str, Span] = field(default_factory=_frozen_map, compare=False, repr=False)
    source_text: str = field(default="", compare=False, repr=False)
    # Text of every source a span may point into: the plan file and each `--set` override.
    sources: Mapping[str, str] = field(default_factory=_frozen_map, compare=False, repr=False)

    def __post_init__(self) -> None:
        # the mesh knows whether its dp replicas are DiLoCo islands (the rank layout of EP
        # depends on it, dsl/layout.py), whichever way the plan was built or replaced
        if self.mesh.islands != self.sync.diloco:
            object.__setattr__(self, "mesh", dataclasses.replace(self.mesh,
                                                                 islands=self.sync.diloco))

    def resolve_path(self, path: str, key: Optional[str] = None) -> str:
        """A path the plan gives at `key` (model.source, model.weights, data.path,
        pipeline.profile, train.checkpoint.dir, train.log_dir), absolute. One rule, the
        shell's: a relative path is relative to where it was written. Written in the plan
        file: its folder, so a plan means the same from any directory. Given on the command
        line (`--set KEY=...`, like --trace or -o): the working directory. A plan without a
        file: the working directory."""
        if os.path.isabs(path):
            return path
        typed = key is not None and self.span_of(key).file.startswith("<--set")
        base = os.path.dirname(os.path.abspath(self.path)) \
            if self.path not in ("", "<plan>") and not typed else os.getcwd()
        return os.path.normpath(os.path.join(base, path))

    def with_resolved_paths(self) -> "Plan":
        """This plan with checkpoint.dir and log_dir absolute (what the runtime writes to)."""
        import dataclasses

        t = self.train
        ckpt = t.checkpoint and dataclasses.replace(
            t.checkpoint, dir=self.resolve_path(t.checkpoint.dir, "train.checkpoint.dir"))
        log_dir = t.log_dir and self.resolve_path(t.log_dir, "train.log_dir")
        return dataclasses.replace(self, train=dataclasses.replace(t, checkpoint=ckpt,
                                                                   log_dir=log_dir))

    def span_of(self, key: str) -> Span:
        """The span of `key`, else of its nearest enclosing section, else the file start."""
        parts = key.split(".")
        while parts:
            k = ".".join(parts)
            if k in self.spans:
                return self.spans[k]
            parts.pop()
        return Span.unknown(self.path)

    @property
    def microbatches(self) -> int:
        """Microbatches per DP rank per step (resolved from count or size)."""
        if self.pipeline.microbatches is not None:
            return self.pipeline.microbatches
        per_dp = self.train.global_batch // self.mesh.dp
        return per_dp // (self.pipeline.microbatch_size or per_dp)

    @property
    def microbatch_size(self) -> int:
        return self.train.global_batch // (self.mesh.dp * self.microbatches)
