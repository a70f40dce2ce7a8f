"""`pipeplan verify`: the pipelined run and the single-process reference, judged.

Host side (`verify_plan`): both sides run the plan at the judge's precision
(fp64 unless `--precision fp32`; given to the ranks as the override
`train.precision=...`, so they compile and train exactly as `pipeplan run`
would at that precision), then `compare.py` judges losses, step-1 gradients
and final parameters with the rule of that precision and prints it.

Rank side (`FirstStepGrads`, `dump_rank`): each rank saves its losses, its
gradients of step 1 as its optimizer sees them (after DP/tied sync and
clipping, before the update) and its final parameters, all at full shape
under the reference's names (gathered over TP/EP/ZeRO shards the same way
parameters are).
"""
from __future__ import annotations

import dataclasses
import os
import tempfile
from typing import Optional

import torch
import torch.distributed as dist

from ...dsl.ast import Plan
from ...errors import PipeplanError

JUDGE_PRECISIONS = ("fp64", "fp32")


class FirstStepGrads:
    """Records this rank's step-1 gradients at the optimizer's pre-step hook. Under ZeRO the
    optimizer sees only each rank's owned slice (the only one clipped; at stage >= 2 the
    only one there), so the slices are all-gathered over the shard's group (collective)."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.by_param: dict[int, torch.Tensor] = {}
        self._handle = (trainer.optimizer.register_step_pre_hook(self._hook)
                        if trainer.optimizer is not None else None)

    def _hook(self, optimizer, args, kwargs) -> None:
        self._handle.remove()
        for p in self.trainer.parameters_by_name().values():
            if p.grad is not None:
                self.by_param[id(p)] = p.grad.detach().clone()
        zero = self.trainer.zero
        for fs in (zero.optimizer.shards if zero is not None else ()):
            if fs.stage < 1 or fs.shard.grad is None:
                continue  # stage >= 1: only the owned slice is clipped and stepped
            flat = fs.shard.grad.detach()
            if fs.world > 1:
                full = flat.new_empty(fs.layout.padded)
                dist.all_gather_single(full, flat.contiguous(), group=fs.group)
                flat = full
            for p, off, shape in zip(fs.params, fs.layout.offsets, fs.layout.shapes):
                self.by_param[id(p)] = flat[off:off + p.numel()].view(shape).clone()

    def full(self) -> dict[str, torch.Tensor]:
        """The recorded gradients at full shape by reference name (collective like the
        trainer's `named_parameters`: the parameters' own gather, run on the gradients)."""
        params = list({id(p): p for p in self.trainer.parameters_by_name().values()}.values())
        saved = [p.data for p in params]
        try:
            for p in params:
                grad = self.by_param.get(id(p))
                p.data = grad if grad is not None else torch.zeros_like(p.data)
            return self.trainer.named_parameters()
        finally:
            for p, data in zip(params, saved):
                p.data = data


def rank_result(losses, trainer, grads: Optional[FirstStepGrads]) -> dict:
    """Collective: what this rank hands the judge (losses, step-1 gradients, parameters),
    on CPU at full shape by reference names."""
    full_grads = grads.full() if grads is not None else {}
    params = trainer.named_parameters()
    return {"losses": list(losses), "grads": {k: v.cpu() for k, v in full_grads.items()},
            "params": {k: v.cpu() for k, v in params.items()},
            "buffers": {k: v.detach().cpu().clone() for k, v in trainer.named_buffers().items()}}


def dump_rank(path: str, rank: int, losses, trainer, grads: Optional[FirstStepGrads]) -> None:
    torch.save(dict(rank_result(losses, trainer, grads), rank=rank),
               os.path.join(path, f"rank{rank}.pt"))


def judge(ref, results, precision: str = "fp64", plan: Optional[Plan] = None):
    """The verdict (compare.Comparison) on every rank's `rank_result` against the reference
    (reference.ReferenceResult), by the rule of `precision`; in fp64, where that fails on
    parameters alone, by `fp64-adam-bound` (compare.py: the optimizer's reach over float64
    rounding); where it still fails and the model of `plan` computes parts of itself in
    float32 (reference.float_islands, found in its captured graph), by the float32 rule those
    nodes set (compare.py, `fp32-island`)."""
    from .reference import float_islands
    from .compare import FP64, compare

    rule = FP64 if precision == "fp64" else ref.fp32_rule()
    with_grads = bool(ref.grads)

    def by(rule):
        return compare(ref.losses, ref.params, [r["losses"] for r in results],
                       [r["params"] for r in results], rule=rule, aliases=ref.aliases,
                       ref_grads=ref.grads if with_grads else None,
                       grads_per_rank=[r["grads"] for r in results] if with_grads else None,
                       ref_buffers=ref.buffers,
                       buffers_per_rank=[r.get("buffers", {}) for r in results])

    verdict = by(rule)
    if rule is FP64 and not verdict.within and not verdict.missing:
        adam = by(ref.fp64_rule())  # losses and gradients still judged by fp64
        if adam.within:
            return adam
        islands = float_islands(plan) if plan is not None else []
        if islands:  # the model's own float32 nodes set the bound
            return by(ref.island_rule(islands))
    return verdict


def judged_plan(plan: Plan, precision: str) -> Plan:
    """The plan both sides run: at the judge's precision."""
    return dataclasses.replace(plan, train=dataclasses.replace(plan.train, precision=precision))


def verify_plan(plan: Plan, steps: int, precision: str, launch) -> int:
    """Run `launch(dump_dir)` (the pipelined ranks, at `precision`), the reference, judge and
    print; 0 when EQUAL, 1 when DIFFERENT, the launcher's code when a rank failed. A DiLoCo
    plan is judged island by island against its own reference (verify/diloco.py)."""
    with tempfile.TemporaryDirectory(prefix="pipeplan-verify-") as dump:
        code = launch(dump)
        if code:
            return code
        dumps = [torch.load(os.path.join(dump, f), weights_only=True)
                 for f in sorted(os.listdir(dump)) if f.endswith(".pt")]
    judged = judged_plan(plan, precision)
    if plan.sync.diloco:
        print(f"pipeplan: island-by-island DiLoCo reference, {steps} steps ({precision})",
              flush=True)
        from .diloco import judge_islands
        refs = reference_like_the_ranks(judged, steps, "islands")
        verdicts = judge_islands(judged, refs, dumps)
        for d, (ref, verdict) in enumerate(zip(refs, verdicts)):
            print(f"island {d}:")
            _print_losses(ref, _first_of_island(judged, dumps, d))
            print(verdict.render())
        return 0 if all(v.within for v in verdicts) else 1
    print(f"pipeplan: single-process reference, {steps} steps ({precision})", flush=True)
    ref = reference_like_the_ranks(judged, steps)
    result = judge(ref, dumps, precision, judged)
    for note in ref.notes:
        print(f"pipeplan: {note}", flush=True)
    _print_losses(ref, dumps[0])
    print(result.render())
    return 0 if result.within else 1


def _first_of_island(plan: Plan, dumps: list, island: int) -> dict:
    from ...dsl.layout import mesh_layout

    ranks = {c.rank for c in mesh_layout(plan.mesh) if c.dp == island}
    return next(r for r in dumps if r["rank"] in ranks)


def _print_losses(ref, dump: dict) -> None:
    for step, (r, p) in enumerate(zip(ref.losses, dump["losses"])):
        print(f"step {step + 1}: loss {p:.10f}  reference {r:.10f}  diff {abs(p - r):.2e}")


def reference_like_the_ranks(plan: Plan, steps: int, kind: str = "reference"):
    """`train_reference` (kind "islands": DiLoCo's `train_islands`) under the PYTHONHASHSEED
    the launcher gives the ranks (runtime/launcher.hash_seed): here when this process
    already runs under it, else in a fresh process forked from a server started with it
    (a process cannot change its own hash seed; runtime/forkserver.py)."""
    from ..runtime import forkserver
    from ..runtime.launcher import HASH_SEED_ENV, hash_seed

    want = hash_seed(plan.train.seed)
    if os.environ.get(HASH_SEED_ENV) == want:
        return _REFERENCES[kind]()(plan, steps)
    from multiprocessing.reduction import ForkingPickler
    from types import MappingProxyType

    from ...dsl.ast import _frozen_map

    # the plan's frozen mappings travel as what they wrap
    ForkingPickler.register(MappingProxyType, lambda m: (_frozen_map, (dict(m),)))
    with tempfile.TemporaryDirectory(prefix="pipeplan-reference-") as out, \
            forkserver.serving(want):
        path = os.path.join(out, "reference.pt")
        child = forkserver.start(_reference_child,
                                 (plan, steps, path, kind, torch.get_num_threads()),
                                 dict(os.environ, **{HASH_SEED_ENV: want}))
        child.join()
        if child.exitcode != 0 or not os.path.exists(path):
            said = open(path + ".err").read() if os.path.exists(path + ".err") else \
                f"exit code {child.exitcode}"
            raise PipeplanError(f"the single-process reference failed: {said}")
        return torch.load(path, weights_only=False)


def _reference_child(plan: Plan, steps: int, path: str, kind: str, threads: int) -> None:
    torch.set_num_threads(threads)  # as this process's own (the server's is the ranks')
    try:
        torch.save(_REFERENCES[kind]()(plan, steps), path)
    except Exception as e:  # said by the parent, as one line
        with open(path + ".err", "w") as f:
            f.write(f"{type(e).__name__}: {e}")


def _train_reference():
    from .reference import train_reference
    return train_reference


def _train_islands():
    from .diloco import train_islands
    return train_islands


_REFERENCES = {"reference": _train_reference, "islands": _train_islands}
