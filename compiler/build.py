"""The build directory: everything `pipeplan run BUILD/` needs, and a person can read.

    plan.plan          the resolved plan (split pinned to what the compiler chose)
    schedule.json      the schedule, in the schedule engine's JSON format
    stages/stage_K.py  the generated forward of each stage
    report.md          split, placement, estimates, timeline
    trace.json         the simulated timeline for Perfetto (the runtime's measured trace
                       uses the same format, so the two overlay)
    manifest.json      hashes of the plan and model source; what produced the build
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

import torch

from .. import __version__
from ..dsl.ast import SplitSpec
from .compiled import CompiledPlan
from .capture.loading import is_folder_source, is_path_source, model_source_file
from .estimate.report import render_report


def write_build(compiled: CompiledPlan, out: str | Path) -> Path:
    from ..dsl import format_plan
    from ..schedules import schedule_to_json
    out = Path(out)
    (out / "stages").mkdir(parents=True, exist_ok=True)
    files = {"plan.plan": format_plan(resolved_plan(compiled, out)),
             "schedule.json": schedule_to_json(compiled.schedule, _metrics(compiled)),
             "report.md": render_report(compiled)}
    sim = compiled.estimates.simulation if compiled.estimates is not None else None
    if sim is not None:
        from ..schedules.render import SECONDS, chrome_trace_json
        files["trace.json"] = chrome_trace_json(sim, SECONDS)  # estimates are in s
    for st in compiled.stages:
        files[f"stages/stage_{st.index}.py"] = stage_source(st)
    for name, text in files.items():
        (out / name).write_text(text, encoding="utf-8")
    manifest = {
        "pipeplan": __version__, "torch": torch.__version__,
        "plan": {"path": compiled.plan.path, "sha256": _sha(compiled.plan.source_text)},
        "model_source": _source_entry(compiled),
        "capture": compiled.capture, "split": compiled.split_text,
        "stages": [{"index": st.index, "rank": st.rank, "file": f"stages/stage_{st.index}.py",
                    "inputs": [dataclasses.asdict(r) for r in st.inputs],
                    "outputs": [dataclasses.asdict(o) for o in st.outputs],
                    "params": list(st.param_names)} for st in compiled.stages],
        "tied": [dataclasses.asdict(t) for t in compiled.tied],
        "experts": [dataclasses.asdict(e) for e in compiled.experts],
        "files": {name: _sha(text) for name, text in sorted(files.items())},
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    return out


def resolved_plan(compiled: CompiledPlan, out: Path):
    """The plan with the chosen split pinned (rebuilding it gives the same stages) and the
    model file's, cost file's, weights' and outputs' paths made relative to the build
    directory, where this copy lives."""
    plan = compiled.plan
    if compiled.split_points:
        pinned = SplitSpec(kind="points", points=compiled.split_points)
        plan = dataclasses.replace(plan, pipeline=dataclasses.replace(plan.pipeline, split=pinned))
    if plan.pipeline.profile and not os.path.isabs(plan.pipeline.profile):
        rel = os.path.relpath(plan.resolve_path(plan.pipeline.profile, "pipeline.profile"),
                              out.resolve())
        plan = dataclasses.replace(plan, pipeline=dataclasses.replace(plan.pipeline, profile=rel))
    source = model_source_file(plan)
    where, _, cls = plan.model.source.rpartition(":")
    if source is not None and is_path_source(where) and not os.path.isabs(where):
        rel = os.path.relpath(source, out.resolve())
        plan = dataclasses.replace(plan, model=dataclasses.replace(plan.model,
                                                                   source=f"{rel}:{cls}"))
    if plan.model.weights and not os.path.isabs(plan.model.weights):  # the same, for weights
        rel = os.path.relpath(compiled.plan.resolve_path(plan.model.weights, "model.weights"),
                              out.resolve())
        plan = dataclasses.replace(plan, model=dataclasses.replace(plan.model, weights=rel))
    if is_folder_source(plan.model.source):  # a model folder, and text data's paths
        plan = dataclasses.replace(plan, model=dataclasses.replace(
            plan.model, source=_moved(plan, plan.model.source, out, "model.source")))
    d = plan.data
    if d.kind == "text":
        plan = dataclasses.replace(plan, data=dataclasses.replace(
            d, files=tuple(_moved(plan, f, out, "data.files") for f in d.files),
            tokenizer=_moved(plan, d.tokenizer, out, "data.tokenizer"),
            cache=_moved(plan, d.cache, out, "data.cache")))
    return _outputs_relative_to(plan, out)


def _outputs_relative_to(plan, out: Path):
    """train.log_dir and train.checkpoint.dir relative to the build directory, pointing where
    the plan's pointed (`pipeplan run BUILD/` writes where `pipeplan run PLAN` would)."""
    t = plan.train
    ckpt = t.checkpoint and dataclasses.replace(
        t.checkpoint, dir=_moved(plan, t.checkpoint.dir, out, "train.checkpoint.dir"))
    log_dir = t.log_dir and _moved(plan, t.log_dir, out, "train.log_dir")
    return dataclasses.replace(plan, train=dataclasses.replace(t, checkpoint=ckpt,
                                                               log_dir=log_dir))


def _moved(plan, path: str, out: Path, key: str) -> str:
    """A plan path at `key` (resolved by the plan's rule) relative to the build directory."""
    return path if os.path.isabs(path) else os.path.relpath(plan.resolve_path(path, key),
                                                            out.resolve())


def stage_source(st) -> str:
    inputs = ", ".join(f"{r.name} ({'batch' if r.source == 'batch' else f'stage {r.source}'})"
                       for r in st.inputs)
    outputs = ", ".join(f"{o.name} {o.dtype}{list(o.shape)}" for o in st.outputs)
    header = [f"# Stage {st.index} (pipeline rank {st.rank}): generated by pipeplan; read-only.",
              f"# blocks:  {', '.join(st.module_names)}",
              f"# inputs:  {inputs}", f"# outputs: {outputs}",
              f"# params:  {len(st.param_names)} tensors, original names "
              f"(e.g. {', '.join(st.param_names[:3])})",
              f"# forward: {st.flops / 1e9:.4g} GFLOP/microbatch, "
              f"{st.activation_bytes / 2 ** 20:.4g} MiB saved for backward", "",
              "import torch", "", ""]
    return "\n".join(header) + st.code.lstrip("\n")


def _metrics(compiled: CompiledPlan) -> dict:
    e = compiled.estimates
    if e is None or e.simulation is None:
        return {}
    return e.simulation.metrics()


def _source_entry(compiled: CompiledPlan) -> dict:
    path = model_source_file(compiled.plan)
    if path is None:
        return {"source": compiled.plan.model.source, "sha256": None}
    return {"source": compiled.plan.model.source, "file": str(path),
            "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()
