"""Renderers of a simulated schedule: metrics table, ASCII timeline, Chrome trace (Perfetto), SVG Gantt."""
from __future__ import annotations

import html
import json
import math
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


_FILL = {F: "-", B: "~", W: "+", BW: "="}


def ascii_legend(result: SimResult) -> str:
    """What the ASCII timeline's characters mean (only what this schedule draws)."""
    s = result.schedule
    used = [o for o in (F, B, W, BW) if any(a.op == o for row in s.order for a in row)]
    boxes = ", ".join(f"{o}{_FILL[o] * 3} {_NAMES[o].split(' ', 1)[1]}" for o in used)
    later = ("; upper case: the rank's first stage, lower case: its later stage"
             if max(s.stages_per_rank()) > 1 else "")
    return (f"a box is its op and microbatch, then its fill: {boxes}{later}; "
            "a box of one column shows its op only; '.': idle")


def ascii_timeline(result: SimResult, width: int = 120) -> str:
    """A row per rank, time left to right at `width` columns per makespan; '.' is idle."""
    span = result.makespan or 1.0
    scale = width / span
    lines = [f"time 0 .. {result.makespan:g}  ({span / width:.3g} per column)",
             ascii_legend(result)]
    for r, row in enumerate(result.schedule.order):
        cells = ["."] * width
        for a, t0, t1 in zip(row, result.start[r], result.end[r]):
            c0, c1 = int(round(t0 * scale)), max(int(round(t0 * scale)) + 1, int(round(t1 * scale)))
            c1 = min(c1, width)
            text = _label(result, r, a)
            fill = _FILL[a.op]
            for k, c in enumerate(range(c0, c1)):
                cells[c] = text[k] if k < len(text) and c1 - c0 > 1 else (fill if c1 - c0 > 1 else text[0])
        lines.append(f"rank {r:<3}|" + "".join(cells) + "|")
    return "\n".join(lines) + "\n"


US = 1000.0  # one abstract cost unit drawn as 1 ms (Chrome traces count in µs)
SECONDS = 1e6  # costs in seconds (a compiled plan's estimates, a profile): µs per second


def chrome_trace(result: SimResult, us_per_unit: float = US, pid_offset: int = 0,
                 t0_us: float = 0.0, label: str = "rank") -> dict:
    """Perfetto/Chrome trace: a process per rank, compute slices, activation counters, send flows.

    Trace times are µs: `us_per_unit` converts the costs' unit (US for abstract units,
    SECONDS when they are seconds). `pid_offset`, `t0_us` and `label` place the timeline as
    extra processes of another trace (the measured trace's planned track)."""
    s = result.schedule
    unit = us_per_unit  # µs per cost unit
    events = []
    for r in range(s.ranks):
        events.append({"ph": "M", "name": "process_name", "pid": r, "args": {"name": f"{label} {r}"}})
        events.append({"ph": "M", "name": "thread_name", "pid": r, "tid": 0, "args": {"name": "compute"}})
    share = stage_share(s)
    for r, row in enumerate(s.order):
        held = 0.0
        for a, t0, t1 in zip(row, result.start[r], result.end[r]):
            events.append({"ph": "X", "name": f"{a.op}{a.stage}.{a.microbatch}", "cat": a.op, "pid": r, "tid": 0,
                           "ts": t0 * unit, "dur": (t1 - t0) * unit,
                           "args": {"op": a.op, "stage": a.stage, "microbatch": a.microbatch}})
            held += delta(a.op, share[a.stage])
            events.append({"ph": "C", "name": "activations", "pid": r, "ts": (t1 if a.op != F else t0) * unit,
                           "args": {"microbatches": round(held, 6)}})
    ex = analyze(s)
    flow = 0
    for r, row in enumerate(ex.producer):
        for i, dep in enumerate(row):
            q, j = ex.pos(dep) if dep != NONE else (r, -1)
            if q != r:
                flow += 1
                events.append({"ph": "s", "id": flow, "name": "p2p", "cat": "p2p", "pid": q, "tid": 0,
                               "ts": result.end[q][j] * unit - 1e-3})
                events.append({"ph": "f", "bp": "e", "id": flow, "name": "p2p", "cat": "p2p", "pid": r,
                               "tid": 0, "ts": result.start[r][i] * unit})
    return _shift({"traceEvents": events, "displayTimeUnit": "ms",
                   "metadata": {"schedule": s.name, "bubble_definition": BUBBLE_DEFINITION,
                                **result.metrics()}}, pid_offset, t0_us)


def _shift(trace: dict, pid_offset: int, t0_us: float) -> dict:
    for e in trace["traceEvents"]:
        e["pid"] += pid_offset
        if "ts" in e:
            e["ts"] += t0_us
    return trace


def chrome_trace_json(result: SimResult, us_per_unit: float = US) -> str:
    return json.dumps(chrome_trace(result, us_per_unit))


_COLORS = {F: "#4e79a7", B: "#f28e2b", W: "#59a14f", BW: "#e15759"}
_NAMES = {F: "F forward", B: "B input grad", W: "W weight grad", BW: "BW full backward"}
CHAR_PX = 6.7  # width of one 11 px monospace character
MAX_WIDTH_PX = 24000


def nice_ticks(span: float, target: int = 10) -> list[float]:
    """Round tick positions (1, 2 or 5 x 10^k apart) from 0 to `span`, about `target` of them."""
    if span <= 0:
        return [0.0]
    raw = span / target
    mag = 10 ** math.floor(math.log10(raw))
    step = next(k * mag for k in (1, 2, 5, 10) if k * mag >= raw)
    return [i * step for i in range(int(span / step + 1e-9) + 1)]


TITLE_CHAR_PX = 8.0  # width of one 13 px monospace character


def gantt_svg(title: str, rows: Sequence[tuple[str, Sequence[tuple]]], span: float,
              unit: str = "", legend: Sequence[tuple[str, str]] = (), row_h: int = 28,
              max_width: float = MAX_WIDTH_PX) -> str:
    """A standalone SVG Gantt: `rows` = (name, boxes), a box = (t0, t1, fill, text, tooltip,
    opacity). Wide enough that the shortest labelled box shows its text (up to `max_width`
    px; a box too narrow for its text keeps it as a tooltip), a time axis with round ticks in
    `unit`, a legend of (colour, meaning). Everything is drawn inside the SVG's box: boxes
    are clipped to [0, span], and the width fits the title, the unit and the legend."""
    span = span or 1.0
    need = [(len(b[3]) * CHAR_PX + 4) / (b[1] - b[0]) for _, boxes in rows for b in boxes
            if b[3] and b[1] > b[0]]
    scale = min(max(1200.0 / span, max(need, default=0.0)), max_width / span)
    left = 8 + CHAR_PX * max((len(n) for n, _ in rows), default=6)
    top = 40
    axis_end = left + span * scale
    keys = _legend_widths(legend)
    width = int(math.ceil(max(axis_end + 12 + CHAR_PX * len(unit), 8 + TITLE_CHAR_PX * len(title),
                              left + sum(keys), axis_end + 20)))
    axis_y = top + len(rows) * row_h
    height = int(axis_y + 60)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" class="gantt" width="{width}" '
           f'height="{height}" font-family="monospace" font-size="11">',
           f'<text class="title" x="4" y="18" font-size="13">{html.escape(title)}</text>']
    for k, (name, boxes) in enumerate(rows):
        y = top + k * row_h
        out.append(f'<g class="row" data-name="{html.escape(name)}">'
                   f'<text class="row-label" x="4" y="{y + row_h * 0.65:.1f}">'
                   f'{html.escape(name)}</text>')
        for t0, t1, fill, text, tip, opacity in boxes:
            t0, t1 = max(0.0, min(t0, span)), max(0.0, min(t1, span))  # inside the axis
            x, w = left + t0 * scale, max(1.0, (t1 - t0) * scale)
            x = min(x, axis_end - w)
            out.append(f'<rect class="box" x="{x:.2f}" y="{y + 2}" width="{w:.2f}" '
                       f'height="{row_h - 4}" fill="{fill}" fill-opacity="{opacity:g}" '
                       f'stroke="white" stroke-width="0.5"><title>{html.escape(tip)}</title>'
                       f'</rect>')
            if text and w >= len(text) * CHAR_PX + 2:
                out.append(f'<text x="{x + 2:.2f}" y="{y + row_h * 0.65:.1f}" fill="white">'
                           f'{html.escape(text)}</text>')
        out.append("</g>")
    out.append(f'<line class="axis" x1="{left}" y1="{axis_y}" x2="{axis_end:.2f}" '
               f'y2="{axis_y}" stroke="black"/>')
    for t in nice_ticks(span):
        x = left + t * scale
        out.append(f'<line class="tick" x1="{x:.2f}" y1="{axis_y}" x2="{x:.2f}" y2="{axis_y + 5}" '
                   f'stroke="black"/><text x="{x:.2f}" y="{axis_y + 16}" text-anchor="middle">'
                   f'{t:g}</text>')
    out.append(f'<text class="unit" x="{axis_end + 12:.2f}" y="{axis_y + 16}">'
               f'{html.escape(unit)}</text>')
    x = left
    for (fill, meaning), w in zip(legend, keys):
        out.append(f'<g class="legend"><rect x="{x:.1f}" y="{axis_y + 28}" width="12" '
                   f'height="12" fill="{fill}"/><text x="{x + 16:.1f}" y="{axis_y + 38}">'
                   f'{html.escape(meaning)}</text></g>')
        x += w
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _legend_widths(legend: Sequence[tuple[str, str]]) -> list[float]:
    """Each legend entry's width: its swatch, its text, a gap."""
    return [16 + CHAR_PX * len(meaning) + 14 for _, meaning in legend]


def op_legend(ops: Sequence[str] = (F, B, W, BW), later: bool = True) -> list[tuple[str, str]]:
    paler = [("#888888", "paler: a rank's later stage")] if later else []
    return [(_COLORS[o], _NAMES[o]) for o in ops] + paler


def svg_gantt(result: SimResult, unit: str = "cost units") -> str:
    """The simulated schedule as an SVG Gantt: one row per rank, one box per action labelled
    op+microbatch (lower case: the rank's later stage), a time axis, a legend."""
    s = result.schedule
    rows = []
    for r, row in enumerate(s.order):
        first = s.stages_of_rank(r)[0]
        rows.append((f"rank {r}", [(t0, t1, _COLORS[a.op], _label(result, r, a),
                                    f"{a.describe()} t={t0:g}..{t1:g}",
                                    1.0 if a.stage == first else 0.6)
                                   for a, t0, t1 in zip(row, result.start[r], result.end[r])]))
    title = (f"{s.name}: p={s.ranks} m={s.microbatches} bubble={result.bubble:.4f} (whole "
             f"iteration) span={result.span_bubble:.4f} makespan={result.makespan:g} "
             f"bound={result.lower_bound:g}")
    used = [o for o in (F, B, W, BW) if any(a.op == o for row in s.order for a in row)]
    return gantt_svg(title, rows, result.makespan, unit,
                     op_legend(used, later=max(s.stages_per_rank()) > 1))
