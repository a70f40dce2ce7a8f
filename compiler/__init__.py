"""The compiler: plan + model -> CompiledPlan (stage graphs, placement, schedule, estimates)."""
from .compiled import CompiledPlan, StageSpec, ValueRef, ValueSpec
from .driver import compile_plan
from .loading import load_model
from .loss import reference_loss

__all__ = ["compile_plan", "load_model", "reference_loss", "CompiledPlan", "StageSpec",
           "ValueRef", "ValueSpec"]
