"""The plan text's bounds, checked on the raw text before the parser runs.

The LALR parse costs tens of microseconds per value (a 400k-element list took a minute and
800 MB), so one regular-expression pass counts the values of the whole plan and the elements
of each list and refuses the first list or plan over its bound (dsl/limits.py) at its
line:col, in milliseconds. Strings and comments are skipped as the grammar skips them; what
the pass does not understand it leaves to the parser.
"""
from __future__ import annotations

import re

from .ast import Span
from .errors import Diagnostic, PlanError
from .limits import MAX_LIST_ITEMS, MAX_PLAN_VALUES

# A string, a comment, one punctuation character, or a run of anything else (a value).
_TOKEN = re.compile(r'"(?:[^"\\\n]|\\.)*"|#[^\n]*|[\[\](){},=;]|[^\s\[\](){},=;"#]+')
_OPEN = {"[": "]", "(": ")", "{": "}"}


def check_bounds(text: str, file: str) -> None:
    """Raise PlanError at the first list with more than MAX_LIST_ITEMS elements, or at the
    value past MAX_PLAN_VALUES; cheap (one regex pass, no tree)."""
    stack: list[list] = []  # [opening char, its offset, commas seen directly inside]
    values = 0
    for m in _TOKEN.finditer(text):
        tok = m.group()
        c = tok[0]
        if c in _OPEN:
            stack.append([c, m.start(), 0])
        elif c in "])}":
            if stack and _OPEN[stack[-1][0]] == c:
                stack.pop()
        elif c == ",":
            if stack and stack[-1][0] == "[":
                stack[-1][2] += 1
                if stack[-1][2] >= MAX_LIST_ITEMS:
                    _refuse(text, file, stack[-1][1], f"list has more than {MAX_LIST_ITEMS:,} "
                            "elements", f"a plan list holds at most {MAX_LIST_ITEMS:,} values "
                            "(docs/plan-language.md, Limits)")
        elif c != "#" and c not in "=;":
            values += 1
            if values > MAX_PLAN_VALUES:
                _refuse(text, file, m.start(), f"plan has more than {MAX_PLAN_VALUES:,} values",
                        f"a plan holds at most {MAX_PLAN_VALUES:,} names, numbers and strings "
                        "(docs/plan-language.md, Limits); is this the right file?")


def _refuse(text: str, file: str, offset: int, message: str, hint: str) -> None:
    line = text.count("\n", 0, offset) + 1
    col = offset - text.rfind("\n", 0, offset)
    raise PlanError([Diagnostic(message, Span(file, line, col, line, col + 1), hint)], text)
