"""One pipeline stage on this rank: forward, split backward (B then W) and full backward.

Per microbatch the stage keeps the autograd graph from F until the backward
that finishes with it: BW (both gradients at once), or B then W.

* B computes the gradients of the stage's inputs only (what the previous stage
  waits for) with `retain_graph=True`, so the graph stays for W.
* W computes the weight gradients and accumulates them into `.grad`, then
  frees the graph.

W does not redo B's work: B saves the gradient entering each node where a
weight's branch leaves the input path, and W starts from there
(split_backward.py; the analysis is cached per stage). Where that split could
count a weight twice (a weight used twice in one stage, one use below the
other) W walks the retained graph again from the outputs instead: exact, only
slower. Weight gradients go into `.grad` the way autograd accumulates them
(the first taken, later ones added in place), without a copy.

The forward runs under the plan's autocast (bf16) when given, with its random
draws keyed by microbatch (draws.py), and through a `StageProgram` when
recompute rules match some of the stage's modules (recompute.py): B keeps what
it recomputed for W, W and BW consume it.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, ContextManager, Optional, Sequence

import torch
import torch.fx as fx

from ...compiler.compiled import StageSpec
from ...dsl.ast import RecomputeRule
from . import split_backward
from .recompute import Phase, SavedBytes, StageProgram
from .split_backward import SplitCache, SplitPlan


def is_float_dtype(dtype_name: str) -> bool:
    return getattr(torch, dtype_name).is_floating_point


@dataclass
class _Saved:
    """What one microbatch's F leaves for its backward."""

    inputs: list[torch.Tensor]  # inputs that receive a gradient (from the previous stage)
    input_names: list[str]  # their value names
    outputs: tuple[torch.Tensor, ...]  # the stage outputs (the scaled loss on the last stage)
    roots: Optional[list[torch.Tensor]] = None  # set by B: outputs a gradient flows from ...
    root_grads: Optional[list[torch.Tensor]] = None  # ... and those gradients, for W
    split: Optional[SplitPlan] = None  # what B saved for W (None: W walks the whole graph)


class StageRunner:
    """Executes F / B / W / BW of one stage for any microbatch."""

    def __init__(self, spec: StageSpec, module: torch.nn.Module, is_last: bool,
                 loss_scale: float = 1.0, split_weights: bool = True,
                 recompute: Sequence[RecomputeRule] = (),
                 autocast: Callable[[], ContextManager] = contextlib.nullcontext):
        self.spec = spec
        self.autocast = autocast
        self.phase = Phase()
        self.program: Optional[StageProgram] = None
        if recompute and isinstance(module, fx.GraphModule):
            program = StageProgram(module, recompute, autocast, self.phase)
            if program.regions:  # the module's own hooks (sequence parallel's) still run
                self.program = module.forward = program
        self.saved_bytes: Optional[dict[int, int]] = None  # measure_saved(): mb -> bytes
        self.split_weights = split_weights  # W reuses B's work (split_backward.py)
        self.module = module
        self.is_last = is_last
        self.loss_scale = loss_scale
        self.params = [p for p in module.parameters() if p.requires_grad]
        self._split = SplitCache(self.params)
        # Positions of the inputs fed by the previous stage (their gradients go back).
        self.upstream_inputs = [i for i, ref in enumerate(spec.inputs) if ref.source != "batch"]
        # ... of those, the ones a gradient flows back to (a received RoPE table: none)
        self.grad_inputs = {i for i in self.upstream_inputs if spec.inputs[i].requires_grad}
        self._saved: dict[int, _Saved] = {}
        # Device-side values the executor's non-finite flags read (never synced per action):
        self.last_loss: Optional[torch.Tensor] = None  # the last F's unscaled loss (last stage)
        self.last_grad_norm: Optional[torch.Tensor] = None  # L2 norm of weight grads, last W/BW
        self.check_grads = True  # whether the next W/BW takes that norm (set by the executor)
        # a microbatch's keyed random draws (draws.py; set by the trainer): mb -> context
        self.draws: Callable[[int], ContextManager] = lambda mb: contextlib.nullcontext()

    # ---------------------------------------------------------------- forward
    def forward(self, mb: int, inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Run the stage; inputs are positional, in `spec.inputs` order."""
        grad_inputs, names, prepared = [], [], []
        for i, x in enumerate(inputs):
            if i in self.upstream_inputs and x.is_floating_point():
                x = x.detach()
                if i in self.grad_inputs:
                    x.requires_grad_(True)
                    grad_inputs.append(x)
                    names.append(self.spec.inputs[i].name)
            prepared.append(x)
        meter = SavedBytes(self.params) if self.saved_bytes is not None else None
        if self.program is not None:
            self.program.meter = meter
        with self.autocast(), meter.hooks() if meter else contextlib.nullcontext(), \
                self.draws(mb):
            outputs = self.module(*prepared)
        if meter is not None:
            self.saved_bytes[mb] = meter.bytes
        if not isinstance(outputs, (tuple, list)):
            outputs = (outputs,)
        outputs = tuple(outputs)
        if self.is_last:
            self.last_loss = outputs[0].detach()
        if not torch.is_grad_enabled():  # a no-grad forward (balance.py): no backward follows
            return outputs
        saved = (outputs[0] * self.loss_scale,) if self.is_last else outputs
        self._saved[mb] = _Saved(grad_inputs, names, saved)
        return outputs

    # --------------------------------------------------------------- backward
    def _roots(self, saved: _Saved, out_grads) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The outputs to differentiate and their incoming gradients (None: no gradient)."""
        if self.is_last:
            return [saved.outputs[0]], [torch.ones_like(saved.outputs[0])]
        if out_grads is None:
            raise RuntimeError(f"stage {self.spec.index}'s backward got no output gradients")
        pairs = [(o, g) for o, g in zip(saved.outputs, out_grads)
                 if g is not None and o.requires_grad]
        return [o for o, _ in pairs], [g for _, g in pairs]

    @staticmethod
    def _input_grads(saved: _Saved, grads: Sequence[Optional[torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Gradient of each float upstream input by value name, zeros where autograd found no path."""
        return {name: torch.zeros_like(x) if g is None else g
                for name, x, g in zip(saved.input_names, saved.inputs, grads)}

    def backward_input(self, mb: int, out_grads=None) -> dict[str, torch.Tensor]:
        """B: gradients of the float upstream inputs; the graph is kept for W."""
        saved = self._saved[mb]
        self.phase.final = False  # W still needs what a recompute produces now
        saved.roots, saved.root_grads = self._roots(saved, out_grads)
        if not saved.roots:
            return self._input_grads(saved, [None] * len(saved.inputs))
        if not saved.inputs:  # no gradient to send back: W runs the whole backward, in
            return {}  # one call (what a split would plan here: its roots, all off B's path)
        if self.split_weights and self.params:
            saved.split = self._split.plan(saved.roots, saved.inputs)
        if saved.split is not None:
            grads = split_backward.backward_input(saved.split, saved.roots, saved.root_grads,
                                                  saved.inputs)
        else:
            grads = torch.autograd.grad(saved.roots, saved.inputs, saved.root_grads,
                                        retain_graph=True, allow_unused=True)
        return self._input_grads(saved, grads)

    def backward_weight(self, mb: int) -> None:
        """W: weight gradients, accumulated into `.grad`; frees the microbatch's graph."""
        saved = self._saved.pop(mb)
        self.phase.final = True
        self.last_grad_norm = None
        if saved.roots is None:
            raise RuntimeError(f"W(stage {self.spec.index}, mb {mb}) ran before its B")
        if not saved.roots or not self.params:
            return
        if saved.split is not None and not split_backward.disjoint(saved.split):
            by_id = split_backward.backward_weight(saved.split, saved.roots, saved.root_grads)
            self._accumulate([by_id.get(id(p)) for p in self.params], saved.root_grads)
            self._grads_done()
            return
        if saved.split is not None:  # each weight from one place: autograd adds it to .grad
            split_backward.accumulate_weight(saved.split, saved.roots, saved.root_grads)
        else:  # autograd adds each weight's gradient into .grad as it is produced
            torch.autograd.backward(saved.roots, saved.root_grads, inputs=self.params)
        self._grads_done()

    def backward_full(self, mb: int, out_grads=None) -> dict[str, torch.Tensor]:
        """BW: input and weight gradients in one pass; frees the microbatch's graph."""
        saved = self._saved.pop(mb)
        self.phase.final = True
        self.last_grad_norm = None
        roots, root_grads = self._roots(saved, out_grads)
        if not roots:
            return self._input_grads(saved, [None] * len(saved.inputs))
        if not saved.inputs and not self.params:
            return {}
        # Into .grad as each is produced (the inputs are this microbatch's own leaves): never
        # a second copy of the stage's weight gradients alive at once.
        torch.autograd.backward(roots, root_grads, inputs=saved.inputs + self.params)
        self._grads_done()
        return self._input_grads(saved, [x.grad for x in saved.inputs])

    def _grads_done(self) -> None:
        """The non-finite flag after a backward that accumulated into .grad, when the executor
        asks for it (`check_grads`: the stage's last W/BW of the step): once a .grad is NaN
        or infinite it stays so, so one check at the end sees every microbatch's. An L2 norm (non-finite also when its
        squares overflow, as the global norm's would): torch's max-norm is ~20x slower on
        CPU. It reads every gradient of the stage (~0.6 ms per 4 GPT layers of dim 128 on
        this CPU), which is why it is not taken after every action."""
        if not self.check_grads:
            self.last_grad_norm = None
            return
        local = [local_part(p.grad) for p in self.params if p.grad is not None]
        self.last_grad_norm = (torch.nn.utils.get_total_norm(local, 2.0)
                              if local else None)

    def _accumulate(self, grads: Sequence[Optional[torch.Tensor]],
                    others: Sequence[Optional[torch.Tensor]] = ()) -> None:
        """Add one microbatch's weight gradients into `.grad` (a weight reached from several
        seeds: their sum, as `backward_weight` formed it, is added). A first gradient is taken
        as `.grad` without a copy (so a stage never holds its gradients twice) unless its
        storage is shared with another gradient or with `others` (incoming or input
        gradients that are sent on): later microbatches add into `.grad` in place."""
        taken = {_storage(t) for t in others if t is not None}
        for p, g in zip(self.params, grads):
            if g is None:
                continue
            if p.grad is None:
                g = g.detach()
                key = _storage(g)
                p.grad = g if key not in taken and g._base is None else g.clone()
                taken.add(key)
            else:
                p.grad.add_(g)

    def measure_saved(self) -> None:
        """From now on record, per microbatch, the bytes its forward keeps for backward."""
        self.saved_bytes = {}

    @property
    def pending_microbatches(self) -> list[int]:
        return sorted(self._saved)


def local_part(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (TP-sharded gradients); a plain tensor as it is."""
    return t if type(t) is torch.Tensor or not hasattr(t, "to_local") else t.to_local()


def _storage(t: torch.Tensor) -> int:
    return local_part(t).untyped_storage().data_ptr()
