"""ScheduleError: a schedule that cannot be built, loaded, or would not run."""
from __future__ import annotations

from ..errors import PipeplanError


class ScheduleError(PipeplanError):
    """Bad schedule input or a schedule that fails verification; str(e) is one line."""
