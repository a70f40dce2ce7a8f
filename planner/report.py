"""What `pipeplan plan` prints and writes: the top-K table, "not considered", the plan file.

The plan file is dsl/format.py's canonical text of the candidate's plan with every key
written (`full=True`), under a comment block saying what was searched and why this
candidate won, so `pipeplan check` reads back exactly the choices and the device model
the search used.
"""
from __future__ import annotations

import re

from ..dsl.ast import Plan
from ..dsl.format import format_plan
from .cost import Prediction
from .search import ZERO_TIE, Ranked, SearchResult
from .space import Candidate, plan_of

GIB = 2 ** 30


def tflops(p: Prediction) -> float:
    """Executed TFLOP/s per GPU (recompute included, as Narayanan et al. count them)."""
    return p.flops_per_gpu / p.step_time_s / 1e12


def utilisation(p: Prediction, peak: float) -> float:
    """Model FLOPs (forward + backward, no recompute) per GPU per second over the peak."""
    return p.model_flops_per_gpu / p.step_time_s / peak


def table(result: SearchResult, peak_flops: float) -> str:
    head = (f"{'#':>3}  {'layout':<58} {'step s':>10} {'TFLOP/s':>8} {'MFU':>5} "
            f"{'peak GiB':>9} {'bubble':>7} {'comm s':>9}")
    rows = [head]
    for i, r in enumerate(result.top, 1):
        p = r.prediction
        rows.append(f"{i:>3}  {r.candidate.label():<58} {p.step_time_s:>10.4g} "
                    f"{tflops(p):>8.3g} {utilisation(p, peak_flops):>5.2f} {p.peak_bytes / GIB:>9.2f} "
                    f"{p.bubble:>7.3f} {p.comm_s:>9.3g}")
    return "\n".join(rows) + "\n"


def summary(result: SearchResult) -> str:
    closed = ("the bound closed: no unevaluated candidate can enter the top "
              f"{max(len(result.top), 1)}" if result.closed else
              f"auto was evaluated {result.auto_evaluated} times (--max-auto) and auto "
              "candidates remained under the bound: a faster auto plan may exist"
              if result.auto_capped else
              "the evaluation budget (--max-evals) ran out before the bound closed: a "
              "faster plan may exist")
    return (f"searched {result.enumerated} candidates on {result.gpus} GPUs: "
            f"{result.over_memory} over {result.capacity / GIB:.1f} GiB by their memory bound, "
            f"{result.pruned} skipped by the bound with the optimizer and DP reduction, "
            f"{result.evaluated} evaluated (schedule generated and simulated; "
            f"{result.auto_evaluated} of them auto), "
            f"{result.over_memory_evaluated} of those over memory"
            + (f", {result.twins} the same order as a listed plan under another kind "
               "(listed once)" if result.twins else "")
            + (f", {result.zero_ties} a listed plan's layout at another ZeRO stage predicted "
               f"within {ZERO_TIE:.0%} (listed once: the faster, or as fast the one holding "
               "less memory)"
               if result.zero_ties else "")
            + f"; {closed}; "
            f"model captured {result.units.captures} times\n")


def not_considered(result: SearchResult) -> str:
    if not result.not_considered:
        return ""
    lines = ["not considered:"]
    for reason, values in result.not_considered.items():
        shown = ", ".join(values[:8]) + (f", ... ({len(values)} in all)" if len(values) > 8
                                         else "")
        lines.append(f"  {reason}: {shown}")
    return "\n".join(lines) + "\n"


def plan_text(base: Plan, result: SearchResult, pick: int, command: str,
              peak_flops: float, device_section: bool = True) -> str:
    """The picked candidate (0-based) as a plan file with its comment block. Without
    `device_section` (the search timed this machine's measured CPU model), the plan has none,
    so `pipeplan check` measures the same way."""
    chosen: Ranked = result.top[pick]
    c, p = chosen.candidate, chosen.prediction
    plan = plan_of(base, c, result.units.blocks)
    lines = [f"# Written by `{command}`.",
             "# Searched: mesh (pp, dp, tp within a node, cp, ep where the model has experts),",
             "# schedule kind and stages per rank, microbatch size and count, sequence parallel,",
             "# recompute (none / selective / full, on every rank or on the first ranks that",
             "# need it), ZeRO stage; the split balances",
             "# the estimated per-block time. Estimate: the compiler's (device section below).",
             "# " + summary(result).strip(),
             f"# Chose #{pick + 1}: {c.label()}",
             f"#   step {p.step_time_s:.4g} s, {tflops(p):.1f} TFLOP/s per GPU, MFU "
             f"{utilisation(p, peak_flops):.2f}, peak {p.peak_bytes / GIB:.2f} GiB per rank "
             f"(capacity {result.capacity / GIB:.1f} GiB), bubble {p.bubble:.3f}"]
    if c.memory_limit:
        lines.append(f"#   pipeline.memory_limit = {c.memory_limit}: the microbatches' "
                     "activations a rank may hold beside its states, so `auto` searches "
                     "only orders that fit")
    lines += _why(result, pick)
    text = format_plan(plan, full=True, comments=False)
    if not device_section:
        lines.append("# Device: this machine's measured CPU model (no device section, so "
                     "`pipeplan check` measures it the same way)")
        text = re.sub(r"\ndevice \{\n.*?\n\}\n", "\n", text, flags=re.S)
    return "\n".join(lines) + "\n\n" + text


def _why(result: SearchResult, pick: int) -> list[str]:
    """One line per runner-up: how much slower than the chosen one."""
    chosen = result.top[pick].prediction.step_time_s
    out = []
    for i, r in enumerate(result.top[:4]):
        if i == pick:
            continue
        d = r.prediction.step_time_s / chosen - 1
        out.append(f"#   #{i + 1} {r.candidate.label()}: {d:+.2%} step time")
    return (["# Runners-up:"] + out) if out else []


def fixed_axes(c: Candidate) -> dict:
    return {k: getattr(c, k) for k in ("pp", "tp", "dp", "cp", "ep")}
