"""The threaded executor (``piper_runtime.rank.streams``) on hand-built instruction lists, no torch
work and no Ray: events order lanes, overlapped slots run side by side, failures and missing
events are reported instead of hanging."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import pytest

from piper_ir import Instruction, NodeKind, Phase
from piper_runtime.backends import HostEvent
from piper_runtime.rank.streams import (
    StreamLayout,
    assign_lanes,
    lanes_share_a_communicator,
    overlap_groups,
    run_streams,
)


def _c(ident: str, phase: Phase = Phase.F, mb: int = 0, **kw: object) -> Instruction:
    return Instruction(ident, NodeKind.COMPUTE, segment="s", phase=phase, microbatch=mb, **kw)


def _recorder(delays: dict[str, float] | None = None):
    delays = delays or {}
    log: list[tuple[str, str, float, float]] = []
    lock = threading.Lock()

    def execute(_k: int, ins: Instruction) -> None:
        start = time.perf_counter()
        time.sleep(delays.get(ins.id, 0.0))
        with lock:
            log.append((ins.id, threading.current_thread().name, start, time.perf_counter()))

    return log, execute


def test_events_order_instructions_across_lanes() -> None:
    """The send waits for the slow compute that records its event; the unrelated collective on
    the dp lane does not wait and finishes first."""
    plan = [
        _c("F0", record="ev.F0"),
        Instruction("send", NodeKind.SEND, stream="pp", value="v", microbatch=0, peer=1, waits=("ev.F0",)),
        Instruction("ar", NodeKind.ALL_REDUCE, stream="dp", value="bucket", communicator="dp:0-1"),
    ]
    log, execute = _recorder({"F0": 0.2})
    run_streams(plan, execute, timeout_s=5)
    order = [ident for ident, *_ in log]
    assert order.index("F0") < order.index("send")
    assert order[0] == "ar"
    assert len({thread for _, thread, *_ in log}) == 2  # compute (with its send) and dp


def test_transfers_join_their_producers_and_readers() -> None:
    """A transfer-only stream's send runs on its producer's lane, its receive lazily on the
    lane that reads it; transfers in a stream that also computes stay in it."""
    plan = [
        Instruction("recv", NodeKind.RECV, stream="pp", value="v", microbatch=0, peer=1, record="ev.recv"),
        _c("F0", waits=("ev.recv",), record="ev.F0"),
        Instruction("send", NodeKind.SEND, stream="pp", value="w", microbatch=0, peer=1, waits=("ev.F0",)),
        Instruction("recv2", NodeKind.RECV, stream="other", value="u", microbatch=0, peer=1),
        Instruction("ar", NodeKind.ALL_REDUCE, stream="other", value="b", communicator="dp:0-1"),
    ]
    assert assign_lanes(plan) == [None, "compute", "compute", "other", "other"]
    log, execute = _recorder({"recv": 0.1})
    run_streams(plan, execute, timeout_s=5)
    threads = {ident: thread for ident, thread, *_ in log}
    assert threads["recv"] == threads["F0"] == threads["send"]  # no hand-over between threads
    assert [ident for ident, *_ in log if ident in ("recv", "F0", "send")] == ["recv", "F0", "send"]


def test_a_receive_nothing_waits_for_still_runs() -> None:
    plan = [
        Instruction("recv", NodeKind.RECV, stream="pp", value="v", microbatch=0, peer=1, record="ev.recv"),
        _c("F0"),
    ]
    log, execute = _recorder()
    run_streams(plan, execute, timeout_s=5)
    assert sorted(ident for ident, *_ in log) == ["F0", "recv"]


def test_overlapped_forward_and_backward_run_side_by_side() -> None:
    plan = [_c("F1", Phase.F, 1, overlap=0), _c("B0", Phase.B, 0, overlap=0), _c("F2", Phase.F, 2)]
    assert overlap_groups(plan, assign_lanes(plan), "compute") == [[[0], [1]], [[2]]]
    log, execute = _recorder({"F1": 0.2, "B0": 0.2})
    run_streams(plan, execute, timeout_s=5)
    spans = {ident: (start, end) for ident, _, start, end in log}
    assert spans["F1"][0] < spans["B0"][1] and spans["B0"][0] < spans["F1"][1]  # they overlap
    assert spans["F2"][0] >= max(spans["F1"][1], spans["B0"][1])  # the lane waits for both


def test_a_slot_splits_by_microbatch_with_its_loss_pass_and_sends() -> None:
    """DualPipeV's last rank: forward chunk F3 of stage 0 (and its send) beside the loss
    backward and stage-3 backward of microbatch 1; the next instruction is not in the slot."""
    plan = [
        _c("s0.F3", Phase.F, 3, overlap=0, record="ev.s0.F3"),
        Instruction("send", NodeKind.SEND, stream="pp", value="a", microbatch=3, peer=1, waits=("ev.s0.F3",)),
        _c("loss.B1", Phase.B, 1, overlap=0),
        _c("s3.B1", Phase.B, 1, overlap=0),
        _c("s3.F2", Phase.F, 2),
    ]
    assert overlap_groups(plan, assign_lanes(plan), "compute") == [[[0, 1], [2, 3]], [[4]]]


def test_a_slot_whose_sides_share_collectives_stays_sequential() -> None:
    """Backward passes with expert-parallel all-to-alls on both sides would share one group."""
    plan = [
        _c("s0.F3", Phase.F, 3, overlap=0),
        _c("s0.B2", Phase.B, 3, overlap=0, communicator="ep:0-1"),
        _c("s3.B1", Phase.B, 1, overlap=0, communicator="ep:0-1"),
    ]
    assert overlap_groups(plan, assign_lanes(plan), "compute") == [[[0, 1, 2]]]


def test_a_slot_on_one_microbatch_stays_sequential() -> None:
    plan = [_c("F0", Phase.F, 0, overlap=0), _c("B0", Phase.B, 0, overlap=0)]
    assert overlap_groups(plan, assign_lanes(plan), "compute") == [[[0, 1]]]


def test_a_failure_stops_every_lane_and_is_raised() -> None:
    plan = [
        _c("F0", record="ev.F0"),
        Instruction("send", NodeKind.SEND, stream="pp", value="v", microbatch=0, peer=1, waits=("ev.F0",)),
    ]
    ran: list[str] = []

    def execute(_k: int, ins: Instruction) -> None:
        ran.append(ins.id)
        if ins.id == "F0":
            raise ValueError("boom in F0")

    started = time.perf_counter()
    with pytest.raises(ValueError, match="boom in F0"):
        run_streams(plan, execute, timeout_s=30)
    assert ran == ["F0"]
    assert time.perf_counter() - started < 5


def test_an_event_nothing_records_is_an_error() -> None:
    plan = [_c("F0", waits=("ev.missing",))]
    with pytest.raises(RuntimeError, match="ev.missing"):
        run_streams(plan, lambda k, ins: None, timeout_s=1)


def test_waiting_past_the_timeout_names_the_event() -> None:
    plan = [
        _c("F0", record="ev.F0"),
        Instruction("ar", NodeKind.ALL_REDUCE, stream="dp", value="b", communicator="dp:0-1", waits=("ev.F0",)),
    ]
    log, execute = _recorder({"F0": 1.0})
    with pytest.raises(TimeoutError, match="ev.F0"):
        run_streams(plan, execute, timeout_s=0.2)


def test_a_collective_communicator_on_two_lanes_is_detected() -> None:
    shared = [
        Instruction("ar", NodeKind.ALL_REDUCE, stream="dp", value="b", communicator="dp:0-1"),
        Instruction("ag", NodeKind.ALL_GATHER, stream="gather", value="b", communicator="dp:0-1"),
    ]
    assert lanes_share_a_communicator(shared)
    p2p = [
        Instruction("s", NodeKind.SEND, stream="pp", value="v", peer=1, communicator="pp.fwd"),
        Instruction("r", NodeKind.RECV, stream="pp", value="v", peer=1, communicator="pp.fwd"),
    ]
    assert not lanes_share_a_communicator(p2p)


class _DeviceStreams:
    """``Streams`` of a device-like backend: each thread says which lane it is in, and an
    event's device side is recorded with the lane that waits on it."""

    def __init__(self) -> None:
        self.local = threading.local()
        self.device_waits: list[tuple[str, str]] = []  # (event, lane of the waiter)
        self.lock = threading.Lock()

    def event(self, name: str) -> HostEvent:
        streams = self

        class Event(HostEvent):
            def wait_device(self) -> None:
                with streams.lock:
                    streams.device_waits.append((name, streams.local.lane))

        return Event()

    @contextlib.contextmanager
    def lane(self, stream: str) -> Iterator[None]:
        self.local.lane = stream
        yield


def test_work_runs_inside_its_lane_and_waits_on_the_device_side_there() -> None:
    """What a CUDA backend relies on: every instruction runs in its stream's lane context
    (the helper thread of an overlapped slot and a lazy receive too: the receive in the lane
    of the thread that needs it), and a consumer lane makes the device-side wait itself."""
    plan = [
        Instruction("recv", NodeKind.RECV, stream="pp", value="v", microbatch=1, peer=1, record="ev.recv"),
        _c("F1", Phase.F, 1, overlap=0, waits=("ev.recv",)),
        _c("B0", Phase.B, 0, overlap=0, record="ev.B0"),
        Instruction("ar", NodeKind.ALL_REDUCE, stream="dp", value="b", communicator="dp:0-1", waits=("ev.B0",)),
    ]
    streams = _DeviceStreams()
    lanes: dict[str, str] = {}

    def execute(_k: int, ins: Instruction) -> None:
        lanes[ins.id] = streams.local.lane

    run_streams(plan, execute, timeout_s=5, streams=streams)
    assert lanes == {"recv": "compute", "F1": "compute", "B0": "compute", "ar": "dp"}
    assert streams.device_waits == [("ev.B0", "dp")]  # the lazy receive ran on its reader's lane


def _send(ident: str, waits: str, mb: int = 0) -> Instruction:
    return Instruction(ident, NodeKind.SEND, stream="pp", value="v", microbatch=mb, peer=1, waits=(waits,))


def test_events_get_objects_only_where_another_thread_waits_for_them() -> None:
    """A 1F1B-like rank: every transfer joins the compute lane, so its events are satisfied
    by the lane's order; an all-reduce on a lane of its own, a lazy receive read twice and
    the two sides of an overlapped slot still need theirs."""
    plan = [
        Instruction("recv0", NodeKind.RECV, stream="pp", value="g", microbatch=0, peer=1, record="ev.recv0"),
        _c("F0", record="ev.F0"),
        _send("send0", "ev.F0"),
        _c("B0", Phase.B, 0, waits=("ev.recv0",), record="ev.B0"),
        Instruction("recv2", NodeKind.RECV, stream="pp", value="x", microbatch=2, peer=1, record="ev.recv2"),
        _c("F2", Phase.F, 2, overlap=0, waits=("ev.recv2",), record="ev.F2"),
        _send("send2", "ev.F2", mb=2),
        _c("B1", Phase.B, 1, overlap=0, waits=("ev.recv2", "ev.F0"), record="ev.B1"),
        _c("F3", Phase.F, 3, waits=("ev.F2", "ev.B1")),
        Instruction("ar", NodeKind.ALL_REDUCE, stream="dp", value="b", communicator="dp:0-1", waits=("ev.B0",)),
    ]
    layout = StreamLayout(plan)
    assert layout.groups["compute"] == [[[1]], [[2]], [[3]], [[5, 6], [7]], [[8]]]
    # ev.B0: read on the dp lane; ev.recv2: a lazy receive two instructions read (on both
    # sides of the slot). ev.F2 and ev.B1 are recorded on the slot's two sides and read after
    # it; ev.F0 before it, and read on its second side.
    assert sorted(layout.events) == ["ev.B0", "ev.recv2"]
    assert layout.ordered == {"ev.F0", "ev.F2", "ev.B1"}
    log, execute = _recorder({"F2": 0.05})
    run_streams(plan, execute, timeout_s=5, layout=layout)
    order = [ident for ident, *_ in log]
    assert sorted(order) == sorted(ins.id for ins in plan)
    assert order.index("F3") > max(order.index("F2"), order.index("B1"))
    assert order.index("ar") > order.index("B0") and order.index("B1") > order.index("recv2")


def test_an_event_across_the_sides_of_a_slot_keeps_its_object() -> None:
    plan = [_c("F1", Phase.F, 1, overlap=0, record="ev.F1"), _c("B0", Phase.B, 0, overlap=0, waits=("ev.F1",))]
    layout = StreamLayout(plan)
    assert layout.groups["compute"] == [[[0], [1]]] and layout.events == ("ev.F1",)
    log, execute = _recorder({"F1": 0.1})
    run_streams(plan, execute, timeout_s=5, layout=layout)
    spans = {ident: (start, end) for ident, _, start, end in log}
    assert spans["B0"][0] >= spans["F1"][1]
