"""Find a local run's rank processes from outside (tests that signal or inspect a rank)."""
from __future__ import annotations

import os
import re
from pathlib import Path


def ranks_of(launcher: int) -> dict[int, int]:
    """rank -> pid of the launcher's rank processes: its descendants (forked from its fork
    server) named "pipeplan r<rank>" (launcher.RANK_NAME), from /proc."""
    parent, names = {}, {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        name, rest = stat.split(" (", 1)[1].rsplit(")", 1)
        parent[int(pid)], names[int(pid)] = int(rest.split()[1]), name
    below, out = {launcher}, {}
    grew = True
    while grew:
        more = {p for p, pp in parent.items() if pp in below} - below
        below |= more
        grew = bool(more)
    for pid in below:
        m = re.fullmatch(r"pipeplan r(\d+)", names.get(pid, ""))
        if m:
            out[int(m.group(1))] = pid
    return out
