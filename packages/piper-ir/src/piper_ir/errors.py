"""One error hierarchy for every Piper package.

Each error carries what a user needs to find the culprit: the directive (and where the user
wrote it), the nodes, the ranks and the step involved. ``str(err)`` renders all of it.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence
from typing import ClassVar


class PiperError(Exception):
    """Base of every error Piper raises on purpose."""

    def __init__(
        self,
        message: str,
        *,
        directive: str | None = None,
        nodes: Sequence[str] = (),
        ranks: Sequence[int] = (),
        step: int | None = None,
    ) -> None:
        self.message = message
        self.directive = directive
        self.nodes = tuple(nodes)
        self.ranks = tuple(ranks)
        self.step = step
        super().__init__(self._render())

    def _render(self) -> str:
        parts = [self.message]
        if self.directive:
            parts.append(f"directive: {self.directive}")
        if self.nodes:
            shown = ", ".join(self.nodes[:8])
            more = f" (+{len(self.nodes) - 8} more)" if len(self.nodes) > 8 else ""
            parts.append(f"nodes: {shown}{more}")
        if self.ranks:
            parts.append(f"ranks: {', '.join(map(str, self.ranks))}")
        if self.step is not None:
            parts.append(f"step: {self.step}")
        return "\n  ".join(parts)

    def __reduce__(self):  # keep the fields when the error crosses a process boundary
        return (
            _rebuild,
            (type(self), self.message, self.directive, self.nodes, self.ranks, self.step),
        )


def _rebuild(cls, message, directive, nodes, ranks, step):
    return cls(message, directive=directive, nodes=nodes, ranks=ranks, step=step)


class ValidationError(PiperError):
    """An IR value breaks a structural invariant (dangling edge, cycle, bad placement)."""


class SerializationError(PiperError):
    """A JSON document is not a Piper IR value of a version this code reads."""


class CaptureError(PiperError):
    """The model cannot be captured into a training DAG (e.g. compute outside annotations)."""


class DirectiveError(PiperError):
    """A directive is malformed or cannot be applied to the graph."""


class SchedulingError(PiperError):
    """The scheduler cannot build or verify a per-rank plan."""


class DeadlockError(SchedulingError):
    """The plan would deadlock: mismatched send/receive sequences or a wait cycle."""


class MemoryPlanError(PiperError):
    """Memory planning failed (e.g. the estimate exceeds the per-rank budget)."""


class ExecutionError(PiperError):
    """Running a plan failed on a worker (an exception, a dead worker or a timeout).

    ``transient``: whether running the same steps again on new workers may pass. A worker
    that died, hung or raised may have met a passing fault (a lost node, a peer's death seen
    as a broken connection), so by default it may; a kind whose cause stays (``NumericalError``,
    ``StorageError``) says it cannot, and ``fit`` does not restart for it."""

    transient: ClassVar[bool] = True


class HangError(ExecutionError):
    """A rank made no progress for the run's bound: names the rank, the instruction it is
    stuck in and what its peers were doing."""


class NumericalError(ExecutionError):
    """A loss or gradient became NaN or infinite: names the step, microbatch and rank where
    it first appeared. Not transient: the same data finds the same NaN."""

    transient = False


class StorageError(ExecutionError):
    """Writing to storage failed for a reason that running again does not mend: no space left
    on the device (or in the quota), no permission, a read-only filesystem, a file too large.
    The message says the cause first, then what was being written (``StorageError.of``)."""

    transient = False
    ERRNOS: ClassVar[frozenset[int]] = frozenset(
        {errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS, errno.EFBIG}
    )

    @classmethod
    def of(cls, err: OSError, doing: str, *, ranks: Sequence[int] = (), step: int | None = None) -> StorageError | None:
        """``"no space left on device <doing>"`` for an ``OSError`` of one of ``ERRNOS``;
        ``None`` for another (a reset connection, a stale file handle may pass)."""
        if err.errno not in cls.ERRNOS:
            return None
        cause = os.strerror(err.errno)
        return cls(f"{cause[:1].lower()}{cause[1:]} {doing}", ranks=ranks, step=step)


class ClusterError(PiperError):
    """The cluster cannot run the program as asked: an unreachable Ray address, fewer CPUs or
    GPUs than the ranks need, a backend that cannot run there (no GPU, no cupy)."""


class CheckpointError(PiperError):
    """A checkpoint cannot be written or read as asked: none to resume from, a partial or
    corrupt one, one from another model (names or shapes differ), or a directory that already
    holds checkpoints of another run."""
