"""Stepping a Trainer the way ``fit`` does, for the benchmarks that time it, and reading a
process's CPU time.

``Trainer.submit`` with one step in flight ahead: the next step is sent before the current
one's result is waited for, so the driver's round trip is off the step; a step's time is
the time between consecutive results on the driver.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Sequence
from typing import Any

from piper_runtime import StepResult


def pipelined(trainer: Any, batches: Sequence[Any], **options: Any) -> list[tuple[float, StepResult]]:
    """Each batch's step, one in flight ahead: (seconds since the previous result, or since the
    first submission for the first, and the step's result). ``options`` go to ``submit``."""
    out: list[tuple[float, StepResult]] = []
    last = time.perf_counter()
    pending = trainer.submit(*batches[0], **options)
    for k in range(len(batches)):
        ahead = trainer.submit(*batches[k + 1], **options) if k + 1 < len(batches) else None
        result = pending.result()
        now = time.perf_counter()
        out.append((now - last, result))
        last, pending = now, ahead
    return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (all its threads; Linux)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def trainer_arguments(description: str, *, model: str = "mlp", steps: int) -> argparse.ArgumentParser:
    """A parser with the options of one Trainer's benchmark: ``--model``, ``--schedule``,
    ``--pp``, ``--microbatches`` and ``--steps`` (timed steps), for the caller to add to."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", default=model)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=steps)
    return parser
