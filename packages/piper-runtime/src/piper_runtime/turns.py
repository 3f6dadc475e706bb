"""Steps in call order, while the next call gets ready beside the running one.

A rank runs its training steps on a concurrency group of two threads (``pool.STEPS``), so
Ray hands the next step's call over, deserializes its batch and the worker splits it into
microbatches while the step before is still running; the call then waits for its *turn*
and starts the moment the step before ends. A sequential actor would do all of that after
the step before had returned: 2-7 ms per step on a 2-core machine (more with larger
batches), the whole of a small model's lead over ``torch.distributed.pipelining``.

The driver numbers its step calls 1, 2, ... per runtime; a worker's turns start over at
every ``setup``. A call whose predecessor has not arrived within the bound is an error: the
predecessor was never sent, and waiting longer would only hang (once it has arrived, its
own waits are bounded and the driver's watchdog watches the step).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from piper_ir import ExecutionError


class Turns:
    """Runs numbered calls one at a time in number order (module doc)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._done = 0  # every call up to this number has finished
        self._arrived: set[int] = set()
        self._cond = threading.Condition()

    @contextmanager
    def turn(self, number: int, timeout_s: float) -> Iterator[None]:
        """Wait until every call numbered below ``number`` has finished, then hold the turn;
        the turn passes on when the block ends, raising or not."""
        with self._cond:
            if number <= self._done or number in self._arrived:
                raise ExecutionError(f"rank {self.rank}: step call {number} arrived twice", ranks=(self.rank,))
            self._arrived.add(number)
            self._cond.notify_all()
            deadline = time.monotonic() + timeout_s
            while self._done != number - 1:
                if number - 1 not in self._arrived and time.monotonic() > deadline:
                    self._arrived.discard(number)
                    raise ExecutionError(
                        f"rank {self.rank}: step call {number - 1} did not arrive within {timeout_s:g} s "
                        f"of call {number}",
                        ranks=(self.rank,),
                    )
                self._cond.wait(0.05)
        try:
            yield
        finally:
            with self._cond:
                self._arrived.discard(number)
                self._done = number
                self._cond.notify_all()
