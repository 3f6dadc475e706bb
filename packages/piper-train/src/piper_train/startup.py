"""How long a run took to reach its first step, from the moment its process started.

``process_seconds()`` reads the process's start from ``/proc`` (Linux: ``/proc/self/stat``'s
start time against ``/proc/uptime``), so the figure includes the interpreter and every import,
what a user waits for; elsewhere it counts from this module's import. ``FirstStepLine`` is the
sink that says it once, at the first step: the run's own timing line.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

_IMPORTED = time.monotonic()


def process_seconds() -> float:
    """Seconds since this process started (module doc)."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))  # field 22: start time in ticks
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _IMPORTED


class FirstStepLine:
    """A sink that says, at the first step, how long after the process started it ended."""

    def __init__(self, say: Callable[[str], None]) -> None:
        self.say = say
        self.done = False

    def on_step(self, metrics: Any, result: Any) -> None:
        if not self.done:
            self.done = True
            self.say(f"first step done {process_seconds():.1f} s after the process started")

    def on_eval(self, metrics: Any) -> None:
        pass

    def close(self) -> None:
        pass
