"""The run's own time-to-first-step line (piper_train.startup)."""

from __future__ import annotations

import subprocess
import sys
import time

from piper_train.startup import FirstStepLine, process_seconds


def test_process_seconds_count_from_the_process_start():
    """A child that sleeps 0.5 s before asking reports at least that long, and not minutes."""
    code = "import time; time.sleep(0.5); from piper_train.startup import process_seconds; print(process_seconds())"
    reported = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert 0.5 <= reported < 60
    before = process_seconds()
    time.sleep(0.05)
    assert process_seconds() >= before + 0.04


def test_the_line_is_said_once_at_the_first_step():
    said: list[str] = []
    line = FirstStepLine(said.append)
    line.on_step(object(), object())
    line.on_step(object(), object())
    assert len(said) == 1 and said[0].startswith("first step done ") and said[0].endswith("s after the process started")
