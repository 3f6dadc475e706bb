"""How many steps ``fit`` sends to the workers in one call: a fixed number, or ``"auto"``.

Why: every call costs CPU beside the steps it carries: Ray's hand-over on each rank
(returning one result, taking the next call, about a millisecond on a 2-core host) and the
driver's and Ray's daemons' share of sending and gathering it. Where those share cores with
the ranks, as on a CPU host, they take them from the step: on the 2-core benchmark machine
a 140 ms pipeline step ran 4% faster two per call and 5% faster four per call
(docs/benchmarks.md). Several steps in one call pay it once. The price is granularity: a
call's results arrive together, and a failure fails the call.

``"auto"`` (tf.keras has ``steps_per_execution="auto"`` for the same reason) sends single
steps while it measures, then as many steps per call as fit in about ``AUTO_CALL_S`` at
the measured pace (half a second), at most ``AUTO_MAX_STEPS``, and no more batches than
``AUTO_CALL_BYTES`` hold (the first always goes): a model whose step takes half a second or
more runs one step per call; a 140 ms step runs three per call and a 5 ms step sixteen, so
results arrive in bursts of at most about half a second. The pace is the median of the
latest per-step times (each call's time over its steps), so one slow step (an evaluation's
pause, a checkpoint) does not swing it.
"""

from __future__ import annotations

import statistics
from collections import deque

AUTO = "auto"
AUTO_CALL_S = 0.5  # an automatic call carries about this much work
AUTO_CALL_BYTES = 64 << 20  # ... and batches of at most this many bytes (a call and the one
# ahead of it are in the workers' memory at once)
AUTO_MAX_STEPS = 16
AUTO_MEASURED_STEPS = 3  # single steps first: the first includes the workers' warm-up
_PACE_WINDOW = 5  # per-step times the pace is the median of


def parse_steps_per_call(text: str) -> int | str:
    """``--steps-per-call``'s value: a positive number or ``auto`` (``ValueError`` otherwise)."""
    if text == AUTO:
        return AUTO
    value = int(text)
    if value < 1:
        raise ValueError(f"must be >= 1 or auto, got {text}")
    return value


class CallSize:
    """The size of ``fit``'s next call (module doc). ``steps_per_call``: a number >= 1, or
    ``"auto"``; ``single``: always one step (a step that may be undone must come back before
    the next one runs: ``on_nan="skip-step"``)."""

    def __init__(self, steps_per_call: int | str, single: bool = False) -> None:
        if steps_per_call != AUTO and not (isinstance(steps_per_call, int) and steps_per_call >= 1):
            raise ValueError(f"steps_per_call must be >= 1 or 'auto', got {steps_per_call!r}")
        self.auto = steps_per_call == AUTO and not single
        self.fixed = 1 if single or steps_per_call == AUTO else int(steps_per_call)  # type: ignore[arg-type]
        self.observed = 0  # steps whose time was seen
        self.recent: deque[float] = deque(maxlen=_PACE_WINDOW)

    def next(self) -> int:
        """How many steps the next call may carry (it may carry fewer: the data, the end of
        the run, an evaluation or a checkpoint end it earlier)."""
        if not self.auto or self.observed < AUTO_MEASURED_STEPS or not self.recent:
            return self.fixed
        pace = statistics.median(self.recent)
        return max(1, min(AUTO_MAX_STEPS, int(AUTO_CALL_S / pace) if pace > 0 else AUTO_MAX_STEPS))

    def full(self, nbytes: int) -> bool:
        """Whether an automatic call whose batches hold ``nbytes`` bytes takes no more (a
        fixed size is the caller's choice, whatever its batches weigh)."""
        return self.auto and nbytes >= AUTO_CALL_BYTES

    def observe(self, seconds_per_step: float, steps: int) -> None:
        """A call of ``steps`` steps took ``seconds_per_step`` each (the first step's time,
        which includes warm-up, is not part of the pace)."""
        if self.observed > 0:
            self.recent.append(seconds_per_step)
        self.observed += steps
