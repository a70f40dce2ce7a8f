"""report.html and the schedule SVG in a real browser: headless Chromium lays them out, a
script reads every element's box from the DOM, and a screenshot is taken.

Checks what only a layout engine knows: no element of an SVG outside the SVG's box, no
timeline box over a row's label, every action of the step drawn on its measured and its
planned row, a legend of exactly the kinds drawn, every memory part at least a pixel wide.
CI installs Chromium (.ci/run); without a `chromium` binary the test is skipped, saying so.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent.parent
BROWSER = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")
                if shutil.which(n)), None)
needs_browser = pytest.mark.skipif(
    BROWSER is None, reason="no chromium binary on PATH (CI installs it: apt-get install "
                            "chromium); the report's layout is checked only in a browser")

PLAN = f"""
model {{
  source = "{REPO}/examples/models/gpt.py:GPT"
  args = {{ vocab = 64, dim = 32, layers = 4, heads = 4, seq_len = 16 }}
  inputs = {{ input_ids = int64[batch, seq] }}
  capture = fx
  loss = cross_entropy
}}
data = synthetic(seed = 1, vocab = 64, seq_len = 16)
mesh {{ pp = 2 }}
pipeline {{
  schedule = zbh1
  microbatches = 4
  split = [layers[0:2], layers[2:4]]
}}
train {{
  steps = 3
  global_batch = 8
  optimizer = adamw(lr = 0.01)
  log_dir = "run"
}}
"""

# Runs in the page after layout: every SVG element's box against its SVG's, each Gantt
# row's boxes against its label, counts and legend texts; the answer goes into <pre id=out>.
CHECK_JS = r"""
const out = {outside: [], over_label: [], rows: {}, legends: [], parts: []};
const tol = 0.5;
for (const svg of document.querySelectorAll('svg')) {
  const s = svg.getBoundingClientRect();
  for (const el of svg.querySelectorAll('rect,text,line,polyline')) {
    const r = el.getBoundingClientRect();
    if (r.width === 0 && r.height === 0) continue;
    if (r.left < s.left - tol || r.right > s.right + tol || r.top < s.top - tol ||
        r.bottom > s.bottom + tol)
      out.outside.push((svg.getAttribute('class') || 'svg') + ': ' + el.outerHTML.slice(0, 120));
  }
  for (const row of svg.querySelectorAll('g.row')) {
    const label = row.querySelector('.row-label').getBoundingClientRect();
    const boxes = [...row.querySelectorAll('rect.box')];
    out.rows[row.dataset.name] = boxes.map(b => b.querySelector('title').textContent);
    for (const b of boxes)
      if (b.getBoundingClientRect().left < label.right - tol)
        out.over_label.push(row.dataset.name + ': ' + b.outerHTML.slice(0, 120));
  }
  if (svg.classList.contains('gantt'))
    out.legends.push([...svg.querySelectorAll('g.legend text')].map(t => t.textContent));
  for (const p of svg.querySelectorAll('rect.part'))
    out.parts.push([p.dataset.part, p.getBoundingClientRect().width]);
}
const pre = document.createElement('pre'); pre.id = 'out';
pre.textContent = JSON.stringify(out); document.body.appendChild(pre);
"""


def in_browser(page: Path, tmp: Path) -> dict:
    """Lay `page` out in headless Chromium with CHECK_JS appended; its findings, and a
    screenshot next to it."""
    checked = tmp / (page.stem + ".checked.html")
    checked.write_text(page.read_text(encoding="utf-8") + f"<script>{CHECK_JS}</script>",
                       encoding="utf-8")
    flags = [BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
             f"--user-data-dir={tmp / 'profile'}"]
    dom = subprocess.run([*flags, "--dump-dom", checked.as_uri()], capture_output=True,
                         text=True, timeout=60).stdout
    shot = tmp / (page.stem + ".png")
    subprocess.run([*flags, f"--screenshot={shot}", "--window-size=1400,2000",
                    page.as_uri()], capture_output=True, timeout=60)
    assert shot.is_file() and shot.stat().st_size > 10_000, "no screenshot"
    start = dom.index('<pre id="out">') + len('<pre id="out">')
    import html
    return json.loads(html.unescape(dom[start:dom.index("</pre>", start)]))


def pipeplan(*args, cwd):
    r = subprocess.run([sys.executable, "-m", "pipeplan", *map(str, args)], cwd=cwd,
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


@pytest.mark.heavy  # suite time: run with -m heavy
@needs_browser
@pytest.mark.slow
def test_report_in_a_browser(tmp_path):
    (tmp_path / "r.plan").write_text(PLAN)
    pipeplan("run", "r.plan", cwd=tmp_path)
    pipeplan("report", "run", cwd=tmp_path)
    found = in_browser(tmp_path / "run" / "report.html", tmp_path)
    assert found["outside"] == [] and found["over_label"] == [], found

    trace = json.loads((tmp_path / "run" / "trace.json").read_text())
    step = 3
    ran = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e["pid"] < 1000
           and e["args"].get("step") == step]
    for rank in (0, 1):
        measured = found["rows"][f"rank {rank} (pp {rank}) measured"]
        planned = found["rows"][f"pp {rank} planned"]
        actions = sorted(e["name"] for e in ran if e["pid"] == rank and e["tid"] == 0)
        assert len(actions) == 3 * 4  # zbh1: F, B, W of 4 microbatches on each rank
        # every action the rank ran is drawn on both rows (the planned one: pp 0's first F too)
        assert sorted(t.split()[0] for t in planned) == actions
        assert sorted(t.split()[0] for t in measured if t.split()[0] in actions) == actions
        assert len(measured) == sum(1 for e in ran if e["pid"] == rank)
    (legend,) = found["legends"]
    drawn = {e["cat"] for e in ran}
    assert {x.split()[0] if x.split()[0] in ("F", "B", "W", "BW") else x for x in legend} \
        == drawn, (legend, drawn)
    parts = dict((k, 0.0) for k, _ in found["parts"])
    assert set(parts) >= {"param_bytes", "grad_bytes", "optimizer_bytes", "peak"}
    assert all(w >= 1.0 for _, w in found["parts"]), found["parts"]


@needs_browser
def test_schedule_svg_in_a_browser(tmp_path):
    for kind, ranks, micro in (("zbv", 4, 8), ("1f1b", 2, 2)):
        svg = tmp_path / f"{kind}.svg"
        pipeplan("schedule", kind, "--ranks", ranks, "--microbatches", micro, "--format",
                 "svg", "-o", svg, cwd=tmp_path)
        page = tmp_path / f"{kind}.html"
        page.write_text(f"<!DOCTYPE html><html><body>{svg.read_text()}</body></html>")
        found = in_browser(page, tmp_path)
        assert found["outside"] == [] and found["over_label"] == [], found
        per_rank = {"zbv": 2 * micro * 3, "1f1b": micro * 2}[kind]
        assert [len(found["rows"][f"rank {r}"]) for r in range(ranks)] == [per_rank] * ranks
