"""Renderers of a simulated schedule: metrics table, ASCII timeline, Chrome trace (Perfetto), SVG Gantt."""
from __future__ import annotations

import html
import json
from typing import Sequence

from .execution import NONE, analyze
from .ir import B, BW, F, W
from .memory import delta, peak_until_b, stage_share
from .simulate import SimResult

BUBBLE_DEFINITION = ("bubble = 1 - sum(busy) / (ranks x makespan), whole iteration; "
                     "span bubble = 1 - sum(busy) / sum(each rank's first-to-last-op span); "
                     "bound: no order of this placement within the memory limit is shorter, gap = bubble - "
                     "bound bubble; memory in microbatches of a rank's activations (F adds, W/BW frees; "
                     "until B: if B freed them)")


def metrics_table(results: Sequence[SimResult]) -> str:
    """One row per schedule: bubble, span bubble, makespan, lower bound, peak memory."""
    header = ("schedule", "p", "m", "v", "costs", "makespan", "bound", "bubble", "bound bubble", "gap",
              "span bubble", "peak mem", "until B")
    rows = [header]
    for r in results:
        s = r.schedule
        v = max(s.stages_per_rank())
        rows.append((s.name, str(s.ranks), str(s.microbatches), str(v), r.costs.label(),
                     f"{r.makespan:.4g}", f"{r.lower_bound:.4g}", f"{r.bubble:.4f}",
                     f"{r.lower_bound_bubble:.4f}", f"{r.bubble - r.lower_bound_bubble:.4f}",
                     f"{r.span_bubble:.4f}", f"{max(r.peak_activations, default=0):g}",
                     f"{max(peak_until_b(s), default=0):g}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines) + "\n" + BUBBLE_DEFINITION + "\n"


def explain(result: SimResult, top: int = 5) -> str:
    """Per-rank busy/idle/peak, the largest idle gaps and what they waited for, the critical path."""
    lines = ["rank  busy      idle      peak mem"]
    for r in range(result.schedule.ranks):
        lines.append(f"{r:<4}  {result.busy[r]:<8.4g}  {result.idle[r]:<8.4g}  {result.peak_activations[r]:g}")
    gaps = sorted(result.idle_attribution, key=lambda g: (-g.duration, g.rank, g.start))[:top]
    if gaps:
        lines.append(f"largest idle gaps (of {len(result.idle_attribution)}):")
        lines += [f"  {g}" for g in gaps]
    path = result.critical_path
    if path:
        shown = " -> ".join(f"r{r}:{a}" for r, a in path[:12]) + (" -> ..." if len(path) > 12 else "")
        lines.append(f"critical path ({len(path)} actions): {shown}")
    return "\n".join(lines) + "\n"


def _label(result: SimResult, rank: int, a) -> str:
    """F3 for a rank's first stage, f3 for its later ones (second lap / second half of the V)."""
    first = result.schedule.stages_of_rank(rank)[0] == a.stage
    op = a.op if first else a.op.lower()
    return f"{op}{a.microbatch}"


def ascii_timeline(result: SimResult, width: int = 120) -> str:
    """A row per rank, time left to right at `width` columns per makespan; '.' is idle."""
    span = result.makespan or 1.0
    scale = width / span
    lines = [f"time 0 .. {result.makespan:g}  ({span / width:.3g} per column; "
             "F/B/W/BW = op of the rank's first stage, lower case = its later stage; number = microbatch)"]
    for r, row in enumerate(result.schedule.order):
        cells = ["."] * width
        for a, t0, t1 in zip(row, result.start[r], result.end[r]):
            c0, c1 = int(round(t0 * scale)), max(int(round(t0 * scale)) + 1, int(round(t1 * scale)))
            c1 = min(c1, width)
            text = _label(result, r, a)
            fill = {F: "-", B: "~", W: "+", BW: "="}[a.op]
            for k, c in enumerate(range(c0, c1)):
                cells[c] = text[k] if k < len(text) and c1 - c0 > 1 else (fill if c1 - c0 > 1 else text[0])
        lines.append(f"rank {r:<3}|" + "".join(cells) + "|")
    return "\n".join(lines) + "\n"


US = 1000.0  # one cost unit drawn as 1 ms


def chrome_trace(result: SimResult) -> dict:
    """Perfetto/Chrome trace: a process per rank, compute slices, activation counters, send flows."""
    s = result.schedule
    events = []
    for r in range(s.ranks):
        events.append({"ph": "M", "name": "process_name", "pid": r, "args": {"name": f"rank {r}"}})
        events.append({"ph": "M", "name": "thread_name", "pid": r, "tid": 0, "args": {"name": "compute"}})
    share = stage_share(s)
    for r, row in enumerate(s.order):
        held = 0.0
        for a, t0, t1 in zip(row, result.start[r], result.end[r]):
            events.append({"ph": "X", "name": f"{a.op}{a.stage}.{a.microbatch}", "cat": a.op, "pid": r, "tid": 0,
                           "ts": t0 * US, "dur": (t1 - t0) * US,
                           "args": {"op": a.op, "stage": a.stage, "microbatch": a.microbatch}})
            held += delta(a.op, share[a.stage])
            events.append({"ph": "C", "name": "activations", "pid": r, "ts": (t1 if a.op != F else t0) * US,
                           "args": {"microbatches": round(held, 6)}})
    ex = analyze(s)
    flow = 0
    for r, row in enumerate(ex.producer):
        for i, dep in enumerate(row):
            q, j = ex.pos(dep) if dep != NONE else (r, -1)
            if q != r:
                flow += 1
                events.append({"ph": "s", "id": flow, "name": "p2p", "cat": "p2p", "pid": q, "tid": 0,
                               "ts": result.end[q][j] * US - 1e-3})
                events.append({"ph": "f", "bp": "e", "id": flow, "name": "p2p", "cat": "p2p", "pid": r,
                               "tid": 0, "ts": result.start[r][i] * US})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "metadata": {"schedule": s.name, "bubble_definition": BUBBLE_DEFINITION, **result.metrics()}}


def chrome_trace_json(result: SimResult) -> str:
    return json.dumps(chrome_trace(result))


_COLORS = {F: "#4e79a7", B: "#f28e2b", W: "#59a14f", BW: "#e15759"}


def svg_gantt(result: SimResult, px_per_unit: float = 0.0, row_h: int = 28) -> str:
    """A standalone SVG Gantt chart: one row per rank, one box per action, labelled op+microbatch."""
    s = result.schedule
    span = result.makespan or 1.0
    scale = px_per_unit or max(4.0, min(60.0, 1200.0 / span))
    left, top = 70, 40
    width = int(left + span * scale + 20)
    height = int(top + s.ranks * row_h + 40)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="monospace" font-size="11">',
           f'<text x="{left}" y="18" font-size="13">{html.escape(s.name)}: p={s.ranks} m={s.microbatches} '
           f'bubble={result.bubble:.4f} (whole iteration) span={result.span_bubble:.4f} '
           f'makespan={result.makespan:g} bound={result.lower_bound:g}</text>']
    for r, row in enumerate(s.order):
        y = top + r * row_h
        out.append(f'<text x="4" y="{y + row_h * 0.65:.1f}">rank {r}</text>')
        for a, t0, t1 in zip(row, result.start[r], result.end[r]):
            x, w = left + t0 * scale, max(1.0, (t1 - t0) * scale)
            first = s.stages_of_rank(r)[0] == a.stage
            out.append(f'<rect x="{x:.2f}" y="{y + 2}" width="{w:.2f}" height="{row_h - 4}" '
                       f'fill="{_COLORS[a.op]}" fill-opacity="{1.0 if first else 0.6}" stroke="white">'
                       f'<title>{a.describe()} t={t0:g}..{t1:g}</title></rect>')
            if w >= 18:
                out.append(f'<text x="{x + 2:.2f}" y="{y + row_h * 0.65:.1f}" fill="white">'
                           f'{html.escape(_label(result, r, a))}</text>')
    axis_y = top + s.ranks * row_h + 14
    out.append(f'<text x="{left}" y="{axis_y}">0</text>')
    out.append(f'<text x="{left + span * scale - 20:.1f}" y="{axis_y}">{result.makespan:g}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"
