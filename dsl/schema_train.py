"""The plan's schema, training half: the train section (optimizer, LR schedule,
checkpoint) and the data-parallel `sync` mode (every step or DiLoCo).

Declared with the same Section/Field machinery as dsl/schema.py, which puts
these pieces into the plan.
"""
from __future__ import annotations

from typing import Mapping

from . import ast as A
from .fields import CallShape, Emit, Field, Reading, Section, read_call, write_call
from .limits import MAX_RANKS, MAX_SEED, MAX_STEPS, MAX_BATCH
from .syntax import Items, Node
from .values import (Invalid, boolean, choice, duration, integer, number, shown, text, write_duration, write_string)


# ---------------------------------------------------------------- train
def _betas(node: Node, key: str) -> tuple[float, float]:
    if not isinstance(node, Items) or len(node.items) != 2:
        raise Invalid(f"{key} must be a list of two numbers, {shown(node)}", "e.g. betas = [0.9, 0.95]")
    read = number(lo=0, hi=1)
    b1, b2 = (read(i, key) for i in node.items)
    if b1 >= 1 or b2 >= 1:
        raise Invalid(f"{key} must be below 1, got [{b1:g}, {b2:g}]")
    return (b1, b2)


_LR, _WD = Field("lr", number(above=0)), Field("weight_decay", number(lo=0))
_OPTIMIZERS = {
    "adamw": CallShape(Section("adamw()", A.OptimizerSpec, (
        _LR, Field("betas", _betas), Field("eps", number(above=0)), _WD), noun="argument")),
    "sgd": CallShape(Section("sgd()", A.OptimizerSpec, (
        _LR, Field("momentum", number(lo=0)), _WD), noun="argument")),
}


def named_call(shapes: Mapping[str, CallShape], cls: type):
    """Reader and writer of a key whose value is one of `shapes`' calls, read into `cls`
    with the function's name in its `name` field (optimizers)."""
    def read(r: Reading, node: Node, key: str):
        name, values = read_call(r, node, key, shapes)
        return cls(name=name, **values)

    def write(obj, key: str, emit: Emit) -> str:
        return write_call(obj.name, obj, shapes[obj.name].section, key, emit)

    return read, write


_optimizer, _write_optimizer = named_call(_OPTIMIZERS, A.OptimizerSpec)


_LR_SCHEDULES = {
    "constant": CallShape(Section("constant()", A.LRScheduleSpec, (
        Field("warmup", integer(0, MAX_STEPS)),), noun="argument")),
    "cosine": CallShape(Section("cosine()", A.LRScheduleSpec, (
        Field("warmup", integer(0, MAX_STEPS)), Field("min_lr", number(lo=0))), noun="argument")),
}


def _lr_schedule(r: Reading, node: Node, key: str) -> A.LRScheduleSpec:
    name, values = read_call(r, node, key, _LR_SCHEDULES)
    return A.LRScheduleSpec(kind=name, **values)


def _write_lr_schedule(s: A.LRScheduleSpec, key: str, emit: Emit) -> str:
    return write_call(s.kind, s, _LR_SCHEDULES[s.kind].section, key, emit)


CHECKPOINT = Section("checkpoint", A.CheckpointSpec, (
    Field("every", integer(1, MAX_STEPS)),
    Field("dir", text, write_string),
    Field("keep", integer(1, MAX_STEPS)),
))

EVAL = Section("eval", A.EvalSpec, (
    Field("every", integer(1, MAX_STEPS)),
    Field("batches", integer(1, MAX_STEPS)),
))
# tracker -> (the module it needs, the pip extra installing it); backends/observe/trackers.py
TRACKERS = {"jsonl": (None, None), "tensorboard": ("tensorboard", "tensorboard"),
            "wandb": ("wandb", "wandb")}


def _trackers(node: Node, key: str) -> tuple[str, ...]:
    """`log = [jsonl, tensorboard]` (one name is a one-item list; [] logs nothing)."""
    items = node.items if isinstance(node, Items) else (node,)
    read, out = choice(*TRACKERS), []
    for item in items:
        try:
            name = read(item, "tracker")
        except Invalid as e:
            raise Invalid(e.message, e.hint, item.span) from None
        if name in out:
            raise Invalid(f"tracker {name} is named twice", "keep one", item.span)
        out.append(name)
    return tuple(out)


def _write_trackers(names: tuple[str, ...]) -> str:
    return "[" + ", ".join(names) + "]"


TRAIN = Section("train", A.TrainSpec, (
    Field("steps", integer(1, MAX_STEPS)),
    Field("global_batch", integer(1, MAX_BATCH)),
    Field("optimizer", _optimizer, _write_optimizer, nested=True),
    Field("lr_schedule", _lr_schedule, _write_lr_schedule, nested=True),
    Field("grad_clip", number(above=0)),
    Field("precision", choice("fp32", "bf16", "fp64")),
    Field("seed", integer(0, MAX_SEED)),
    Field("checkpoint", section=CHECKPOINT),
    Field("log_dir", text, write_string),
    Field("eval", section=EVAL),
    Field("log", _trackers, _write_trackers),
))

# ----------------------------------------------------------------- sync
_OUTER_ARGS = (Field("lr", number(above=0)), Field("momentum", number(lo=0, hi=1)))
_OUTER = {name: CallShape(Section(f"{name}()", A.OuterOptimizerSpec, _OUTER_ARGS,
                                  noun="argument")) for name in ("nesterov", "sgd")}

_outer, _write_outer = named_call(_OUTER, A.OuterOptimizerSpec)


_SYNC = {
    "every_step": CallShape(Section("every_step()", A.SyncSpec, (), noun="argument")),
    "diloco": CallShape(Section("diloco()", A.SyncSpec, (
        Field("inner_steps", integer(1, MAX_STEPS)),
        Field("outer_optimizer", _outer, _write_outer, nested=True),
        Field("fragments", integer(1, MAX_RANKS)),
        Field("decoupled", boolean),
        Field("timeout", duration, write_duration),
    ), noun="argument")),
}


def read_sync(r: Reading, node: Node, key: str) -> A.SyncSpec:
    name, values = read_call(r, node, key, _SYNC)
    return A.SyncSpec(mode=name, **values)


def write_sync(sync: A.SyncSpec, key: str, emit: Emit) -> str:
    return sync.mode if sync.mode == "every_step" else \
        write_call(sync.mode, sync, _SYNC[sync.mode].section, key, emit)
