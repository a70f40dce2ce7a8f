"""A run directory (`train.log_dir`) and `pipeplan report RUN_DIR`: an HTML page a person reads.

At the end of a run rank 0 writes next to metrics.jsonl (one JSON object per
step, observe.Progress):

    trace.json    every rank's measured timeline and the planned one (trace.py)
    memory.json   per rank: start-up time, parameter bytes, peak RSS (memory.py)
    bubble.json   measured (per step, steady-state median) vs predicted bubble

`pipeplan report RUN_DIR [-o FILE]` turns them into one self-contained HTML
file (inline SVG, no scripts, nothing fetched): the loss curve, the step-time
curve, the measured timeline of a steady-state step above the planned one,
rank by rank, and each rank's memory. A missing file leaves its section out,
saying so.
"""
from __future__ import annotations

import dataclasses
import html
import json
import math
import os
from statistics import median
from typing import Optional, Sequence

from ...errors import PipeplanError
from ...schedules.render import _COLORS, gantt_svg, nice_ticks, op_legend
from .trace import PLANNED_PID, chrome_trace

FILES = ("metrics.jsonl", "trace.json", "memory.json", "bubble.json")
_OTHER = {"recv wait": "#bab0ac", "send": "#76b7b2", "send wait": "#9c755f",
          "grad sync": "#b07aa1", "optimizer": "#edc948", "runtime": "#d7d7d7"}


def write_run_files(log_dir: str, ranks: Sequence, memory: Sequence, check) -> None:
    os.makedirs(log_dir, exist_ok=True)
    files = {"trace.json": chrome_trace(ranks, check.planned),
             "memory.json": [dataclasses.asdict(m) for m in memory],
             "bubble.json": {"measured": check.measured, "per_step": list(check.per_step),
                             "steady_steps": list(check.steps), "predicted": check.predicted,
                             "predicted_from": check.source, "replayed": check.replayed,
                             "definition": "1 - sum(busy) / (ranks x makespan), whole "
                                           "iteration, pipeline at dp 0, tp 0; busy: the "
                                           "actions' slots (compute plus the runtime's work "
                                           "around it)"}}
    for name, value in files.items():
        tmp = os.path.join(log_dir, name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(value, f)
        os.replace(tmp, os.path.join(log_dir, name))


# ------------------------------------------------------------------ reading
def _read(run_dir: str, name: str):
    path = os.path.join(run_dir, name)
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            if name.endswith(".jsonl"):
                return [json.loads(line) for line in f if line.strip()]
            return json.load(f)
    except ValueError as e:
        raise PipeplanError(f"{path}: not valid JSON ({e}); was the run cut short?") from None


def write_report(run_dir: str, out: Optional[str] = None) -> str:
    """Write RUN_DIR/report.html (or `out`); returns its path."""
    if not os.path.isdir(run_dir):
        raise PipeplanError(f"{run_dir}: not a directory (give a run's train.log_dir)")
    data = {name: _read(run_dir, name) for name in FILES}
    if all(v is None for v in data.values()):
        raise PipeplanError(f"{run_dir}: none of {', '.join(FILES)} is there; run with "
                            f"--set train.log_dir={run_dir} to write them")
    sections = [_metrics_section(data["metrics.jsonl"]),
                _timeline_section(data["trace.json"], data["bubble.json"]),
                _memory_section(data["memory.json"])]
    title = f"pipeplan run {os.path.basename(os.path.abspath(run_dir))}"
    page = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
            f"<title>{html.escape(title)}</title>",
            "<style>body{font-family:sans-serif;margin:2em;max-width:none}"
            "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 8px}"
            ".scroll{overflow-x:auto}</style></head><body>",
            f"<h1>{html.escape(title)}</h1>", *sections, "</body></html>"]
    path = out or os.path.join(run_dir, "report.html")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(page) + "\n")
    return path


def _missing(name: str) -> str:
    return f"<p>(no {html.escape(name)} in the run directory)</p>"


# ------------------------------------------------------------------ curves
def _metrics_section(rows) -> str:
    if not rows:
        return "<h2>Loss and step time</h2>" + _missing("metrics.jsonl")
    steps = [r["step"] for r in rows]
    times = [r["step_time_s"] * 1e3 for r in rows]
    tps = [r.get("tokens_per_s", 0.0) for r in rows]
    summary = (f"<p>{len(rows)} steps; final loss {rows[-1]['loss']:.4f}; median step time "
               f"{median(times):.1f} ms; median {median(tps):,.0f} tokens/s</p>")
    held = [r for r in rows if r.get("eval_loss") is not None]  # train.eval's rows
    if held:
        summary += (f"<p>held-out loss {held[-1]['eval_loss']:.4f} (perplexity "
                    f"{held[-1]['eval_perplexity']:.4g}) after step {held[-1]['step']}</p>")
    return ("<h2>Loss and step time</h2>" + summary
            + line_chart("loss", steps, [r["loss"] for r in rows], "step", "loss")
            + (line_chart("held-out loss", [r["step"] for r in held],
                          [r["eval_loss"] for r in held], "step", "loss") if held else "")
            + line_chart("step time", steps, times, "step", "ms"))


def line_chart(name: str, xs: Sequence[float], ys: Sequence[float], xlabel: str,
               ylabel: str, w: int = 640, h: int = 260) -> str:
    """An SVG line chart with ticked axes (class="curve" on the polyline)."""
    left, right, top, bottom = 60, 20, 24, 40
    x0, x1 = min(xs), max(xs)
    pad = (max(ys) - min(ys)) * 0.05 or abs(max(ys)) * 0.05 or 1.0
    y0, y1 = min(ys) - pad, max(ys) + pad  # the data's own range, not from 0
    if x1 == x0:
        x1 = x0 + 1
    sx = lambda x: left + (x - x0) / (x1 - x0) * (w - left - right)  # noqa: E731
    sy = lambda y: h - bottom - (y - y0) / (y1 - y0) * (h - top - bottom)  # noqa: E731
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" data-name="{html.escape(name)}"'
           f' width="{w}" height="{h}" font-family="sans-serif" font-size="11">',
           f'<rect width="{w}" height="{h}" fill="white"/>',
           f'<text x="{left}" y="14" font-size="13">{html.escape(name)}</text>',
           f'<line x1="{left}" y1="{h - bottom}" x2="{w - right}" y2="{h - bottom}" '
           f'stroke="black"/>',
           f'<line x1="{left}" y1="{top}" x2="{left}" y2="{h - bottom}" stroke="black"/>']
    for t in nice_ticks(x1 - x0, 8):
        x = sx(x0 + t)
        out.append(f'<line class="tick" x1="{x:.1f}" y1="{h - bottom}" x2="{x:.1f}" '
                   f'y2="{h - bottom + 4}" stroke="black"/><text x="{x:.1f}" '
                   f'y="{h - bottom + 15}" text-anchor="middle">{x0 + t:g}</text>')
    step = nice_ticks(y1 - y0, 5)[1] if len(nice_ticks(y1 - y0, 5)) > 1 else y1 - y0
    first = math.ceil(y0 / step) * step
    for t in [first + k * step - y0 for k in range(int((y1 - first) / step + 1e-9) + 1)]:
        y = sy(y0 + t)
        out.append(f'<line class="tick" x1="{left - 4}" y1="{y:.1f}" x2="{left}" y2="{y:.1f}" '
                   f'stroke="black"/><text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">'
                   f'{y0 + t:.4g}</text>')
    out.append(f'<text x="{(left + w - right) / 2}" y="{h - 6}" text-anchor="middle">'
               f'{html.escape(xlabel)}</text>')
    out.append(f'<text x="12" y="{(top + h - bottom) / 2}" transform="rotate(-90 12 '
               f'{(top + h - bottom) / 2})" text-anchor="middle">{html.escape(ylabel)}</text>')
    points = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in zip(xs, ys))
    out.append(f'<polyline class="curve" fill="none" stroke="#4e79a7" stroke-width="1.5" '
               f'points="{points}"/>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------ timeline
def _timeline_section(trace, bubble) -> str:
    head = "<h2>Timeline: measured vs planned</h2>"
    if not trace:
        return head + _missing("trace.json")
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    steps = sorted({e["args"]["step"] for e in events if e["pid"] < PLANNED_PID})
    if not steps:
        return head + "<p>(the trace holds no steps)</p>"
    step = steps[-1]
    text = ""
    if bubble:
        text = (f"<p>bubble ({html.escape(bubble['definition'])}): measured "
                f"{bubble['measured']:.3f} (median of steps {bubble['steady_steps'][0]}-"
                f"{bubble['steady_steps'][-1]}), predicted {bubble['predicted']:.3f} from "
                f"{html.escape(bubble['predicted_from'])}</p>")
    mine = [e for e in events if e["pid"] < PLANNED_PID and e["args"].get("step") == step]
    planned = [e for e in events if e["pid"] >= PLANNED_PID and e["args"].get("step") == step]
    t0 = min(e["ts"] for e in mine + planned)  # the step's first event, of any lane
    t1 = max(e["ts"] + e["dur"] for e in mine + planned)
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"]
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    rows = []
    for pid in sorted({e["pid"] for e in mine}):
        pp_pid = _planned_pid(names.get(pid, ""))
        pp = f" (pp {pp_pid - PLANNED_PID})" if pp_pid is not None else ""
        rows.append((f"rank {pid}{pp} measured", _boxes(mine, pid, t0)))
        if pp_pid is not None and any(e["pid"] == pp_pid for e in planned):
            rows.append((f"pp {pp_pid - PLANNED_PID} planned", _boxes(planned, pp_pid, t0)))
    svg = gantt_svg(f"step {step}, ms from its first event", rows, (t1 - t0) / 1e3, "ms",
                    _legend(mine + planned), max_width=2400)
    return head + text + f'<div class="scroll">{svg}</div>'


def _legend(events) -> list:
    """(colour, meaning) of each kind the drawn events hold, in a fixed order."""
    kinds = {e["cat"] for e in events}
    ops = [op for op in ("F", "B", "W", "BW") if op in kinds]
    return (op_legend(ops, later=False) + [(c, k) for k, c in _OTHER.items() if k in kinds]
            + [(c, k) for k, c in sorted(_other_kinds(kinds).items())])


def _other_kinds(kinds) -> dict:
    """Kinds neither an op nor one of _OTHER's (a pre-pass, a DiLoCo sync): grey."""
    return {k: "#888888" for k in kinds if k not in _COLORS and k not in _OTHER}


def _planned_pid(name: str) -> Optional[int]:
    """'rank 3 (pp 1, dp 0, tp 0)' -> the pid of planned pp rank 1 (for dp 0, tp 0 only)."""
    if "(pp " not in name or "dp 0, tp 0" not in name:
        return None
    return PLANNED_PID + int(name.split("(pp ")[1].split(",")[0])


def _boxes(events, pid: int, t0: float) -> list:
    out = []
    for e in sorted((e for e in events if e["pid"] == pid), key=lambda e: e["ts"]):
        start, end = (e["ts"] - t0) / 1e3, (e["ts"] + e["dur"] - t0) / 1e3
        fill = _COLORS.get(e["cat"], _OTHER.get(e["cat"], "#888888"))
        text = e["name"] if e["tid"] == 0 else ""
        out.append((start, end, fill, text, f"{e['name']} {e['dur'] / 1e3:.3f} ms",
                    1.0 if e["tid"] == 0 else 0.7))
    return out


# ------------------------------------------------------------------ memory
_PARTS = (("param_bytes", "parameters", "#f28e2b"), ("grad_bytes", "gradients", "#e15759"),
          ("optimizer_bytes", "optimizer state", "#59a14f"),
          ("activation_bytes", "activations (planned peak)", "#b07aa1"),
          ("peak", "peak RSS", "#4e79a7"))
_MIB = 1 << 20


def _memory_section(memory) -> str:
    head = "<h2>Memory per rank</h2>"
    if not memory:
        return head + _missing("memory.json")
    parts = [p for p in _PARTS if any(m.get(p[0]) for m in memory)]
    cells = "".join(f"<th>{html.escape(label)} MiB</th>" for _, label, _ in parts)
    rows = "".join(f"<tr><td>{m['rank']}</td><td>{m['pp']}</td>"
                   + "".join(f"<td>{m.get(key, 0) / _MIB:.2f}</td>" for key, _, _ in parts)
                   + f"<td>{m['startup_peak'] / _MIB:.0f}</td><td>{m['startup_s']:.1f}</td></tr>"
                   for m in memory)
    table = ("<table><tr><th>rank</th><th>pp</th>" + cells + "<th>peak RSS at start-up "
             "MiB</th><th>start-up s</th></tr>" + rows + "</table>")
    note = ("<p>Bytes on a logarithmic axis, so parts a thousand times smaller than the "
            "process still show: parameters, gradients and optimizer state as the rank holds "
            "them after its first step; activations as the plan's estimate of the rank's peak "
            "of saved microbatches; peak RSS as the OS measured it.</p>")
    return head + table + note + memory_chart(memory, parts)


def memory_chart(memory, parts, w: int = 520, bar_h: int = 12) -> str:
    """Per rank one bar per part on a log2 byte axis, each bar labelled with its MiB."""
    values = [m.get(key, 0) for m in memory for key, _, _ in parts if m.get(key, 0) > 0]
    lo = 2 ** (math.floor(math.log2(min(values))) - 1)  # the smallest part shows too
    hi = 2 ** math.ceil(math.log2(max(values)) + 1e-9)
    sx = lambda v: w * (math.log2(max(v, lo)) - math.log2(lo)) / (math.log2(hi) - math.log2(lo))  # noqa: E731
    left, group = 70, len(parts) * (bar_h + 2) + 10
    height = 30 + len(memory) * group + 50
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" class="memory" width="{left + w + 90}" '
           f'height="{height}" font-family="sans-serif" font-size="11">']
    for k, m in enumerate(memory):
        y0 = 20 + k * group
        out.append(f'<text class="row-label" x="4" y="{y0 + group / 2:.0f}">rank {m["rank"]}</text>')
        for j, (key, label, colour) in enumerate(parts):
            v, y = m.get(key, 0), y0 + j * (bar_h + 2)
            bar = sx(v) if v > 0 else 0.0
            out.append(f'<rect class="part" data-part="{key}" x="{left}" y="{y}" '
                       f'width="{bar:.1f}" height="{bar_h}" fill="{colour}"><title>rank '
                       f'{m["rank"]} {html.escape(label)}: {v / _MIB:.3f} MiB</title></rect>'
                       f'<text x="{left + bar + 4:.1f}" y="{y + bar_h - 2}">{_size(v)}</text>')
    axis_y = 20 + len(memory) * group
    out.append(f'<line class="axis" x1="{left}" y1="{axis_y}" x2="{left + w}" y2="{axis_y}" '
               f'stroke="black"/>')
    ticks = _log_ticks(lo, hi)
    for t in ticks:
        x = left + sx(t)
        out.append(f'<line class="tick" x1="{x:.1f}" y1="{axis_y}" x2="{x:.1f}" '
                   f'y2="{axis_y + 4}" stroke="black"/><text x="{x:.1f}" y="{axis_y + 15}" '
                   f'text-anchor="middle">{_size(t)}</text>')
    x = left
    for _, label, colour in parts:
        out.append(f'<g class="legend"><rect x="{x}" y="{axis_y + 26}" width="10" height="10" '
                   f'fill="{colour}"/><text x="{x + 13}" y="{axis_y + 35}">'
                   f'{html.escape(label)}</text></g>')
        x += 13 + 6 * len(label) + 12
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _log_ticks(lo: float, hi: float) -> list[float]:
    """Powers of two from lo to hi, every k-th so that about six show."""
    a, b = int(round(math.log2(lo))), int(round(math.log2(hi)))
    k = max(1, math.ceil((b - a) / 6))
    return [2.0 ** e for e in range(a, b + 1, k)]


def _size(v: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if v >= scale:
            return f"{v / scale:.3g} {unit}"
    return f"{v:.0f} B"
