"""torch.profiler's trace of a profiled step: the operators (and on a GPU the kernels) each
instruction ran, on one timeline with Piper's instructions (``ExecutionOptions.profile_kernels``).

The executor wraps each instruction of a profiled step in ``record_function("piper <id>")``
(``F.s0.mb1``: phase, segment, microbatch; ``send.v:...``), so the trace shows every
operator under the instruction that ran it. The profiler records every thread of the process
(the rank's stream threads too: ``profile_all_threads``), and a process has one profiler at
a time: the ranks of the ``local`` runtime, threads of one process, share one session. The
first rank to begin the step once every rank of the process has begun it starts it (a rank
still finishing the step before would put that step's operators in the trace) and is the one
to stop it (torch stops a profiler only on the thread that started it): it waits, boundedly,
for the others to end theirs, then returns the trace, which holds every rank of the process; the others return None. The
trace travels as Chrome trace JSON text (data).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
import time
from collections.abc import Iterator

import torch

LABEL = "piper "  # the prefix of an instruction's record_function label


class _Session:
    """The process's one profiler session (module doc)."""

    def __init__(self) -> None:
        self.changed = threading.Condition()
        self.profiler: torch.profiler.profile | None = None
        self.owner: int | None = None  # the thread that started it
        self.active = 0
        self.begun = 0  # ranks that began the profiled step

    def begin(self, cuda: bool, ranks: int, wait_s: float) -> None:
        """``ranks``: how many ranks of this process profile the step. The profiler starts
        once all of them have begun it (waiting at most ``wait_s``): a rank still finishing
        the step before would put that step's operators, under no instruction of this one,
        in the trace."""
        with self.changed:
            self.begun += 1
            self.changed.notify_all()
            deadline = time.monotonic() + wait_s
            while self.profiler is None and self.begun < ranks and time.monotonic() < deadline:
                self.changed.wait(deadline - time.monotonic())
            if self.profiler is None:
                from torch._C._profiler import _ExperimentalConfig

                activities = [torch.profiler.ProfilerActivity.CPU]
                if cuda:
                    activities.append(torch.profiler.ProfilerActivity.CUDA)
                self.profiler = torch.profiler.profile(
                    activities=activities, experimental_config=_ExperimentalConfig(profile_all_threads=True))
                self.profiler.__enter__()
                self.owner = threading.get_ident()
            self.active += 1

    def end(self, wait_s: float) -> str | None:
        with self.changed:
            self.active -= 1
            self.changed.notify_all()
            if threading.get_ident() != self.owner:
                return None
            deadline = time.monotonic() + wait_s
            while self.active > 0 and time.monotonic() < deadline:
                self.changed.wait(deadline - time.monotonic())
            profiler, self.profiler, self.owner, self.begun = self.profiler, None, None, 0
        assert profiler is not None
        profiler.__exit__(None, None, None)
        fd, path = tempfile.mkstemp(prefix="piper-kernels-", suffix=".json")
        os.close(fd)
        try:
            profiler.export_chrome_trace(path)
            with open(path, encoding="utf-8") as f:
                return f.read()
        finally:
            os.unlink(path)


_session = _Session()


@contextlib.contextmanager
def kernel_trace(active: bool, cuda: bool, wait_s: float, ranks: int = 1) -> Iterator[list[str | None]]:
    """Profile the block when ``active``; the list it yields holds the trace afterwards (or
    None: not profiled, or another rank of this process returns it). ``ranks``: the ranks of
    this process (``_Session.begin``)."""
    out: list[str | None] = [None]
    if not active:
        yield out
        return
    _session.begin(cuda, ranks, wait_s)
    try:
        yield out
    finally:
        out[0] = _session.end(wait_s)
