"""The plan language: grammar, typed AST with source spans, semantic checks, errors.

    from pipeplan.dsl import load_plan, parse_plan, format_plan, check_plan, PlanError
"""
from .ast import Plan, Span
from .checks import check_plan
from ..schedules.kinds import KINDS, KINDS_TABLE
from .errors import Diagnostic, PlanError
from .format import format_plan
from .layout import RankCoords, format_layout, mesh_layout
from .load import load_plan, parse_plan
from .report import check_report

__all__ = ["Plan", "Span", "PlanError", "Diagnostic", "load_plan", "parse_plan", "format_plan",
           "check_plan", "KINDS", "KINDS_TABLE", "mesh_layout", "format_layout",
           "RankCoords", "check_report"]
