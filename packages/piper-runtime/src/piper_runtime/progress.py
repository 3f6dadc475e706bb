"""Per-rank progress, for the driver's hung-rank watchdog.

A worker records, for each of its threads, the instruction it is in (running it, or waiting
for the events it needs) and since when, and when the rank last made progress (an
instruction started or ended). The driver reads a ``RankProgress`` snapshot while a step is
in flight (``RankWorker.progress``, on a concurrency group of its own so the read does not
queue behind the step) and, when a rank has made no progress for the run's bound, names it:
``hang_report`` follows the ranks blocked in a receive or a collective to the rank they wait
for, and says what every other rank was doing.

Durations are measured on the worker's own monotonic clock, so ranks on other machines need
no clock agreement with the driver.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence

import attrs

from piper_ir import BUCKET_KINDS, Instruction, NodeKind

_WAITING_KINDS = frozenset({NodeKind.RECV, NodeKind.SEND} | BUCKET_KINDS)


@attrs.frozen
class Activity:
    """One thread of a rank: the instruction it is in, whether it runs it or still waits for
    its events, and for how many seconds."""

    instruction: str
    label: str  # Instruction.short()
    kind: str
    peer: int | None
    microbatch: int | None
    communicator: str | None
    waiting: bool  # for the events of earlier instructions (not yet running)
    seconds: float

    def describe(self) -> str:
        what = f"waiting for the inputs of {self.instruction} ({self.label})" if self.waiting else (
            f"in {self.kind} {self.instruction} ({self.label})"
        )
        where = []
        if self.microbatch is not None:
            where.append(f"microbatch {self.microbatch}")
        if self.peer is not None and not self.waiting:
            where.append(("from" if self.kind == "recv" else "to") + f" rank {self.peer}")
        detail = f", {', '.join(where)}" if where else ""
        return f"{what}{detail} for {self.seconds:.1f} s"


@attrs.frozen
class RankProgress:
    """What one rank was doing when asked: its step, whether that step is running, seconds
    since it last made progress, instructions done out of its plan's, and each busy thread."""

    rank: int
    step: int
    running: bool
    idle_s: float
    done: int
    total: int
    activities: tuple[Activity, ...] = ()

    def describe(self) -> str:
        if not self.running:
            return f"rank {self.rank}: not in a step (step {self.step} done)"
        if not self.activities:
            return f"rank {self.rank}: between instructions ({self.done}/{self.total} done)"
        acts = "; ".join(a.describe() for a in self.activities)
        return f"rank {self.rank}: {acts} ({self.done}/{self.total} instructions done)"


class Progress:
    """A worker's progress record (module doc); thread-safe, cheap to update."""

    def __init__(self, rank: int, instructions: Sequence[Instruction]) -> None:
        self.rank = rank
        self.instructions = instructions
        self._lock = threading.Lock()
        self._step = 0
        self._running = False
        self._last = time.monotonic()
        self._done = 0
        # thread -> a stack of (index, waiting, since): a thread waiting for an instruction's
        # events may carry out a lazy receive meanwhile (piper_runtime.rank.streams).
        self._current: dict[int, list[tuple[int, bool, float]]] = {}

    def begin_step(self, step: int) -> None:
        with self._lock:
            self._step, self._running, self._done = step, True, 0
            self._current.clear()
            self._last = time.monotonic()

    def end_step(self) -> None:
        with self._lock:
            self._running = False
            self._current.clear()
            self._last = time.monotonic()

    def waiting(self, k: int) -> None:
        """This thread waits for the events instruction ``k`` needs."""
        now = time.monotonic()
        with self._lock:
            self._current.setdefault(threading.get_ident(), []).append((k, True, now))

    def started(self, k: int) -> None:
        now = time.monotonic()
        with self._lock:
            stack = self._current.setdefault(threading.get_ident(), [])
            if stack and stack[-1][0] == k:
                stack.pop()
            stack.append((k, False, now))
            self._last = now

    def finished(self, k: int) -> None:
        now = time.monotonic()
        with self._lock:
            stack = self._current.get(threading.get_ident(), [])
            while stack and stack[-1][0] == k:
                stack.pop()
            self._done += 1
            self._last = now

    def snapshot(self) -> RankProgress:
        now = time.monotonic()
        with self._lock:
            current = sorted((stack[-1] for stack in self._current.values() if stack), key=lambda c: c[2])
            acts = []
            for k, waiting, since in current:
                ins = self.instructions[k]
                acts.append(
                    Activity(ins.id, ins.short(), ins.kind.value, ins.peer, ins.microbatch, ins.communicator,
                             waiting, now - since)
                )
            return RankProgress(self.rank, self._step, self._running, now - self._last, self._done,
                                len(self.instructions), tuple(acts))


def _blocked_on(p: RankProgress, progress: Mapping[int, RankProgress], groups: Mapping[str, Sequence[int]]) -> set[int]:
    """The ranks ``p`` waits for: the peers of the receives it is in, the members of a group
    it is in a collective of that are not in that collective themselves; empty when it is
    running something of its own (compute, the optimizer)."""
    peers: set[int] = set()
    for a in p.activities:
        if a.waiting:
            continue
        if a.kind == NodeKind.RECV.value and a.peer is not None:
            peers.add(a.peer)
        elif a.kind in {k.value for k in BUCKET_KINDS} and a.communicator in groups:
            for r in groups[a.communicator]:
                other = progress.get(r)
                if r != p.rank and (other is None or all(b.communicator != a.communicator for b in other.activities)):
                    peers.add(r)
        elif a.kind not in {k.value for k in _WAITING_KINDS}:
            return set()
    return peers


def culprit(
    progress: Mapping[int, RankProgress], groups: Mapping[str, Sequence[int]], finished: Sequence[int] = ()
) -> int:
    """The rank to blame among the unfinished ones (``progress``: the snapshots of those that
    answered): the longest-idle rank, or, when it is blocked on another rank, the rank at the
    end of that chain (stopping at a rank that did not answer, one that is running its own
    work, one waiting only for ranks that finished their step, or a cycle)."""
    running = [p for p in progress.values() if p.running]
    if not running:
        return min(progress)
    rank = max(running, key=lambda p: (p.idle_s, -p.rank)).rank
    seen = {rank}
    while True:
        p = progress[rank]
        ahead = sorted(_blocked_on(p, progress, groups) - seen - set(finished))
        if not ahead:
            return rank
        missing = [r for r in ahead if r not in progress]
        if missing:
            return missing[0]
        rank = ahead[0]
        seen.add(rank)


def hang_report(
    progress: Mapping[int, RankProgress],
    silent: Sequence[int],
    finished: Sequence[int],
    groups: Mapping[str, Sequence[int]],
    timeout_s: float,
) -> tuple[int, str | None, str]:
    """``(rank, instruction, message)`` for a step whose ranks stopped making progress:
    ``progress`` of the ranks that answered, ``silent`` those that did not, ``finished``
    those whose step is done."""
    rank = silent[0] if silent and not progress else culprit(progress, groups, finished)
    p = progress.get(rank)
    if p is None:
        head = (f"rank {rank} made no progress for {timeout_s:g} s and does not answer (its process is busy "
                "outside Python, or wedged)")
        node = None
    else:
        running = [a for a in p.activities if not a.waiting]
        where = (running or list(p.activities) or [None])[0]
        node = where.instruction if where else None
        head = (f"rank {rank} is stuck: no progress for {p.idle_s:.1f} s (bound {timeout_s:g} s), "
                + (where.describe() if where else f"between instructions ({p.done}/{p.total} done)"))
    others = [progress[r].describe() for r in sorted(progress) if r != rank]
    others += [f"rank {r}: does not answer" for r in silent if r != rank]
    others += [f"rank {r}: finished its step" for r in finished]
    return rank, node, head + ("\n  peers: " + "\n         ".join(others) if others else "")
