"""The CUDA backend's logic without a GPU (``piper_runtime.backends.fakes``): which device work
is ordered after which (read off the fake device's log as a GPU would run it), what memory is
kept for which stream, communicator planning, transport choice where ranks share a GPU,
datatypes, and what the backend says when it cannot run."""

from __future__ import annotations

import threading

import pytest
import torch

from piper_ir import ClusterError, Instruction, NodeKind, Phase
from piper_runtime import resolve_backend
from piper_runtime.backends import CudaBackend, cuda_missing, used_on_this_lane
from piper_runtime.backends.cuda import DeviceMemoryTracker
from piper_runtime.backends.device_streams import DeviceStreams, LaneEvent
from piper_runtime.backends.fakes import FakeDevice, FakeNccl, MemoryCommunicator, MemoryHost, MemoryWorld
from piper_runtime.backends.gpu_plan import (
    Transport,
    channel_transports,
    even_splits,
    gpus_in_use,
    group_transport,
    nccl_dtype,
    shares_a_gpu,
    split_offsets,
)
from piper_runtime.backends.nccl import Channel, CupyNcclComm, NcclChannels, NcclGroup
from piper_runtime.backends.staged import StagedCommunicator
from piper_runtime.rank.streams import run_streams
from piper_runtime.testing import on_every_rank


def _c(ident: str, stream: str = "compute", **kw: object) -> Instruction:
    return Instruction(ident, NodeKind.COMPUTE, segment="s", phase=Phase.F, microbatch=0, stream=stream, **kw)


# -- lanes and events ----------------------------------------------------------------------------

PLAN = [
    _c("F0", record="ev.F0"),
    Instruction("ar", NodeKind.ALL_REDUCE, stream="dp", value="b", communicator="dp", waits=("ev.F0",), record="ev.ar"),
    _c("F1"),
    Instruction("opt", NodeKind.OPTIMIZER, segment="s", stream="compute", waits=("ev.ar",)),
]


def _run_logged(device: FakeDevice, streams: DeviceStreams) -> None:
    def execute(_k: int, ins: Instruction) -> None:
        device.kernel(ins.id)

    device.kernel("batch copy")  # what the worker queued before the step, on its stream
    run_streams(PLAN, execute, timeout_s=10, streams=streams)
    device.kernel("after the step")


def test_a_consumer_lane_runs_after_its_producer_on_every_gpu_schedule() -> None:
    device = FakeDevice()
    _run_logged(device, DeviceStreams(device))
    before = device.happens_before
    kernels = {what[1]: (stream, what) for stream, what in device.entries("kernel")}
    assert kernels["F0"][0] == kernels["F1"][0] == "compute" and kernels["ar"][0] == "dp"  # real streams
    assert before(kernels["F0"][1], kernels["ar"][1])  # the dp stream waited for F0's event
    assert before(kernels["ar"][1], kernels["opt"][1])
    assert not before(kernels["ar"][1], kernels["F1"][1])  # F1 does not wait: streams overlap
    assert not before(kernels["F1"][1], kernels["ar"][1])
    # fork and join: lanes start after the batch copy, the worker's stream continues after them
    for k in ("F0", "ar", "F1", "opt"):
        assert before(kernels["batch copy"][1], kernels[k][1])
        assert before(kernels[k][1], kernels["after the step"][1])


def test_without_the_device_side_wait_the_order_is_lost() -> None:
    """The check above can fail: with events that only say "issued" (what the CPU backend
    does), the dp kernel is not ordered after F0 on the device."""

    class HostOnly(LaneEvent):
        def wait_device(self) -> None:
            pass

    class Broken(DeviceStreams):
        def event(self, name: str) -> LaneEvent:
            return HostOnly(self.gpu, name)

    device = FakeDevice()
    _run_logged(device, Broken(device))
    kernels = {what[1]: what for _, what in device.entries("kernel")}
    assert not device.happens_before(kernels["F0"], kernels["ar"])


def test_the_host_never_waits_for_the_device_in_lanes() -> None:
    """Waiting for an event is a device-side wait: nothing was synchronised (no stream was
    run to completion by the host) while the lanes ran."""
    device = FakeDevice()
    calls: list[str] = []
    device.synchronize = lambda: calls.append("synchronize")  # type: ignore[method-assign]
    _run_logged(device, DeviceStreams(device))
    assert calls == []
    assert device.entries("wait")


def test_used_on_this_lane_keeps_memory_for_the_lane_stream_only_inside_a_lane() -> None:
    device = FakeDevice()
    streams = DeviceStreams(device)
    t = torch.ones(4)
    used_on_this_lane(t)  # outside a lane: nothing to keep
    assert not device.entries("keep")
    with streams.lane("dp"):
        used_on_this_lane(t, None)
    assert [s for s, _ in device.entries("keep")] == ["dp"]


def test_an_event_waited_on_the_device_before_it_was_recorded_is_an_error() -> None:
    event = DeviceStreams(FakeDevice()).event("ev.x")
    with pytest.raises(RuntimeError, match="'ev.x' is waited for on the device before it was recorded"):
        event.wait_device()


# -- communicators -------------------------------------------------------------------------------


def _two_ranks(work) -> list[object]:
    return on_every_rank(2, work, timeout_s=60)


def test_a_channel_sends_on_its_own_stream_after_the_producer_and_the_reader_waits_for_it() -> None:
    world = MemoryWorld()
    nccl = FakeNccl(world)
    uid = nccl.unique_id()
    devices = [FakeDevice("g0"), FakeDevice("g1")]

    def rank(r: int) -> torch.Tensor:
        gpu = devices[r]
        lanes = DeviceStreams(gpu)
        channel = Channel(nccl.communicator(2, uid, r), 1 - r, gpu, gpu.new_stream("channel 0->1"))
        with lanes.lane("compute"):
            if r == 0:
                x = torch.arange(6.0)
                gpu.kernel("produce")
                work = channel.send(x)
                work.wait()
                return x
            buffer = torch.empty(6)
            work = channel.recv(buffer)
            work.wait()
            gpu.kernel("consume")
            return buffer.clone()

    sent, got = _two_ranks(rank)
    assert torch.equal(sent, got)
    g0, g1 = devices
    send = next(what for s, what in g0.log if what[0] == "nccl.send")
    assert next(s for s, what in g0.log if what[0] == "nccl.send") == "channel 0->1"
    assert g0.happens_before(("kernel", "produce"), send)
    recv = next(what for s, what in g1.log if what[0] == "nccl.recv")
    assert g1.happens_before(recv, ("kernel", "consume"))
    # the sent tensor is kept for the channel's stream; the receive buffer for it and the reader's
    assert {s for s, _ in g0.entries("keep")} == {"channel 0->1"}
    assert {s for s, _ in g1.entries("keep")} == {"channel 0->1", "compute"}


def test_point_to_point_picks_the_channel_of_each_direction_and_refuses_unknown_ones() -> None:
    a, b = object(), object()
    chans = NcclChannels((0, 1, 2), 1, {(1, 0): a, (2, 1): b})  # type: ignore[dict-item]
    with pytest.raises(RuntimeError, match=r"rank 1: no channel 1 -> 2 on this communicator.*\[\(1, 0\), \(2, 1\)\]"):
        chans.send(torch.ones(1), 2)
    with pytest.raises(RuntimeError, match="point-to-point messages only"):
        chans.all_reduce(torch.ones(1))


def test_collectives_queue_on_the_current_stream_and_the_early_reduce_scatter_on_a_side_stream() -> None:
    world = MemoryWorld()
    nccl = FakeNccl(world)
    uid = nccl.unique_id()
    devices = [FakeDevice("g0"), FakeDevice("g1")]

    def rank(r: int) -> dict[str, torch.Tensor]:
        gpu = devices[r]
        lanes = DeviceStreams(gpu)
        group = NcclGroup((0, 1), r, nccl.communicator(2, uid, r), nccl, gpu, gpu.new_stream("side"))
        out = {}
        with lanes.lane("dp"):
            t = torch.tensor([1.0, 2.0]) * (r + 1)
            group.all_reduce(t)
            out["all_reduce"] = t
            full = torch.arange(4.0) + 10 * r
            shard = torch.empty(2)
            gpu.kernel(f"grads {r}")
            work = group.start_reduce_scatter(shard, full)
            work.wait()
            gpu.kernel(f"read shard {r}")
            out["reduce_scatter"] = shard
            gathered = torch.empty(4)
            group.all_gather(gathered, shard)
            out["all_gather"] = gathered
        return out

    results = _two_ranks(rank)
    assert results[0]["all_reduce"].tolist() == [3.0, 6.0]
    assert results[0]["reduce_scatter"].tolist() == [10.0, 12.0] and results[1]["reduce_scatter"].tolist() == [14.0, 16.0]
    assert results[1]["all_gather"].tolist() == [10.0, 12.0, 14.0, 16.0]
    g0 = devices[0]
    where = {what[0]: s for s, what in g0.log if what[0].startswith("nccl.")}
    assert where == {"nccl.all_reduce": "dp", "nccl.reduce_scatter": "side", "nccl.all_gather": "dp"}
    rs = next(what for _, what in g0.log if what[0] == "nccl.reduce_scatter")
    assert g0.happens_before(("kernel", "grads 0"), rs)
    assert g0.happens_before(rs, ("kernel", "read shard 0"))
    assert {s for s, _ in g0.entries("keep")} == {"side", "dp"}  # inputs for the side stream, output for the waiter


def test_uneven_all_to_all_as_grouped_sends_and_receives() -> None:
    world = MemoryWorld()
    nccl = FakeNccl(world)
    uid = nccl.unique_id()
    sends = {0: [2, 1], 1: [0, 3]}  # rows rank r sends to member j

    def rank(r: int) -> torch.Tensor:
        gpu = FakeDevice(f"g{r}")
        group = NcclGroup((0, 1), r, nccl.communicator(2, uid, r), nccl, gpu, gpu.new_stream("side"))
        rows = sum(sends[r])
        x = torch.arange(rows * 2.0).reshape(rows, 2) + 100 * r
        recv = [sends[0][r], sends[1][r]]
        out = torch.full((sum(recv), 2), -1.0)
        group.all_to_all(out, x, recv, sends[r])
        return out

    out0, out1 = _two_ranks(rank)
    x0 = torch.arange(6.0).reshape(3, 2)
    x1 = torch.arange(6.0).reshape(3, 2) + 100
    assert torch.equal(out0, x0[:2])  # rank 1 sends nothing to rank 0: the empty piece is skipped
    assert torch.equal(out1, torch.cat([x0[2:], x1]))
    assert nccl.groups == 2  # one NCCL group per call


def test_host_staged_communicator_carries_every_operation_between_ranks_of_one_gpu() -> None:
    world = MemoryWorld()
    devices = [FakeDevice("g0"), FakeDevice("g0")]

    def rank(r: int) -> dict[str, object]:
        gpu = devices[r]
        lanes = DeviceStreams(gpu)
        comm = StagedCommunicator(MemoryCommunicator(world, "staged", (0, 1), r), gpu)
        out: dict[str, object] = {}
        with lanes.lane("compute"):
            t = torch.tensor([1.0, 2.0]) + r
            comm.all_reduce(t)
            out["all_reduce"] = t.tolist()
            shard = torch.empty(2)
            comm.start_reduce_scatter(shard, torch.arange(4.0)).wait()
            out["reduce_scatter"] = shard.tolist()
            gathered = torch.empty(4)
            comm.all_gather(gathered, torch.full((2,), float(r)))
            out["all_gather"] = gathered.tolist()
            if r == 0:
                comm.send(torch.tensor([7.0, 8.0]), 1).wait()
            else:
                buffer = torch.empty(2)
                comm.recv(buffer, 0).wait()
                out["recv"] = buffer.tolist()
            o = torch.empty(2)
            comm.all_to_all(o, torch.tensor([10.0, 11.0]) + r)
            out["all_to_all"] = o.tolist()
        return out

    r0, r1 = _two_ranks(rank)
    assert r0["all_reduce"] == [3.0, 5.0]
    assert r0["reduce_scatter"] == [0.0, 2.0] and r1["reduce_scatter"] == [4.0, 6.0]
    assert r1["all_gather"] == [0.0, 0.0, 1.0, 1.0]
    assert r1["recv"] == [7.0, 8.0]
    assert r0["all_to_all"] == [10.0, 11.0] and r1["all_to_all"] == [11.0, 12.0]
    # the receive's copy into the buffer waited for the posting stream, and the buffer is kept
    assert [s for s, _ in devices[1].entries("keep")] == ["compute"]


# -- planning: transports, channels, datatypes ------------------------------------------------------


def test_ranks_sharing_a_gpu_are_host_staged_and_the_rest_use_nccl() -> None:
    gpus = ["A", "A", "B", "C"]  # ranks 0 and 1 share GPU A
    assert shares_a_gpu((0, 1), gpus) and not shares_a_gpu((0, 2, 3), gpus)
    assert group_transport((0, 1, 2), gpus) is Transport.HOST
    assert group_transport((1, 2, 3), gpus) is Transport.NCCL
    assert channel_transports([(0, 1), (1, 2), (2, 0), (1, 0)], gpus) == {
        (0, 1): Transport.HOST,
        (1, 2): Transport.NCCL,
        (2, 0): Transport.NCCL,
        (1, 0): Transport.HOST,
    }
    assert gpus_in_use(gpus) == {"A": (0, 1), "B": (2,), "C": (3,)}


def test_the_backend_plans_groups_and_channels_the_same_on_every_rank() -> None:
    """Four ranks, two per GPU; every rank makes the same communicators in the same order:
    NCCL communicators only between GPUs, gloo (here: memory) groups where ranks share one."""
    world = MemoryWorld()
    nccl = FakeNccl(world)
    gpus = ["A", "A", "B", "B"]
    backends = [CudaBackend(FakeDevice(g), nccl, join=lambda r, *_: MemoryHost(world, r)) for g in gpus]

    def rank(r: int) -> None:
        b = backends[r]
        b.connect(r, 4, "in-process", 0, 10.0)
        b.communicator((0, 1, 2, 3), [(0, 1), (1, 2), (2, 3), (3, 2)])  # pipeline channels
        b.communicator((0, 2))  # data-parallel replicas on different GPUs
        b.communicator((0, 1))  # two ranks of GPU A

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(b.identities == ("A", "A", "B", "B") for b in backends)
    expected = [
        ((0, 1), Transport.HOST),
        ((1, 2), Transport.NCCL),
        ((2, 3), Transport.HOST),
        ((3, 2), Transport.HOST),
        ((0, 2), Transport.NCCL),
        ((0, 1), Transport.HOST),
    ]
    assert all(b.transports == expected for b in backends)
    # NCCL communicators: channel 1->2 (ranks 1 and 2), group (0, 2) (ranks 0 and 2)
    assert sorted(len(c.host.ranks) for c in nccl.made) == [2, 2, 2, 2]


def test_nccl_datatypes_match_ncclh_and_unsupported_ones_are_named() -> None:
    assert nccl_dtype(torch.float32) == 7 and nccl_dtype(torch.bfloat16) == 9 and nccl_dtype(torch.float64) == 8
    assert nccl_dtype(torch.int64) == 4 and nccl_dtype(torch.float16) == 6
    with pytest.raises(TypeError, match=r"NCCL cannot carry torch.bool tensors \(it carries int8, uint8"):
        nccl_dtype(torch.bool)


def test_cupy_calls_get_pointers_counts_datatypes_and_the_stream_handle() -> None:
    calls: list[tuple] = []

    class Recorder:
        def __getattr__(self, name: str):
            return lambda *args: calls.append((name, *args))

    class S:
        handle = 1234

    comm = CupyNcclComm(Recorder())
    t = torch.zeros(3, 4, dtype=torch.float64)
    comm.send(t, 1, S())
    comm.all_reduce(t, S())
    out = torch.zeros(6)
    comm.reduce_scatter(out, torch.zeros(12), S())
    assert calls[0] == ("send", t.data_ptr(), 12, 8, 1, 1234)
    assert calls[1] == ("allReduce", t.data_ptr(), t.data_ptr(), 12, 8, 0, 1234)
    assert calls[2][0] == "reduceScatter" and calls[2][3:] == (6, 7, 0, 1234)
    with pytest.raises(ValueError, match="NCCL needs contiguous tensors"):
        comm.send(t.t(), 1, S())


def test_split_offsets_and_even_splits() -> None:
    assert split_offsets([2, 0, 3]) == [0, 2, 2]
    assert even_splits(6, 3) == [2, 2, 2]
    with pytest.raises(ValueError, match="7 rows cannot be split evenly over 2"):
        even_splits(7, 2)


# -- when the backend cannot run ---------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_cuda_says_what_is_missing_and_the_factory_does_not_touch_the_gpu() -> None:
    backend = resolve_backend("cuda")  # cheap: the driver builds one to read what a rank needs
    assert isinstance(backend, CudaBackend) and backend.gpus_per_rank == 1.0
    assert "torch.cuda.is_available() is False" in cuda_missing()
    with pytest.raises(ClusterError, match=r"backend 'cuda' cannot run in this worker: torch.cuda.is_available\(\) is False"):
        backend.device  # noqa: B018


def test_without_cupy_the_message_names_the_extra(monkeypatch) -> None:
    import builtins

    real_import = builtins.__import__

    def no_cupy(name, *args, **kwargs):
        if name.startswith("cupy"):
            raise ImportError("No module named 'cupy'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(builtins, "__import__", no_cupy)
    missing = cuda_missing()
    assert "cupy" in missing and "piper-runtime[cuda]" in missing and "cupy-cuda12x" in missing


def test_memory_tracker_adds_the_allocator_peak() -> None:
    device = FakeDevice()
    tracker = DeviceMemoryTracker(3, device)
    device.peak = 999
    tracker.reset()
    assert device.peak == 0  # a new step starts a new peak
    tracker.sample({"parameters": [torch.zeros(4)]})
    device.peak = 4096
    result = tracker.result()
    assert result.rank == 3 and result.parameters == 16 and result.device_peak == 4096
