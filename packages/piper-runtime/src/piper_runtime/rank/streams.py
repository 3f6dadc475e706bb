"""Run one rank's plan with one thread per logical stream.

Each stream's instructions (``RankPlan.stream_order``) run in plan order on a host thread of
their own (a *lane*), inside the backend's ``lane(stream)`` context (CUDA: the stream is
current); an instruction first waits for the events in its ``waits``, which the instructions
of other lanes record once issued: the host side of the event first (the producer has issued
its work), then its device side (``Event.wait_device``: on CUDA the lane's stream waits for
the producer's; on the CPU, where issued work is done, nothing). Gloo and torch kernels
release the GIL, so communication really proceeds while another lane computes. The lanes and
events come from a ``piper_runtime.backends.base.Streams`` (host-only ones by default).

Point-to-point transfers are asynchronous (``Communicator.send``/``recv`` return at
once), so they do not get threads of their own, which would only add a wake-up to the
critical path of every message: a send runs on the lane of the instruction that produced its
value, right after it, and a receive is *lazy*, carried out by the first thread that needs its
value. (Only the transfers of a stream that holds nothing else are moved; in a stream that
also computes, stream order is what connects them to their readers.)

The two chunks of one overlapped slot (the same ``Instruction.overlap`` number, DualPipe's
forward + backward pair, each with the loss pass and the sends of its microbatch) run
concurrently, the backward side on a helper thread: while one chunk waits in its all-to-all
the other computes. The helper enters the same lane context (one stream: a backend that
gives the two sides streams of their own must order them after the lane's earlier work).

Deadlock freedom carries over from the sequential order the verifier proved: every event
points to an earlier instruction of the list and each lane keeps list order, so the earliest
unfinished instruction of a rank is always runnable, exactly as in the sequential run (a
transfer never depends on another transfer of its own stream except through channel order,
which the sends keep by all moving to one lane and the receives by being posted in list
order). What must not happen is two threads issuing collectives on one communicator (their
order could differ between ranks; point-to-point messages are matched by communicator and
peer instead): ``lanes_share_a_communicator`` finds plans where a collective communicator is
used by more than one lane, which the worker then runs sequentially.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from functools import partial

from piper_ir import POINT_TO_POINT_KINDS, Instruction, NodeKind, Phase
from piper_runtime.backends.base import Streams
from piper_runtime.backends.host import HostStreams

POLL_S = 0.05


class _Aborted(Exception):
    """Another thread failed: stop quietly, the first failure is what gets reported."""


_P2P = POINT_TO_POINT_KINDS


def assign_lanes(instructions: Sequence[Instruction]) -> list[str | None]:
    """The lane (thread) of each instruction, ``None`` for a lazy receive (module doc): its
    stream, except for the transfers of a stream that holds only transfers, whose receives
    are lazy and whose sends join the one lane that produces all their values, if there is
    one."""
    mixed = {ins.stream for ins in instructions if ins.kind not in _P2P}
    recorder = {ins.record: k for k, ins in enumerate(instructions) if ins.record}
    lanes: list[str | None] = [
        None if ins.kind is NodeKind.RECV and ins.stream not in mixed and ins.record else ins.stream
        for ins in instructions
    ]
    producers: dict[str, set[str | None]] = {}  # transfer-only stream -> lanes its sends wait on
    for ins in instructions:
        if ins.kind is NodeKind.SEND and ins.stream not in mixed:
            found = producers.setdefault(ins.stream, set())
            found.update(lanes[recorder[w]] for w in ins.waits if w in recorder)
            if len(ins.waits) != 1:
                found.add(None)  # not one producer: leave this stream's sends where they are
    for k, ins in enumerate(instructions):
        if ins.kind is NodeKind.SEND and ins.stream not in mixed:
            found = producers[ins.stream]
            if len(found) == 1 and None not in found:
                lanes[k] = next(iter(found))
    return lanes


def overlap_groups(
    instructions: Sequence[Instruction], lanes: Sequence[str | None], lane: str
) -> list[list[list[int]]]:
    """``lane``'s instruction indices, in order, as groups of *sides*: one side (a list run in
    order) for an ordinary instruction, two for an overlapped slot. A slot is the run of the
    lane's instructions from a compute instruction with an ``overlap`` number on: compute
    with that number, and the transfers of its microbatches in between; its sides are its
    two microbatches (the forward chunk's, with the loss forward of that microbatch, and the
    backward chunk's), run concurrently since they do not depend on each other. A slot on
    one microbatch or on more than two, or whose sides would both issue forward (or both
    backward) collectives, runs as one side."""
    mine = [k for k in range(len(instructions)) if lanes[k] == lane]
    groups: list[list[list[int]]] = []
    i = 0
    while i < len(mine):
        first = instructions[mine[i]]
        if first.overlap is None or first.kind is not NodeKind.COMPUTE:
            groups.append([[mine[i]]])
            i += 1
            continue
        run = [mine[i]]
        seen = {first.microbatch}
        j = i + 1
        while j < len(mine):
            ins = instructions[mine[j]]
            if ins.kind is NodeKind.COMPUTE and ins.overlap == first.overlap:
                seen.add(ins.microbatch)
            elif ins.kind is NodeKind.COMPUTE or ins.microbatch not in seen:
                break
            run.append(mine[j])
            j += 1
        sides: dict[int | None, list[int]] = {}
        for k in run:
            sides.setdefault(instructions[k].microbatch, []).append(k)
        apart = len(sides) == 2 and _passes_with_collectives(instructions, sides.values())
        groups.append(list(sides.values()) if apart else [run])
        i = j
    return groups


def _passes_with_collectives(instructions: Sequence[Instruction], sides: Iterable[list[int]]) -> bool:
    """Whether the sides' collectives inside compute (tensor/expert parallel: forward ones on
    one process group, backward ones on another) come from forwards on one side and
    backwards on the other, so no process group is used by both threads."""
    seen: list[set[bool]] = []
    for side in sides:
        seen.append({
            instructions[k].phase is Phase.F
            for k in side
            if instructions[k].kind is NodeKind.COMPUTE and instructions[k].communicator is not None
        })
    return all(len(a) <= 1 for a in seen) and not (seen[0] & seen[1])


def lanes_share_a_communicator(instructions: Sequence[Instruction]) -> bool:
    """Whether some collective communicator (of a group operation, or of the collectives
    inside a compute instruction) would be used by two lanes: run such a plan sequentially."""
    owner: dict[str, str] = {}
    for ins, lane in zip(instructions, assign_lanes(instructions), strict=True):
        comm = ins.communicator
        if lane is None:
            continue
        if ins.kind not in _P2P and comm is not None and owner.setdefault(comm, lane) != lane:
            return True
    return False


class StreamLayout:
    """What ``run_streams`` derives from a rank's instruction list alone, computed once per
    plan (the executor keeps it) instead of on every step: each instruction's lane, the lazy
    receives, each lane's overlap groups, and which events need an object at all. An event
    needs none where every instruction that waits for it runs after its recorder on the
    recorder's own thread (the same lane, not the other side of one overlapped slot), or
    where it is a lazy receive's with a single reader (which runs the receive itself): on a
    plan whose transfers all moved onto the compute lane that is every event, and making
    them cost about 2 us each per step."""

    def __init__(self, instructions: Sequence[Instruction]) -> None:
        self.lanes = assign_lanes(instructions)
        self.lazy = {ins.record: k for k, ins in enumerate(instructions) if self.lanes[k] is None}
        self.names = [lane for lane in dict.fromkeys(self.lanes) if lane is not None]
        self.groups = {lane: overlap_groups(instructions, self.lanes, lane) for lane in self.names}
        thread: dict[int, tuple[str, int, int]] = {}  # lane, group, side (-1: the lane's own thread)
        for lane, groups in self.groups.items():
            for g, sides in enumerate(groups):
                for side_index, side in enumerate(sides):
                    for k in side:
                        thread[k] = (lane, g, side_index if len(sides) > 1 else -1)
        recorder = {ins.record: k for k, ins in enumerate(instructions) if ins.record}
        readers: dict[str, list[int]] = {}
        for k, ins in enumerate(instructions):
            for name in ins.waits:
                readers.setdefault(name, []).append(k)

        def in_order(r: int, w: int) -> bool:
            """Whether instruction ``w`` always runs after ``r`` on the thread that ran ``r``."""
            if r not in thread or w not in thread or w < r:
                return False
            (lane_r, group_r, side_r), (lane_w, group_w, side_w) = thread[r], thread[w]
            return lane_r == lane_w and (group_r != group_w or side_r == side_w)

        self.events: tuple[str, ...] = tuple(
            name
            for name, r in recorder.items()
            if (len(readers.get(name, ())) > 1 if name in self.lazy
                else not all(in_order(r, w) for w in readers.get(name, ())))
        )
        self.ordered = frozenset(recorder) - set(self.events) - set(self.lazy)


def run_streams(
    instructions: Sequence[Instruction],
    execute: Callable[[int, Instruction], None],
    *,
    timeout_s: float,
    streams: Streams | None = None,
    waiting: Callable[[int], None] | None = None,
    layout: StreamLayout | None = None,
) -> None:
    """Run ``execute(k, instruction)`` for every instruction, one thread per lane, honouring
    ``waits``/``record`` with ``streams``' events and lane contexts (host-only by default).
    Raises the first exception any thread raised (the others stop at their next
    instruction); an event not recorded within ``timeout_s`` is an error. ``waiting(k)`` is
    told when a thread starts waiting for instruction ``k``'s events (progress records).
    ``layout``: ``StreamLayout(instructions)``, when the caller keeps one."""
    streams = streams or HostStreams()
    layout = layout or StreamLayout(instructions)
    events = {name: streams.event(name) for name in layout.events}
    ordered = layout.ordered
    failures: list[BaseException] = []
    abort = threading.Event()
    lazy = layout.lazy
    claimed: set[int] = set()
    claim_lock = threading.Lock()

    def claim(k: int) -> bool:
        with claim_lock:
            mine = k not in claimed
            claimed.add(k)
        return mine

    def wait_for(ins: Instruction) -> None:
        for name in ins.waits:
            if name in ordered:
                continue  # recorded earlier on this thread (``StreamLayout``)
            if name in lazy and claim(lazy[name]):
                run_one(lazy[name])  # a lazy receive: the first thread that needs it runs it
                continue
            event = events.get(name)
            if event is None:
                raise RuntimeError(f"instruction {ins.id} waits for event {name!r}, which nothing records")
            deadline = time.monotonic() + timeout_s
            while not event.wait_issued(POLL_S):
                if abort.is_set():
                    raise _Aborted
                if time.monotonic() > deadline:
                    raise TimeoutError(f"instruction {ins.id} waited {timeout_s:g} s for event {name!r}")
            event.wait_device()

    def run_one(k: int) -> None:
        ins = instructions[k]
        if waiting is not None:
            waiting(k)
        wait_for(ins)
        if abort.is_set():
            raise _Aborted
        execute(k, ins)
        if ins.record:
            event = events.get(ins.record)
            if event is not None:
                event.record()

    def guarded(work: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                work()
            except _Aborted:
                pass
            except BaseException as exc:  # reported by the caller
                failures.append(exc)
                abort.set()

        return run

    def run_side(side: list[int]) -> None:
        for k in side:
            run_one(k)

    def in_lane(lane: str, work: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            with streams.lane(lane):
                work()

        return run

    def run_group(lane: str, sides: list[list[int]]) -> None:
        helpers = [
            threading.Thread(
                target=guarded(in_lane(lane, partial(run_side, side))), name=f"piper-overlap-{side[0]}", daemon=True
            )
            for side in sides[1:]
        ]
        for t in helpers:
            t.start()
        run_side(sides[0])
        for t in helpers:
            while t.is_alive():
                t.join(POLL_S)
                if abort.is_set():
                    raise _Aborted

    def run_lane(lane: str) -> None:
        for sides in layout.groups[lane]:
            if abort.is_set():
                raise _Aborted
            if len(sides) == 1:
                run_side(sides[0])
            else:
                run_group(lane, sides)

    names = layout.names
    threads = [
        threading.Thread(target=guarded(in_lane(lane, partial(run_lane, lane))), name=f"piper-{lane}", daemon=True)
        for lane in names[1:]
    ]
    for t in threads:
        t.start()
    if names:  # the first lane (compute, as compiled) runs on the calling thread
        guarded(in_lane(names[0], partial(run_lane, names[0])))()
    for t in threads:
        while t.is_alive() and not abort.is_set():
            t.join(POLL_S)
        if abort.is_set():
            break
    # Receives nothing on this rank waited for (a plan without readers for them) still run,
    # each in its own stream's lane.
    for k in sorted(set(lazy.values()) - claimed):
        if not abort.is_set():
            guarded(in_lane(instructions[k].stream, partial(run_one, k)))()
    if failures:
        raise failures[0]
