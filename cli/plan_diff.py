"""`pipeplan plan-diff A.plan B.plan [--checkpoint DIR]`: what changes from plan A to plan B.

Both plans are compiled on the meta device (as `pipeplan run` does before
launch); the rows where they differ are printed side by side: the mesh, ZeRO,
the schedule (kind, virtual stages, microbatches), the split, the stage
placement, the expert placement, and each rank's estimates (memory and
FLOPs per step). With `--checkpoint DIR` (a checkpoint folder, or a
train.checkpoint.dir holding step_* folders: the newest), it says whether
that checkpoint loads under B (else every reason it does not, one line each)
and what is resharded on load.
"""
from __future__ import annotations

import os

from ..errors import PipeplanError

MIB = 1 << 20


def _mesh(m: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in m.items())


def plan_rows(compiled) -> dict[str, str]:
    from ..backends.state.checkpoint.manifest import plan_summary

    """Item -> its value in words, for one compiled plan."""
    plan = compiled.plan
    s = plan_summary(plan, compiled.split_points)
    rows = {"mesh": _mesh(s["mesh"]), "zero": str(s["zero"]),
            "schedule": f"{s['schedule']} (virtual {s['virtual']})",
            "microbatches": str(s["microbatches"]),
            "split": ", ".join(s["split"]) or "(one stage)",
            "stage placement": " ".join(f"s{i}->r{r}" for i, r in
                                       enumerate(compiled.schedule.stage_to_rank)),
            "experts": "; ".join(f"{e.module}: " + " ".join(
                f"ep{k}={list(ix)}" for k, ix in enumerate(e.shards))
                for e in compiled.experts) or "(none)",
            "precision": s["precision"], "optimizer": plan.train.optimizer.name}
    est = compiled.estimates
    if est is not None:
        rows["predicted bubble"] = f"{est.bubble:.3f}"
        for r in est.ranks:
            rows[f"rank {r.rank} estimate"] = (f"{r.total_bytes / MIB:.2f} MiB, "
                                               f"{r.flops / 1e9:.3f} GFLOP/step")
    return rows


def side_by_side(a: dict[str, str], b: dict[str, str], names=("A", "B")) -> list[str]:
    """The rows that differ (a missing row reads '-'), aligned in three columns."""
    keys = list(a) + [k for k in b if k not in a]
    diff = [(k, a.get(k, "-"), b.get(k, "-")) for k in keys if a.get(k) != b.get(k)]
    if not diff:
        return ["the plans compile to the same mesh, split, schedule and placement"]
    wk = max(len(k) for k, _, _ in diff)
    wa = max(len(names[0]), *(len(x) for _, x, _ in diff))
    lines = [f"{'':{wk}}  {names[0]:{wa}}  {names[1]}"]
    lines += [f"{k:{wk}}  {x:{wa}}  {y}" for k, x, y in diff]
    same = [k for k in keys if a.get(k) == b.get(k)]
    if same:
        lines.append("same: " + ", ".join(same))
    return lines


def _checkpoint_folder(path: str) -> str:
    from ..backends.state.checkpoint.store import newest

    if os.path.isfile(os.path.join(path, "manifest.json")):
        return path
    found = newest(path)
    if found is None:
        raise PipeplanError(f"checkpoint {path}: no complete checkpoint (step_* folder with a "
                            f"manifest.json) there")
    return found


def checkpoint_lines(folder: str, compiled) -> list[str]:
    """Whether the checkpoint in `folder` loads under the compiled plan, and what reshards."""
    from ..backends.state.checkpoint import parameter_shapes
    from ..backends.state.checkpoint.manifest import incompatibilities, plan_summary

    from ..backends.state.checkpoint.verify import verify_offering

    try:
        manifest = verify_offering(folder, "--checkpoint {}")
    except PipeplanError as e:  # damaged, or would run code: it does not load
        return [f"checkpoint {folder} does NOT load under B:"] + [
            f"  {line}" for line in str(e).splitlines()]
    plan = compiled.plan
    problems = incompatibilities(manifest, plan, parameter_shapes(compiled)[0])
    head = f"checkpoint {folder} (step {manifest.get('step')})"
    if problems:
        return [f"{head} does NOT load under B:"] + [f"  - {p}" for p in problems]
    saved, now = manifest["plan"], plan_summary(plan, compiled.split_points)
    moves = [f"{k} {saved['mesh'].get(k, 1)} -> {now['mesh'][k]}" for k in now["mesh"]
             if saved["mesh"].get(k, 1) != now["mesh"][k]]  # (cp: 1 in older manifests)
    moves += [f"{k} {saved.get(k)} -> {now[k]}" for k in ("zero", "schedule", "virtual",
                                                         "microbatches", "precision")
              if saved.get(k) != now[k]]
    if saved.get("split") != now["split"]:
        moves.append("split " + (", ".join(saved.get("split") or []) or "(one stage)")
                     + " -> " + (", ".join(now["split"]) or "(one stage)"))
    lines = [f"{head} loads under B: {len(manifest['parameters'])} parameters and their "
             f"optimizer state by name"]
    if moves:
        lines.append("  resharded on load: " + "; ".join(moves))
        lines.append("  RNG states are not restored (another plan)")
    else:
        lines.append("  the same layout: nothing is resharded")
    return lines


def plan_diff(a_path: str, b_path: str, checkpoint: str | None = None) -> list[str]:
    from ..backends.runtime.source import load_source

    compiled = []
    for path in (a_path, b_path):
        source = load_source(path, [], None)
        compiled.append(source.compile(source.plan, None))  # on meta, as every rank will
    lines = [f"A = {a_path}", f"B = {b_path}"]
    lines += side_by_side(plan_rows(compiled[0]), plan_rows(compiled[1]))
    if checkpoint:
        lines += checkpoint_lines(_checkpoint_folder(checkpoint), compiled[1])
    return lines


def add_commands(sub) -> None:
    p = sub.add_parser("plan-diff", help="what changes from plan A to plan B (and whether a "
                       "checkpoint loads under B)", description=__doc__.split("\n\n")[1])
    p.add_argument("a", help="plan A (a plan file or build directory)")
    p.add_argument("b", help="plan B")
    p.add_argument("--checkpoint", metavar="DIR",
                   help="a checkpoint folder, or a train.checkpoint.dir (its newest)")
    p.set_defaults(func=_cmd)


def _cmd(args) -> int:
    lines = plan_diff(args.a, args.b, args.checkpoint)
    print("\n".join(lines))
    return 1 if any("does NOT load" in line for line in lines) else 0
