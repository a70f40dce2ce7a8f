"""`pipeplan export CHECKPOINT -o OUT [--plan PLAN]`: the arguments; backends/state/export.py
writes the weights (imported when the command runs, so `--help` needs no torch)."""
from __future__ import annotations

from typing import Optional

DESCRIPTION = """Write a run's trained weights as safetensors. Without --plan: OUT (a .safetensors
file, else OUT/model.safetensors) holds the stored parameters under their names. With
--plan (the plan that trained it): names and shapes are checked against the plan's model,
its buffers are added, and a Hugging Face model is written as a folder that
from_pretrained(OUT) loads."""


def add_commands(sub) -> None:
    p = sub.add_parser("export", help="write a run's trained weights as safetensors "
                                      "(a Hugging Face folder for transformers models)",
                       description=DESCRIPTION)
    p.add_argument("checkpoint", help="a checkpoint folder (step_N) or a run's checkpoint.dir "
                                      "(its newest step)")
    p.add_argument("-o", "--output", required=True, metavar="OUT",
                   help="a folder, or a .safetensors file (without --plan or for non-HF models)")
    p.add_argument("--plan", help="the plan that trained it: check names and shapes against its "
                                  "model, add buffers, write a Hugging Face folder for HF models")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a plan value, as for run")
    p.set_defaults(func=_cmd_export)


def _cmd_export(args) -> int:
    from ..backends.state.export import export

    plan: Optional[object] = None
    if args.plan:
        from ..dsl.load import load_plan

        plan = load_plan(args.plan, args.set)
    print(f"pipeplan: exported {export(args.checkpoint, args.output, plan)}", flush=True)
    return 0
