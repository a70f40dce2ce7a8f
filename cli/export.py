"""`pipeplan export CHECKPOINT -o OUT [--plan PLAN]`: a run's trained weights out as
safetensors (backends/state/export.py writes them)."""
from __future__ import annotations

from typing import Optional

from ..backends.state import export as exporting


def add_commands(sub) -> None:
    p = sub.add_parser("export", help="write a run's trained weights as safetensors "
                                      "(a Hugging Face folder for transformers models)",
                       description=exporting.__doc__.split("\n\n")[1])
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
    plan: Optional[object] = None
    if args.plan:
        from ..dsl.load import load_plan

        plan = load_plan(args.plan, args.set)
    print(f"pipeplan: exported {exporting.export(args.checkpoint, args.output, plan)}", flush=True)
    return 0
