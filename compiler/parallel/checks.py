"""The runtime's refusals, run at compile time: `check_runnable(plan, model, stages)`.

Everything the runtime would refuse after its processes start is asked here,
once the model is loaded and its stage graphs are built, and refused as a
PlanError at the plan line. `pipeplan check` (after tracing), `pipeplan
compile`, and `pipeplan run` / `verify` (before spawning a process) all
compile, so all of them run these checks. Each check names the runtime code
whose refusal it moves forward:

* checkpoint values (backends/state/checkpoint/; whether a checkpoint loads under the plan is
  asked by `pipeplan run` before launch, backends/state/checkpoint/manifest.py);
* data files are checked by compiler/data.py (called after tracing, when the
  vocabulary is known, and by run/verify with the planned steps); the experts
  section's values by compiler/parallel/ep_checks.py;
* the per-stage rewrites' model checks (backends/parallel/__init__.py's
  `check_parallel_model`: tied weights split alike, sequence-parallel length,
  MoE layers the expert-parallel layer can shard);
* recompute rules whose region writes its own input in place
  (backends/runtime/recompute.py's check, run on the compiled stage graphs);
* parameters the captured forward never reads: no stage holds them, so no rank would
  train, keep or save them (verify calls such a run DIFFERENT: "parameters no rank holds");
* state the forward writes (a BatchNorm's running statistics, an Embedding's max_norm
  rows, part of the trained model): each data-parallel or context-parallel rank would
  update its own from its own share, and a recomputed forward would update them twice
  (verify compares them);
* sparse gradients (an Embedding with sparse=True): the reductions, clipping and
  optimizers take dense ones;
* random draws the keyed draws (backends/runtime/draws.py) cannot make as the
  single-process run does: under inductor, tensor parallelism's compiled graphs,
  context parallelism, expert parallelism's grouped reference, attention dropout
  on heads tp splits.
"""
from __future__ import annotations

from typing import Sequence

import torch.fx as fx
from torch import nn

from ...dsl.ast import Plan
from ...dsl.errors import Diagnostic, PlanError
from ...errors import PipeplanError
from ..compiled import StageSpec
from ..capture.analysis import SDPA
from ..recompute import check_no_inplace_on_inputs, draws_random, find_regions, \
    recompute_mode
from .cp import sdpa_arguments

def check_plan_values(plan: Plan) -> None:
    """The checks that need only the plan (run first: they are cheap)."""
    check_checkpointable(plan)


def check_checkpointable(plan: Plan) -> None:
    """Checkpoints (DCP) cover every plan's shards; only the values are checked here."""
    spec = plan.train.checkpoint
    if spec is None:
        return
    if spec.every < 1 or spec.keep < 1:
        raise PlanError.at(plan, "train.checkpoint", "checkpoint every and keep must be >= 1")


def check_runnable(plan: Plan, model: nn.Module, stages: Sequence[StageSpec],
                   state_writes: frozenset = frozenset(),
                   sparse_grads: frozenset = frozenset()) -> None:
    """Every runtime refusal that needs the model or the stage graphs. `state_writes`: the
    buffers and parameters the captured forward writes in place (MetaRun.state_writes);
    `sparse_grads`: the parameters it asks sparse gradients for (MetaRun.sparse_grads)."""
    if rewrites_stages(plan):
        check_parallel_model(plan, model)
    _check_every_parameter_read(plan, model, stages)
    rules = tuple(r for r in plan.recompute if r.mode != "none")
    if rules:
        _check_recompute(plan, rules, stages)
    if state_writes:
        _check_state_writes(plan, sorted(state_writes), rules)
    if sparse_grads:
        raise PlanError.at(
            plan, "model.source", f"the model asks sparse gradients for "
            f"{', '.join(sorted(sparse_grads))} (an Embedding with sparse=True): the runtime's "
            "gradient reductions, clipping and optimizers take dense gradients",
            "construct the Embedding with sparse=False (the default)")
    _check_random_draws(plan, stages)


def _check_every_parameter_read(plan: Plan, model: nn.Module, stages: Sequence[StageSpec]
                                ) -> None:
    """Refuse a model whose captured forward leaves parameters unread (at the plan's shapes:
    DeepseekV4's compressor reads its gate_proj only once a sequence fills its window): the
    stages hold only what the graph reads, so those would be lost from every checkpoint and
    export -- as DistributedDataParallel refuses unused parameters by default."""
    held = {id(p) for st in stages for p in st.module.parameters()}
    unread = [n for n, p in model.named_parameters() if id(p) not in held]
    if unread:
        shown = ", ".join(unread[:6]) + (f" and {len(unread) - 6} more" if len(unread) > 6 else "")
        raise PlanError.at(
            plan, "model.source", f"the model's forward (captured at this plan's input shapes) "
            f"never reads {len(unread)} of its parameters: {shown}; no stage would hold them, "
            "so they would be neither trained nor saved",
            "remove them from the model, or train on inputs the forward reads them for (e.g. "
            "a longer data.seq_len where a layer acts only on long sequences)")


def _check_state_writes(plan: Plan, written: list[str], rules) -> None:
    """Refuse what would leave the state the model's forward writes (running statistics, an
    Embedding's max_norm rows) other than single-process training leaves it: it updates it
    from every microbatch in turn; data- or context-parallel ranks would each update their
    own copy from their own share (torch's DDP keeps rank 0's buffers, and its replicas'
    parameters part), and a recomputed forward updates it a second time."""
    shown = ", ".join(written[:4]) + (f" and {len(written) - 4} more" if len(written) > 4
                                      else "")
    said = (f"the model's forward writes its own state in place ({shown}: buffers or "
            "parameters the trained model keeps)")
    for key, n, what in (("mesh.dp", plan.mesh.dp, "data-parallel"),
                         ("mesh.cp", plan.mesh.cp, "context-parallel")):
        if n > 1:
            raise PlanError.at(
                plan, key, f"{said}; each of the {n} {what} ranks would update its own copy "
                "from its own share of the batch, where single-process training updates them "
                "from every microbatch in turn",
                f"{key} = 1 (a pipeline keeps them as single-process training does), or a "
                "model whose forward keeps no state (e.g. BatchNorm(track_running_stats=False))")
    for name in written:
        owner = name.rpartition(".")[0]
        mode, module = recompute_mode(rules, owner)
        if mode != "none":
            raise PlanError.at(
                plan, "recompute", f"{said}; recompute ({mode}) of `{module}` would run its "
                f"forward twice per microbatch, updating `{name}` twice",
                f"leave `{module}` out of the recompute rules")


def rewrites_stages(plan: Plan) -> bool:
    """Whether the runtime rewrites stage modules (per-stage parallelism: backends/parallel)."""
    ex = plan.experts
    return (plan.mesh.tp > 1 or plan.zero > 0
            or (ex is not None and (plan.mesh.ep > 1 or not ex.dropless)))


def _check_recompute(plan: Plan, rules, stages: Sequence[StageSpec]) -> None:
    for st in stages:
        if not isinstance(st.module, fx.GraphModule):
            continue
        for region in find_regions(st.module.graph, rules):
            try:
                check_no_inplace_on_inputs(region)
            except PipeplanError as e:
                raise PlanError.at(plan, "recompute", str(e)) from None


def _random_nodes(stages: Sequence[StageSpec]):
    """The nodes of the stage graphs that draw random numbers (dropout with p > 0, an
    attention call with dropout_p > 0, any other random op), in order."""
    for st in stages:
        if not isinstance(st.module, fx.GraphModule):
            continue
        for n in st.module.graph.nodes:
            if draws_random(n) and _dropout_p(st.module, n) != 0:
                yield n
            elif n.op == "call_function" and n.target in SDPA:
                p = sdpa_arguments(n.args, n.kwargs)["dropout_p"]
                if isinstance(p, fx.Node) or p:
                    yield n


def _dropout_p(module: nn.Module, n: fx.Node):
    """A dropout node's probability when the graph fixes it (0 draws nothing: torch returns
    the input), else None (another random op, or a probability computed at run time)."""
    if n.op == "call_module":
        p = getattr(module.get_submodule(n.target), "p", None)
        return p if isinstance(p, (int, float)) else None
    if "dropout" not in str(n.target).lower():
        return None
    p = n.kwargs.get("p", n.args[1] if len(n.args) > 1 else None)
    train = n.kwargs.get("train", n.kwargs.get("training", n.args[2] if len(n.args) > 2
                                               else True))
    if train is False:
        return 0.0
    return p if isinstance(p, (int, float)) else None


def _check_random_draws(plan: Plan, stages: Sequence[StageSpec]) -> None:
    """Random ops draw keyed by (seed, step, chunk, k) (backends/runtime/draws.py), which
    reproduces the single-process draws only where a rank computes them on whole tensors of
    one microbatch, with the dispatcher seeing each draw."""
    drawing = list(_random_nodes(stages))
    if not drawing:
        return
    node = drawing[0]
    what = f"the model draws random numbers (`{node.name}`)"
    if plan.compile.mode == "inductor":
        raise PlanError.at(plan, "compile.mode", f"{what}, which inductor's kernels draw from "
                           "their own generator, not the keyed draws the reference makes",
                           "use compile.mode = graphs or eager, or set the model's dropout to 0")
    if plan.mesh.tp > 1 and plan.compile.graphs:
        raise PlanError.at(plan, "compile.mode", f"{what}, and tensor parallelism's compiled "
                           "graphs run on each rank's part of a value: its draws would not "
                           "be its part of the single-process draws",
                           "use compile.mode = eager for tensor parallelism, or set the "
                           "model's dropout to 0")
    if plan.mesh.cp > 1:
        raise PlanError.at(plan, "mesh.cp", f"{what}; each cp rank holds a slice of the "
                           "sequence and would draw its own numbers, not its part of the "
                           "single-process draws", "set the model's dropout to 0 for context "
                           "parallelism")
    if plan.experts is not None and (plan.mesh.ep > 1 or plan.experts.balance == "step"):
        key = "mesh.ep" if plan.mesh.ep > 1 else "experts.balance"
        raise PlanError.at(plan, key, f"{what}; the reference runs several microbatches as "
                           "one batch here (expert parallelism's statistics), so its draws "
                           "are not the microbatches' own", "set the model's dropout to 0")
    attention = [n for n in drawing if n.op == "call_function" and n.target in SDPA]
    if plan.mesh.tp > 1 and attention:  # (each one, not only the first draw: GPT-2's
        node = attention[0]  # embedding dropout comes before its attention's)
        raise PlanError.at(plan, "mesh.tp", f"attention `{node.name}` has dropout_p > 0 and "
                           "tensor parallelism splits its heads: a rank's kernel would draw "
                           "its own numbers, not its heads' part of the single-process draws",
                           "set the model's attention dropout to 0, or tp = 1")


def _parallel_problems(plan: Plan, model: nn.Module):
    tp = plan.mesh.tp
    seq = plan.data.seq_len // plan.mesh.cp  # context parallel: the slice a cp rank holds
    if plan.tensor.sequence_parallel and tp > 1 and seq % tp:
        held = f"{seq} positions each of the cp = {plan.mesh.cp} ranks holds" \
            if plan.mesh.cp > 1 else f"the sequence length {seq}"
        yield "tensor.sequence_parallel", (f"tp = {tp} does not divide {held} "
                                           f"(sequence parallel splits it)")
    # ep dividing dp or dp x tp: dsl/checks.py (dsl/layout.py: ep_fits), before any model


def check_parallel_model(plan: Plan, model: nn.Module) -> None:
    """Compile time, before any process group: can the rewrites split this model as planned?

    Raises one PlanError pointing at the plan lines of every problem found.
    """
    problems = list(_parallel_problems(plan, model))
    if problems:
        hint = "pick sizes that divide the model's dimensions, or change the plan"
        raise PlanError([Diagnostic(msg, plan.span_of(key), hint) for key, msg in problems],
                        plan.source_text or None, plan.sources)
