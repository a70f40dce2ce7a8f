"""report.md: what will run and what it should cost, for a person to read before launch."""
from __future__ import annotations

import re

from ..compiled import CompiledPlan

GiB, MiB = 1024 ** 3, 1024 ** 2


def render_report(compiled: CompiledPlan) -> str:
    parts = [_header(compiled), _split(compiled), _tied(compiled), _experts(compiled),
             _tensor(compiled), _estimates(compiled), _collectives(compiled),
             _stage_collectives(compiled),
             _timeline(compiled)]
    return "\n".join(p for p in parts if p) + "\n"


def _header(c: CompiledPlan) -> str:
    p = c.plan
    m = p.mesh
    return "\n".join([
        f"# pipeplan build: {p.path}", "",
        f"- model: `{p.model.source}` captured with **{c.capture}** — {c.capture_reason}",
        f"- mesh: pp={m.pp} dp={m.dp} cp={m.cp} tp={m.tp} ep={m.ep} (world size {m.world_size}); "
        f"schedule **{c.schedule.name}**, {len(c.stages)} stages, {p.microbatches} microbatches "
        f"of {p.microbatch_size} × {p.data.seq_len} tokens; ZeRO-{p.zero}; {p.train.precision}",
        ""])


def _split(c: CompiledPlan) -> str:
    rows = ["## Split", "", "Pin it in the plan's pipeline section:", "",
            f"    {c.split_text or 'split = []  # one stage'}", "",
            "Per microbatch, for the whole stage as traced (fp32, before tp/ep sharding):", "",
            "| stage | rank | blocks | params | forward GFLOP | saved for backward MiB | sends |",
            "|---|---|---|---|---|---|---|"]
    for st in c.stages:
        blocks = st.module_names
        span = f"{blocks[0]} … {blocks[-1]}" if len(blocks) > 2 else ", ".join(blocks)
        params = sum(p.numel() for p in st.module.parameters())
        sends = ", ".join(f"{o.name} {list(o.shape)}" for o in st.outputs)
        rows.append(f"| {st.index} | {st.rank} | {span} | {params:,} | {st.flops / 1e9:.3f} | "
                    f"{st.activation_bytes / MiB:.2f} | {sends} |")
    return "\n".join(rows) + "\n"


def _tied(c: CompiledPlan) -> str:
    if not c.tied:
        return ""
    rows = ["## Tied parameters (gradients summed between holders every step)", ""]
    for t in c.tied:
        rows.append("- " + ", ".join(f"`{n}` (stage {s})" for n, s in zip(t.names, t.stages)))
    return "\n".join(rows) + "\n"


def _experts(c: CompiledPlan) -> str:
    if not c.experts:
        return ""
    ep = len(c.experts[0].shards)
    rows = ["## Expert placement (global expert indices per EP rank)", "",
            "| MoE layer | " + " | ".join(f"ep {r}" for r in range(ep)) + " |",
            "|---|" + "---|" * ep]
    for e in c.experts:
        rows.append(f"| {e.module} | " + " | ".join(_range(s) for s in e.shards) + " |")
    return "\n".join(rows) + "\n"


def _range(idx: tuple[int, ...]) -> str:
    return f"{idx[0]}–{idx[-1]}" if len(idx) > 1 else str(idx[0])


def _tensor(c: CompiledPlan) -> str:
    if not c.tp_rewrites:
        return ""
    counts: dict[str, int] = {}
    for kind in c.tp_rewrites.values():
        counts[kind] = counts.get(kind, 0) + 1
    rows = [f"## Tensor parallelism (tp = {c.plan.mesh.tp})", "",
            ", ".join(f"{n} {k}-parallel layers" for k, n in sorted(counts.items())), ""]
    return "\n".join(rows)


def _estimates(c: CompiledPlan) -> str:
    from ..parallel.diloco import sync_line

    e = c.estimates
    if e is None:
        return ""
    m = c.plan.mesh
    per_pp = [e.ranks[r * m.dp * m.cp * m.tp] for r in range(m.pp)]
    unit, size = _unit(max(x.total_bytes for x in per_pp))
    cunit, csize = _unit(max(max(x.comm_bytes.values(), default=0) for x in per_pp))
    rows = ["## Estimates per rank (one step)", "",
            "Ranks of one pipeline rank (its dp × tp replicas) are alike; one row each.", "",
            f"| pp rank | params {unit} | grads {unit} | optimizer {unit} | activations {unit} "
            f"| total {unit} | TFLOP | p2p {cunit} | dp {cunit} | tp {cunit} | ep {cunit} "
            f"| tied {cunit} | cp {cunit} |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r, x in enumerate(per_pp):
        cb = x.comm_bytes
        rows.append(f"| {r} | " + " | ".join(
            f"{v / size:.3f}" for v in (x.param_bytes, x.grad_bytes, x.optimizer_bytes,
                                         x.activation_bytes, x.total_bytes))
            + f" | {x.flops / 1e12:.4g} | "
            + " | ".join(f"{cb.get(k, 0) / csize:.2f}" for k in ("p2p", "dp", "tp", "ep", "tied", "cp"))
            + " |")
    rows += ["", *(f"- {line}" for line in capacity_lines(e, per_pp)),
             f"- predicted bubble (whole iteration, idle/total): **{e.bubble:.3f}**",
             f"- predicted step time: **{e.step_time_s:.4g} s** (one simulated timeline: "
             "per-op times on the device, exposed collectives, the DP reduction's tail, "
             "the optimizer; docs/compiler.md)",
             *(f"- {line}" for line in breakdown_lines(e.prediction)),
             *([f"- of which the routing pre-pass (experts.balance = step): "
                f"{e.prepass_s:.4g} s"] if e.prepass_s else []),
             *([f"- {sync_line(e.sync, human_bytes)} (dp column: average per step)"]
               if e.sync is not None else []),
             f"- device model: {device_text(e.device_model)}",
             "- accounting: see docs/compiler.md (bytes per element by precision and ZeRO stage; "
             "activations held from F to W/BW under this schedule)", ""]
    return "\n".join(rows)


def capacity_lines(e, rows: list) -> list[str]:
    """Whether each pipeline rank's estimate (`rows`: one RankEstimate per pp rank) fits the
    named accelerator's memory (its profile's capacity; none on the measured CPU, whose
    ranks share the host's memory: `pipeplan run` checks that at launch)."""
    hw = (e.device_model or {}).get("hardware") or {}
    cap = hw.get("memory_bytes") or 0.0
    if cap <= 0 or not rows:
        return []
    worst = max(range(len(rows)), key=lambda r: rows[r].total_bytes)
    need = rows[worst].total_bytes
    over = [r for r, x in enumerate(rows) if x.total_bytes > cap]
    what = (f"the {hw.get('name') or 'device'}'s {cap / 1e9:g} GB "
            f"({cap / 2**30:.1f} GiB; the estimate counts parameters, gradients, optimizer "
            "states and activations, not the allocator's or kernels' workspace)")
    if not over:
        return [f"memory: fits {what}: the largest, pp rank {worst}, {need / 2**30:.2f} GiB "
                f"({need / cap:.0%})"]
    return [f"memory: DOES NOT FIT {what} on {len(over)} of {len(rows)} pp ranks: pp rank "
            f"{worst} needs {need / 2**30:.2f} GiB ({need / cap:.1f}x); recompute, more "
            "pipeline or tensor ranks, ZeRO or a smaller micro-batch lower it (`pipeplan "
            "plan` searches them under the capacity)"]


def breakdown_lines(p) -> list[str]:
    """The time model's step per pipeline rank and its predicted MFU (estimate/predict.py)."""
    if p is None:
        return []
    lines = ["step per pp rank (s): compute / exposed comm / bubble / optimizer"]
    for r in p.ranks:
        lines.append(f"  pp rank {r.rank:>3}: {r.compute:.4g} / {r.comm:.4g} / "
                     f"{max(r.bubble, 0.0):.4g} / {r.optimizer:.4g}")
    lines.append(f"predicted MFU {p.mfu:.3f} (model FLOPs / peak), {p.tflops_per_gpu:.4g} "
                 "TFLOP/s per GPU (recompute included)")
    return lines


def device_text(d: dict) -> str:
    """The device model the estimate assumed, and where it came from."""
    nodes = ("tp groups inside a node, p2p/dp/ep between nodes"
             if d.get("ranks_per_node") is None else
             f"{d['ranks_per_node']} ranks per node; a group inside one node uses its link")
    measured = (f"op times and p2p latency from {d['profile']}; DP all-reduce under "
                if d.get("profile") else "")
    flops = d['flops_per_s']
    rate = f"{flops / 1e12:g} TFLOP/s" if flops >= 1e12 else f"{flops / 1e9:.3g} GFLOP/s"
    hw = d.get("hardware") or {}
    eff = hw.get("efficiency") or {}
    if hw.get("memory_bandwidth"):
        rate += (f" peak ({eff.get('gemm_peak', 1):.2f} of it in GEMMs), "
                 f"{hw['memory_bandwidth'] / 1e9:g} GB/s memory ({eff.get('memory', 1):.2f} of it)")
    host = (f", {d['op_s'] * 1e6:.2g} µs (forward) + {d['op_backward_s'] * 1e6:.2g} µs "
            "(backward) host time per op" if d.get("op_s") else "")
    return (f"{measured}{rate} per device{host}, "
            f"{d['tp_link_bytes_per_s'] / 1e9:g} GB/s inside a node, "
            f"{d['link_bytes_per_s'] / 1e9:g} GB/s between nodes ({nodes}), "
            f"{d['latency_s'] * 1e6:g} µs latency — from {d.get('origin', 'built-in defaults')}")


_GROUPS = {"dp": "data parallel", "edp": "expert data parallel", "tp": "tensor parallel",
           "ep": "expert parallel", "ep_tp": "expert × tensor parallel",
           "tied": "tied parameters' holders", "cp": "context parallel (Ulysses all-to-all, ring K/V hops)"}


def _collectives(c: CompiledPlan) -> str:
    """Bytes each rank hands to each collective per step, one column per pipeline rank."""
    e = c.estimates
    if e is None:
        return ""
    m = c.plan.mesh
    per_pp = [e.ranks[r * m.dp * m.cp * m.tp] for r in range(m.pp)]
    keys = sorted({k for x in per_pp for k in x.collectives})
    rows = ["## Collectives per step (bytes each rank hands in)", ""]
    if not keys:
        return "\n".join(rows + ["No collectives: every group has one rank.", ""])
    rows += ["Counted as the runtime's CommMeter counts them at the call sites; through a "
             "ring a rank sends 2(n−1)/n of an all-reduce, (n−1)/n of a reduce-scatter or "
             "all-to-all, n−1 times its all-gather shard.", "",
             "| group | collective | " + " | ".join(f"pp rank {r}" for r in range(m.pp)) + " |",
             "|---|---|" + "---|" * m.pp]
    for group, op in keys:
        cells = " | ".join(human_bytes(x.collectives.get((group, op), 0)) for x in per_pp)
        rows.append(f"| {group} ({_GROUPS.get(group, group)}) | {op} | {cells} |")
    return "\n".join(rows + [""])


def _stage_collectives(c: CompiledPlan) -> str:
    """The tp / ep collectives each stage's rewrite implies, per step on each of its ranks."""
    e = c.estimates
    if e is None or not any(e.stage_collectives):
        return ""
    rows = ["## Tensor- and expert-parallel collectives per stage", "",
            "What each stage's rewrite implies per step on each of its ranks (derived from "
            "the captured graph: backends/tp's redistributions, loss_parallel, the experts' "
            "all-to-alls), forward and backward over all microbatches.", "",
            "| stage | pp rank | group | collective | calls | bytes handed in |",
            "|---|---|---|---|---|---|"]
    for st, found in zip(c.stages, e.stage_collectives):
        for (group, op), (calls, nbytes) in sorted(found.items()):
            rows.append(f"| {st.index} | {st.rank} | {group} | {op} | {calls} | "
                        f"{human_bytes(nbytes)} |")
    return "\n".join(rows + [""])


def stage_collective_lines(c: CompiledPlan) -> list[str]:
    """`pipeplan check`'s lines: per stage, each tp / ep collective's calls and bytes."""
    e = c.estimates
    if e is None or not any(e.stage_collectives):
        return []
    lines = ["tp/ep collectives per step on each rank of a stage (calls, bytes handed in):"]
    issued_by_stage = e.issued_collectives or [None] * len(c.stages)
    for st, found, issued in zip(c.stages, e.stage_collectives, issued_by_stage):
        cells = ", ".join(f"{g} {op} {calls}x {human_bytes(n)}"
                          for (g, op), (calls, n) in sorted(found.items()))
        lines.append(f"  stage {st.index} (pp rank {st.rank}): {cells or 'none'}")
        if issued is not None and issued != found:
            cells = ", ".join(f"{g} {op} {calls}x {human_bytes(n)}"
                              for (g, op), (calls, n) in sorted(issued.items()))
            lines.append(f"    but its run at check issued {cells or 'none'}: DTensor's own "
                         "redistributions; the time estimate counts the line above")
        if st.tp_run:
            lines.append(f"    its run at check stopped at {st.tp_run} (meta tensors cannot "
                         "run it): what DTensor does from there on is not judged")
    return lines


def human_bytes(n: float) -> str:
    """`0`, `512 B`, `1.50 KiB`, `3.20 MiB`, `1.25 GiB`: each cell in its own unit."""
    if n == 0:
        return "0"
    for unit, size in (("TiB", 1024 ** 4), ("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def _unit(largest: float) -> tuple[str, int]:
    """GiB for big numbers, MiB otherwise, so a table reads without a column of zeros."""
    return ("GiB", GiB) if largest >= GiB else ("MiB", MiB)


def _timeline(c: CompiledPlan, width: int = 100) -> str:
    from ...schedules.render import ascii_timeline, explain
    e = c.estimates
    sim = e.simulation if e is not None else None
    if sim is None or sim.makespan <= 0:
        return ""
    return "\n".join(["## Timeline (simulated, seconds under the device model)", "", "```",
                      ascii_timeline(sim, width).rstrip("\n"), "", explain(sim).rstrip("\n"),
                      "```", "", "The same timeline for Perfetto / chrome://tracing: trace.json.",
                      ""])


def split_lines(compiled: CompiledPlan) -> list[str]:
    """The modules tensor parallelism splits where the plan did not name them
    (`tensor.plan = model` or `auto`), a block index written as * where every block is
    split alike."""
    how = compiled.plan.tensor.plan
    if compiled.plan.mesh.tp == 1 or how not in ("model", "auto"):
        return []
    out = []
    for kind in ("column", "row", "vocab"):
        names = [n for n, k in compiled.tp_rewrites.items() if k == kind]
        if names:
            shown = sorted({re.sub(r"\.\d+\.", ".*.", n) for n in names})
            out.append(f"  {kind}: {', '.join(shown)}")
    whole: dict[str, str] = {}  # pattern -> the first reason (tp_auto.left_whole)
    for name, why in compiled.tp_whole.items():
        whole.setdefault(re.sub(r"\.\d+\.", ".*.", name), why)
    out += [f"  left whole: {pattern} ({why})" for pattern, why in sorted(whole.items())]
    return [f"tensor.plan = {how}: {len(compiled.tp_rewrites)} layers split"] + out


def render_summary(compiled: CompiledPlan) -> str:
    """A few terminal lines: the split, per-pipeline-rank memory and the predicted step."""
    e = compiled.estimates
    m = compiled.plan.mesh
    lines = [f"capture: {compiled.capture} ({compiled.capture_reason})",
             f"split:   {compiled.split_text or 'one stage'}",
             f"stages on pipeline ranks: {[st.rank for st in compiled.stages]}"]
    lines += split_lines(compiled)
    if e is None:
        return "\n".join(lines) + "\n"
    rows = [e.ranks[r * m.dp * m.cp * m.tp] for r in range(m.pp)]
    unit, size = _unit(max(x.total_bytes for x in rows))
    lines.append(f"pp rank   params   grads   optim   activ   total {unit}   TFLOP/step")
    for r, x in enumerate(rows):
        parts = (x.param_bytes, x.grad_bytes, x.optimizer_bytes, x.activation_bytes)
        lines.append(f"{r:>7} " + " ".join(f"{v / size:>7.2f}" for v in parts)
                     + f" {x.total_bytes / size:>11.2f} {x.flops / 1e12:>12.4g}")
    lines += capacity_lines(e, rows)
    lines.append(f"predicted bubble {e.bubble:.3f} (whole iteration, idle/total), step "
                 f"{e.step_time_s:.4g} s")
    lines += breakdown_lines(e.prediction)
    if e.prepass_s:
        lines.append(f"routing pre-pass (experts.balance = step): {e.prepass_s:.4g} s of the "
                     f"step: a no-grad forward of every microbatch before the schedule")
    if m.cp > 1:
        p = compiled.plan
        lines.append(f"context parallel: {p.context.method} over cp = {m.cp}: each rank holds "
                     f"{p.data.seq_len // m.cp} of {p.data.seq_len} positions (activations "
                     "above are per slice); "
                     + ("ring K/V and dK/dV hops" if p.context.method == "ring" else "all-to-all")
                     + " per step per rank: "
                     + ", ".join(f"pp rank {r} {human_bytes(x.comm_bytes.get('cp', 0))}"
                                 for r, x in enumerate(rows)))
    if e.sync is not None:
        from ..parallel.diloco import sync_line
        lines.append(sync_line(e.sync, human_bytes))
    lines.append(f"device model: {device_text(e.device_model)}")
    lines += stage_collective_lines(compiled)
    return "\n".join(lines) + "\n"
