"""Pipelined run vs single-process reference: the largest loss and parameter differences.

`pipeplan verify` and the equivalence tests both judge with this. Every
reference parameter must be found on some rank (a run that silently dropped
a parameter is not equal), and every rank's copy is compared (DP replicas,
tied copies on two pipeline ranks).

One exception is explained, not hidden: a parameter whose exact gradient is
zero (the attention key bias: softmax ignores a constant added to every key)
has a gradient of pure rounding noise, ~1e-11 where others are ~1e-3. Adam
divides each element by its own running RMS, so that noise becomes full
lr-sized steps whose sign depends on the order of float additions, which
differs between any two correct implementations. With an Adam-type
optimizer such parameters (`noise_params`) are reported apart and held to
the bound lr x steps instead of rtol/atol.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import torch

NOISE_RATIO = 1e-6  # a gradient this far below the largest one is float32 rounding noise


@dataclass(frozen=True)
class Comparison:
    max_loss_diff: float
    max_param_diff: float
    worst_param: str  # where max_param_diff occurs ("" when there are no parameters)
    missing: tuple[str, ...]  # reference parameters no rank holds
    within: bool  # every loss and parameter within |a - b| <= atol + rtol * |b|, none missing
    noise: tuple[str, ...] = ()  # zero-gradient parameters judged by the noise bound instead
    noise_diff: float = 0.0  # their largest difference

    def render(self, rtol: float, atol: float) -> str:
        lines = [f"max |loss - reference loss|      = {self.max_loss_diff:.3e}",
                 f"max |param - reference param|    = {self.max_param_diff:.3e}"
                 + (f"  ({self.worst_param})" if self.worst_param else "")]
        if self.noise:
            lines.append(
                f"{len(self.noise)} parameters have a zero exact gradient (rounding noise only, "
                f"e.g. {self.noise[0]}); Adam turns that noise into lr-sized steps, so they are "
                f"held to |diff| <= lr x steps instead (largest {self.noise_diff:.3e})")
        if self.missing:
            lines.append(f"parameters no rank holds: {', '.join(self.missing)}")
        verdict = "EQUAL" if self.within else "DIFFERENT"
        lines.append(f"{verdict} to single-process training within rtol={rtol:g}, atol={atol:g}")
        return "\n".join(lines)


def noise_level(grad_max: Mapping[str, float]) -> set[str]:
    """Parameters whose largest gradient element stays at rounding-noise level."""
    top = max(grad_max.values(), default=0.0)
    return {n for n, g in grad_max.items() if g <= NOISE_RATIO * top}


def _close(a: torch.Tensor, b: torch.Tensor, rtol: float, atol: float) -> bool:
    return a.shape == b.shape and bool(torch.all((a - b).abs() <= atol + rtol * b.abs()))


def compare(ref_losses: Sequence[float], ref_params: Mapping[str, torch.Tensor],
            losses_per_rank: Sequence[Sequence[float]],
            params_per_rank: Sequence[Mapping[str, torch.Tensor]],
            rtol: float = 1e-5, atol: float = 1e-6, noise_params: frozenset = frozenset(),
            noise_bound: Optional[float] = None) -> Comparison:
    """`noise_params` (with `noise_bound` = lr x steps): see the module docstring."""
    ref_l = torch.tensor(list(ref_losses), dtype=torch.float64)
    within = True
    max_loss = 0.0
    for losses in losses_per_rank:
        got = torch.tensor(list(losses), dtype=torch.float64)
        if got.shape != ref_l.shape:
            within, max_loss = False, float("inf")
            continue
        max_loss = max(max_loss, float((got - ref_l).abs().max()) if len(got) else 0.0)
        within &= _close(got, ref_l, rtol, atol)
    max_param, worst, noise_diff = 0.0, "", 0.0
    held, noisy = set(), set()
    for params in params_per_rank:
        for name, p in params.items():
            ref = ref_params.get(name)
            if ref is None:
                within = False
                continue
            held.add(name)
            if p.shape != ref.shape:
                within, max_param, worst = False, float("inf"), name
                continue
            diff = float((p.double() - ref.double()).abs().max()) if p.numel() else 0.0
            if diff > max_param:
                max_param, worst = diff, name
            if _close(p.double(), ref.double(), rtol, atol):
                continue
            if name in noise_params and noise_bound is not None and diff <= noise_bound:
                noisy.add(name)
                noise_diff = max(noise_diff, diff)
                continue
            within = False
    missing = tuple(sorted(set(ref_params) - held))
    return Comparison(max_loss, max_param, worst, missing, within and not missing,
                      tuple(sorted(noisy)), noise_diff)
