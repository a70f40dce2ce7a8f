"""The compiler: plan + model -> CompiledPlan (stage graphs, placement, schedule, estimates).

    from pipeplan.compiler import compile_plan, load_model
    compiled = compile_plan(plan)               # on the meta device: no weights allocated
    compiled = compile_plan(plan, model)        # stages hold `model`'s own parameters
"""
from .compiled import CompiledPlan, StageSpec, ValueRef, ValueSpec
from .driver import compile_plan
from .estimate.device import DeviceModel, device_model
from .estimate.predict import Prediction, predicted
from .capture.loading import load_model
from .capture.loss import reference_loss
from .estimate.report import render_summary
from .stages import move_stage


def compile_for_check(plan, compile=None):
    """What `pipeplan check` compiles: the model on meta, its initial weights checked drawable
    per module (init_rules.check_init: raises PlanError), then `compile` (plan, model) ->
    CompiledPlan, compile_plan by default (the CLI hands in the compile made before a
    launch: backends/runtime/source.py compile_checked)."""
    from .capture.init_rules import check_init

    model = load_model(plan, "meta")
    check_init(plan, model)
    return (compile or compile_plan)(plan, model)


def estimates_summary(plan) -> str:
    """`pipeplan check`'s estimate lines (with compile_plan): `compile_for_check`, summarised."""
    return render_summary(compile_for_check(plan))


__all__ = ["compile_plan", "load_model", "reference_loss", "estimates_summary",
           "compile_for_check", "render_summary", "move_stage", "CompiledPlan", "StageSpec", "ValueRef", "ValueSpec", "DeviceModel",
           "device_model", "predicted", "Prediction"]
