"""report.md: what will run and what it should cost, for a person to read before launch."""
from __future__ import annotations

from .compiled import CompiledPlan

GiB, MiB = 1024 ** 3, 1024 ** 2


def render_report(compiled: CompiledPlan) -> str:
    parts = [_header(compiled), _split(compiled), _tied(compiled), _experts(compiled),
             _tensor(compiled), _estimates(compiled), _timeline(compiled)]
    return "\n".join(p for p in parts if p) + "\n"


def _header(c: CompiledPlan) -> str:
    p = c.plan
    m = p.mesh
    return "\n".join([
        f"# pipeplan build: {p.path}", "",
        f"- model: `{p.model.source}` captured with **{c.capture}** — {c.capture_reason}",
        f"- mesh: pp={m.pp} dp={m.dp} tp={m.tp} ep={m.ep} (world size {m.world_size}); "
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
    e = c.estimates
    if e is None:
        return ""
    m = c.plan.mesh
    per_pp = [e.ranks[r * m.dp * m.tp] for r in range(m.pp)]
    unit, size = _unit(max(_total(x) for x in per_pp))
    cunit, csize = _unit(max(max(x.comm_bytes.values(), default=0) for x in per_pp))
    rows = ["## Estimates per rank (one step)", "",
            "Ranks of one pipeline rank (its dp × tp replicas) are alike; one row each.", "",
            f"| pp rank | params {unit} | grads {unit} | optimizer {unit} | activations {unit} "
            f"| total {unit} | TFLOP | p2p {cunit} | dp {cunit} | tp {cunit} | ep {cunit} "
            f"| tied {cunit} |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r, x in enumerate(per_pp):
        cb = x.comm_bytes
        rows.append(f"| {r} | " + " | ".join(
            f"{v / size:.3f}" for v in (x.param_bytes, x.grad_bytes, x.optimizer_bytes,
                                         x.activation_bytes, _total(x)))
            + f" | {x.flops / 1e12:.4g} | "
            + " | ".join(f"{cb.get(k, 0) / csize:.2f}" for k in ("p2p", "dp", "tp", "ep", "tied"))
            + " |")
    d = e.device_model
    rows += ["", f"- predicted bubble (whole iteration, idle/total): **{e.bubble:.3f}**",
             f"- predicted step time: **{e.step_time_s:.4g} s** (simulated pipeline + DP "
             "all-reduce, not overlapped)",
             f"- device model: {d['flops_per_s'] / 1e12:g} TFLOP/s sustained per device, "
             f"{d['link_bytes_per_s'] / 1e9:g} GB/s between nodes (p2p, dp, ep), "
             f"{d['tp_link_bytes_per_s'] / 1e9:g} GB/s inside a node (tp), "
             f"{d['latency_s'] * 1e6:g} µs latency",
             "- accounting: see docs/compiler.md (bytes per element by precision and ZeRO stage; "
             "activations held from F to W/BW under this schedule)", ""]
    return "\n".join(rows)


def _total(x) -> int:
    return x.param_bytes + x.grad_bytes + x.optimizer_bytes + x.activation_bytes


def _unit(largest: float) -> tuple[str, int]:
    """GiB for big numbers, MiB otherwise, so a table reads without a column of zeros."""
    return ("GiB", GiB) if largest >= GiB else ("MiB", MiB)


def _timeline(c: CompiledPlan, width: int = 100) -> str:
    from ..schedules.render import ascii_timeline, explain
    e = c.estimates
    sim = e.simulation if e is not None else None
    if sim is None or sim.makespan <= 0:
        return ""
    return "\n".join(["## Timeline (simulated, seconds under the device model)", "", "```",
                      ascii_timeline(sim, width).rstrip("\n"), "", explain(sim).rstrip("\n"),
                      "```", "", "The same timeline for Perfetto / chrome://tracing: trace.json.",
                      ""])


def render_summary(compiled: CompiledPlan) -> str:
    """A few terminal lines: the split, per-pipeline-rank memory and the predicted step."""
    e = compiled.estimates
    m = compiled.plan.mesh
    lines = [f"capture: {compiled.capture} ({compiled.capture_reason})",
             f"split:   {compiled.split_text or 'one stage'}",
             f"stages on pipeline ranks: {[st.rank for st in compiled.stages]}"]
    if e is None:
        return "\n".join(lines) + "\n"
    rows = [e.ranks[r * m.dp * m.tp] for r in range(m.pp)]
    unit, size = _unit(max(_total(x) for x in rows))
    lines.append(f"pp rank   params   grads   optim   activ   total {unit}   TFLOP/step")
    for r, x in enumerate(rows):
        parts = (x.param_bytes, x.grad_bytes, x.optimizer_bytes, x.activation_bytes)
        lines.append(f"{r:>7} " + " ".join(f"{v / size:>7.2f}" for v in parts)
                     + f" {_total(x) / size:>11.2f} {x.flops / 1e12:>12.4g}")
    lines.append(f"predicted bubble {e.bubble:.3f} (whole iteration, idle/total), step "
                 f"{e.step_time_s:.4g} s at {e.device_model['flops_per_s'] / 1e12:g} TFLOP/s")
    return "\n".join(lines) + "\n"
