"""Runs one rank's scheduled action list for one optimizer step, exactly in order.

Sends are posted right after the action that produced the value, non-blocking
(`batch_isend_irecv`), and their handles are waited at the end of the step.
The receive an action needs is posted one action early and waited on
(blocking) right before the action: before the previous action's compute, so
the transfer runs while it computes -- except on NCCL when that action sends to
the same peer: there p2p to one peer is one FIFO stream, so a receive queued
before a send the peer is waiting for would deadlock, and the receive is posted
right after the send. Gloo matches each message by (peer, tag), so it posts
before the compute always: posted after a send to the same peer, a gloo receive
blocks the rank until gloo's thread has written that send (0.5-1 ms per action
on 2 shared cores, 10-18 ms a step of the vs_torch benchmark). Values between
two stages of this rank stay in memory. Receiving earlier only relaxes the
blocking semantics the schedule verifier proves deadlock-free (comm.py); the
values and the arithmetic are unchanged.

Receive buffers are reused across actions and steps (`RecvBuffers`): a buffer
is handed out again only once nothing but the pool refers to it (the
microbatch's graph that saved it is freed, no value passed on aliases it).

Nothing in the step synchronises with the host: the loss is summed on the
device, and each action leaves device-side flags (NaN in the values it sends,
non-finite gradients it produced, see `Flag`) that the trainer reads only when
the step's loss or gradient norm turned out non-finite (`first_non_finite`).
"""
from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Optional, Sequence

import torch
import torch.distributed as dist

from ...compiler.compiled import BATCH, StageSpec
from ...errors import PipeplanError
from .comm import Direction, PlannedAction, Transfer, carries_grad, op_name
from .data import Batch
from .stage import StageRunner, local_part


class ActionError(PipeplanError):
    """An action failed on this rank; the message names the action and the cause."""

    def __init__(self, label: str, cause: BaseException):
        self.label = label
        super().__init__(f"{label} failed: {type(cause).__name__}: {cause}")


@dataclass(frozen=True)
class ActionTiming:
    """Measured wall-clock times of one action (seconds since the epoch).

    [start, end] is its compute. Its slot [ready, done] is all the time the rank spends
    on it without being blocked on another rank: from the moment its input is there
    (`ready`, after `recv_wait` blocked on its receive) to the moment it is finished
    with it (`done`: its sends posted, the next receive posted, its checks left) --
    the unit the simulator charges (`slot`), so the bubble compares like with like."""

    op: str
    stage: int
    microbatch: int
    start: float
    end: float
    recv_wait: float  # time blocked on this action's receive, ending at `ready`
    ready: float = -1.0  # default: `start` (no runtime work recorded around the compute)
    done: float = -1.0  # default: `end`
    cpu: float = -1.0  # CPU seconds this rank's thread spent in the slot (time.thread_time;
    # on CPU with one thread per rank, its compute without the time it waited for a core);
    # -1: not measured

    def __post_init__(self):
        if self.ready < 0:
            object.__setattr__(self, "ready", self.start)
        if self.done < 0:
            object.__setattr__(self, "done", self.end)

    @property
    def slot(self) -> float:
        """Seconds the rank spent on this action, compute plus the runtime's work around it."""
        return self.done - self.ready


@dataclass(frozen=True)
class Span:
    """A measured interval outside an action's compute (the trace's other lanes): "send" (posting
    a send), "send wait" (the step's sends completing), "grad sync", "optimizer", ..."""

    kind: str
    name: str
    start: float
    end: float


@dataclass(frozen=True)
class Flag:
    """A device-side check left by one action, read only on the failure path."""

    label: str  # the action, as errors name it
    stage: int
    microbatch: int
    what: str  # "the loss", "activation", "input gradient", "weight gradients"
    names: tuple[str, ...]  # one name per element of `bad`
    bad: torch.Tensor  # bool [len(names)] on the device: True where non-finite
    end: float  # when the action ended (orders flags across ranks)


@dataclass
class StepResult:
    loss: torch.Tensor  # float64 on the device: sum of this rank's scaled last-stage losses
    timings: list[ActionTiming] = field(default_factory=list)
    flags: list[Flag] = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)  # sends, syncs (observe.py draws them)

    def grads_non_finite(self) -> torch.Tensor:
        """Whether any weight-gradient flag of the step is set (bool on the device, no sync)."""
        bad = [f.bad for f in self.flags if f.what == "weight gradients"]
        return torch.cat(bad).any() if bad else torch.zeros((), dtype=torch.bool,
                                                             device=self.loss.device)

    def first_non_finite(self) -> Optional[Flag]:
        """The first flagged action of the step on this rank (host sync: failure path only)."""
        for f in self.flags:
            if bool(f.bad.any()):
                return f
        return None


class RecvBuffers:
    """Receive buffers per (direction, boundary, position), reused once idle.

    A buffer is idle when only the pool refers to it: no Python reference (a
    value dict, a saved-for-backward list, a `.grad`) and no other tensor on its
    storage (the detached input autograd saved, a view passed on). So a buffer
    still part of a live graph is never overwritten, whatever the stage does.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self._pool: dict[tuple, list[torch.Tensor]] = {}

    def get(self, t: Transfer, position: int) -> torch.Tensor:
        v = t.values[position]
        pool = self._pool.setdefault((t.direction, t.boundary, position), [])
        for i in range(len(pool)):
            if _idle(pool, i):
                return pool[i]
        buf = torch.empty(v.shape, dtype=getattr(torch, v.dtype), device=self.device)
        pool.append(buf)
        return buf


def _idle(pool: list, i: int) -> bool:
    """Only the pool's list holds pool[i] (getrefcount counts its own argument too), and
    pool[i] is the only tensor on its storage (plus the storage object asked here)."""
    return sys.getrefcount(pool[i]) == 2 and \
        torch._C._storage_Use_Count(pool[i].untyped_storage()._cdata) == 2


def label(action) -> str:
    """How an action is named in errors: 'F s0 mb3' (F of stage 0, microbatch 3)."""
    return f"{op_name(action)} s{action.stage} mb{action.microbatch}"


def value_origin(module, name: str) -> str:
    """`name` (a traced value of the stage) with the model's module that computed it, from
    the trace's module stack (`add_2 (in module layers.0)`); the name alone when unknown."""
    graph = getattr(module, "graph", None)
    for node in getattr(graph, "nodes", ()):
        if node.name == name:
            stack = node.meta.get("nn_module_stack") or {}
            if stack:
                path = list(stack.values())[-1][0]
                return f"{name} (in module `{path}`)"
            break
    return name


class Executor:
    """Executes `planned` (this rank's action list) over its stage runners.

    `peer_rank(pp_rank)` maps a pipeline rank to the global rank to talk to;
    `on_stage_done(stage)` is called after the stage's last W/BW of the step
    (the data-parallel gradient sync hooks in there); `around_action(stage)`,
    when given, is a context manager entered around each compute (ZeRO-3
    gathers the stage's parameters there and frees them after). `prefetch=False`
    posts each receive only right before its action (for comparison).
    """

    def __init__(self, planned: Sequence[PlannedAction], runners: dict[int, StageRunner],
                 stages: Sequence[StageSpec], microbatches: int,
                 peer_rank: Callable[[int], int], device: torch.device = torch.device("cpu"),
                 on_stage_done: Optional[Callable[[int], None]] = None,
                 around_action: Optional[Callable[[int], ContextManager]] = None,
                 prefetch: bool = True):
        self.planned = list(planned)
        self.prefetch = prefetch  # False: each receive posted right before its action
        self.runners = runners
        self.stages = stages
        self.microbatches = microbatches
        self.peer_rank = peer_rank
        self.device = device
        self.on_stage_done = on_stage_done or (lambda stage: None)
        self.around_action = around_action or (lambda stage: contextlib.nullcontext())
        self.on_action = None  # called with each action's label before it runs (failure.Beacon)
        # False (the hot path): only the loss and, once per stage, its weight gradients after
        # its last W/BW are flagged -- enough to tell that the step went non-finite; True: every
        # action's values (the rerun of a failed step that names the first, nonfinite.py).
        self.check_every_action = False
        self.last_grad_action = _last_grad_actions(self.planned)
        self.buffers = RecvBuffers(device)
        # One FIFO stream per peer (NCCL): a receive from the peer just sent to goes after the send.
        self.fifo_p2p = dist.is_initialized() and dist.get_backend() != "gloo"

    # ------------------------------------------------------------------ p2p
    def _recv_ops(self, t: Transfer) -> tuple[list, list[torch.Tensor]]:
        bufs = [self.buffers.get(t, i) for i in range(len(t.values))]
        peer = self.peer_rank(t.peer)
        return [dist.P2POp(dist.irecv, b, peer, tag=t.tag(i, self.microbatches))
                for i, b in enumerate(bufs)], bufs

    def _send_ops(self, t: Transfer, values: dict[str, torch.Tensor]) -> tuple[list, list]:
        peer = self.peer_rank(t.peer)
        tensors = [values[v.name].detach().contiguous() for v in t.values]
        for v, x in zip(t.values, tensors):  # the receiver sized its buffer from the plan
            if tuple(x.shape) != tuple(v.shape) or str(x.dtype) != f"torch.{v.dtype}":
                raise PipeplanError(
                    f"{v.name} crossing stages {t.boundary}->{t.boundary + 1} is "
                    f"{str(x.dtype)[6:]}{list(x.shape)}, but the compiled plan says "
                    f"{v.dtype}{list(v.shape)} per microbatch")
        return [dist.P2POp(dist.isend, x, peer, tag=t.tag(i, self.microbatches))
                for i, x in enumerate(tensors)], tensors

    # ----------------------------------------------------------------- step
    def run_step(self, batches: Sequence[Batch]) -> StepResult:
        acts: dict[tuple[int, int], dict[str, torch.Tensor]] = {}  # (boundary, mb) -> outputs
        grads: dict[tuple[int, int], dict[str, torch.Tensor]] = {}  # (boundary, mb) -> grads
        pending_sends: list = []
        result = StepResult(loss=torch.zeros((), dtype=torch.float64, device=self.device))
        posted: dict[int, tuple[list, list]] = {}  # action index -> (recv works, buffers)
        for i, p in enumerate(self.planned):
            a = p.action
            if self.on_action is not None:
                self.on_action(label(a))
            wait_start = ready = time.time()
            cpu_ready = time.thread_time()
            if p.recv is not None:
                try:
                    works, bufs = posted.pop(i) if i in posted else self._post([p.recv])
                    for work in works:
                        work.wait()
                    ready, cpu_ready = time.time(), time.thread_time()
                except Exception as e:  # name what never came, and from whom
                    raise ActionError(f"{label(a)} (waiting for {_awaited(p.recv)} from pipeline "
                                      f"rank {p.recv.peer})", e) from e
                store = acts if p.recv.direction is Direction.ACTIVATION else grads
                store[(p.recv.boundary, p.recv.microbatch)] = dict(
                    zip((v.name for v in p.recv.values), bufs))
            nxt = self.planned[i + 1].recv if self.prefetch and i + 1 < len(self.planned) else None
            if nxt is not None and (p.send is None or p.send.peer != nxt.peer
                                    or not self.fifo_p2p):
                posted[i + 1] = self._post([nxt])  # in flight while this action computes
            try:
                start = time.time()
                with self.around_action(a.stage):
                    produced = self._run(a, batches, acts, grads, result)
                end = time.time()
                if p.send is not None:
                    ops, tensors = self._send_ops(p.send, produced)
                    pending_sends.extend((w, tensors) for w in dist.batch_isend_irecv(ops))
                    result.spans.append(Span("send", f"send {label(a)}", end, time.time()))
                    if nxt is not None and i + 1 not in posted:  # same peer: after the send
                        posted[i + 1] = self._post([nxt])
                    key = (p.send.boundary, p.send.microbatch)
                    (acts if p.send.direction is Direction.ACTIVATION else grads).pop(key, None)
            except ActionError:
                raise
            except Exception as e:  # name the action that broke
                raise ActionError(label(a), e) from e
            self._flag(a, produced, result, end)
            result.timings.append(ActionTiming(op_name(a), a.stage, a.microbatch, start, end,
                                               ready - wait_start, ready, time.time(),
                                               time.thread_time() - cpu_ready))
            if self.last_grad_action.get(a.stage) == (op_name(a), a.microbatch):
                t = time.time()
                self.on_stage_done(a.stage)
                result.spans.append(Span("grad sync", f"stage {a.stage} done", t, time.time()))
        t = time.time()
        for work, _ in pending_sends:
            work.wait()
        result.spans.append(Span("send wait", "sends complete", t, time.time()))
        for s, runner in self.runners.items():
            if runner.pending_microbatches:  # the verifier rules this out; never carry graphs over
                raise PipeplanError(f"the schedule left stage {s} microbatches "
                                    f"{runner.pending_microbatches} without their backward")
        return result

    def _post(self, transfers: Sequence[Transfer]) -> tuple[list, list[torch.Tensor]]:
        ops, bufs = [], []
        for t in transfers:
            o, b = self._recv_ops(t)
            ops += o
            bufs += b
        return dist.batch_isend_irecv(ops), bufs

    def _flag(self, a, produced: dict[str, torch.Tensor], result: StepResult, end: float) -> None:
        """Device-side checks of what the action produced (no host sync). The hot path: the
        loss, and a stage's weight-gradient norm after its last W/BW; `check_every_action`:
        also the values sent on, input gradients and each parameter's gradient, by name."""
        op, s, mb = op_name(a), a.stage, a.microbatch
        runner = self.runners[s]
        if op == "F" and runner.is_last:
            result.flags.append(Flag(label(a), s, mb, "the loss", ("loss",),
                                     ~torch.isfinite(runner.last_loss).reshape(1), end))
            return
        if not self.check_every_action:
            if runner.last_grad_norm is not None and op in ("W", "BW"):
                result.flags.append(Flag(label(a), s, mb, "weight gradients", ("",),
                                         ~torch.isfinite(runner.last_grad_norm).reshape(1), end))
            return
        floats = {k: v for k, v in produced.items() if v.is_floating_point()}
        if floats:  # activations may hold -inf (masks): only NaN is flagged there
            what = "activation" if op == "F" else "input gradient"
            check = torch.isnan if op == "F" else (lambda x: ~torch.isfinite(x))
            names = tuple(value_origin(runner.module, k) for k in floats)
            result.flags.append(Flag(label(a), s, mb, what, names,
                                     torch.stack([check(v).any() for v in floats.values()]), end))
        named = [(n, p.grad) for n, p in runner.module.named_parameters()
                 if p.grad is not None] if op in ("W", "BW") else []
        if named:
            result.flags.append(Flag(label(a), s, mb, "weight gradients",
                                     tuple(n for n, _ in named),
                                     torch.stack([~torch.isfinite(local_part(g)).all()
                                                  for _, g in named]), end))

    def _run(self, a, batches, acts, grads, result: StepResult) -> dict[str, torch.Tensor]:
        """Run one action; returns the values it produced (outputs or input gradients)."""
        op, s, mb = op_name(a), a.stage, a.microbatch
        runner = self.runners[s]
        spec = self.stages[s]
        if op == "F":
            upstream = acts.pop((s - 1, mb), {}) if s > 0 else {}
            inputs = [to_device(batches[mb].field(r.name), self.device) if r.source == BATCH
                      else upstream[r.name] for r in spec.inputs]
            outputs = runner.forward(mb, inputs)
            if runner.is_last:  # summed in float64 on the device, read once per step
                result.loss += runner.last_loss.double() * runner.loss_scale
                return {}
            produced = {v.name: o for v, o in zip(spec.outputs, outputs)}
            acts[(s, mb)] = produced
            return produced
        if op in ("W", "BW"):  # the hot path's norm (the checked rerun flags each weight)
            runner.check_grads = not self.check_every_action and \
                self.last_grad_action.get(s) == (op, mb)
        if op in ("B", "BW"):
            out_grads = None
            if not runner.is_last:
                received = grads.pop((s, mb), {})  # empty: no output carries a gradient
                out_grads = [received.get(v.name) if carries_grad(v) else None
                             for v in spec.outputs]
            if op == "B":
                by_name = runner.backward_input(mb, out_grads)
            else:
                by_name = runner.backward_full(mb, out_grads)
            if s == 0:
                return {}
            produced = {v.name: by_name[v.name] if v.name in by_name
                        else torch.zeros(v.shape, dtype=getattr(torch, v.dtype), device=self.device)
                        for v in self.stages[s - 1].outputs if carries_grad(v)}
            grads[(s - 1, mb)] = produced
            return produced
        if op == "W":
            runner.backward_weight(mb)
            return {}
        raise ValueError(f"unknown op {op!r}")


def _awaited(t: Transfer) -> str:
    if t.direction is Direction.ACTIVATION:
        return f"the outputs of F s{t.boundary} mb{t.microbatch}"
    return f"the input gradients of stage {t.boundary + 1} mb{t.microbatch}"


def _last_grad_actions(planned: Sequence[PlannedAction]) -> dict[int, tuple[str, int]]:
    """For each stage, the (op, microbatch) of its last weight-gradient action (W or BW)."""
    last: dict[int, tuple[str, int]] = {}
    for p in planned:
        op = op_name(p.action)
        if op in ("W", "BW"):
            last[p.action.stage] = (op, p.action.microbatch)
    return last


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A batch field (built on the host) on the rank's device without a host synchronisation:
    a plain copy from pageable memory makes torch wait for the CUDA stream, once per
    microbatch; staged through pinned memory it is asynchronous (the pinned block is kept
    until the copy ran by torch's caching host allocator). CPU: the tensor itself."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
