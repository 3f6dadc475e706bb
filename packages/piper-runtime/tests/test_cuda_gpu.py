"""The CUDA backend on a real GPU: device-side ordering between lanes, every communicator
operation between two processes (NCCL on two GPUs, host-staged on one), the allocator's
figures. Skipped cleanly where there is no GPU or no cupy (``cuda_missing``); run by
benchmarks/gpu_check.sh on a GPU machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from piper_runtime.backends import cuda_missing

MISSING = cuda_missing()
pytestmark = pytest.mark.skipif(MISSING is not None, reason=f"needs a GPU and cupy: {MISSING}")


def test_a_lane_waits_on_the_device_for_a_slow_producer() -> None:
    """The producer's stream sleeps on the GPU before writing; the consumer's stream waits for
    its event on the device and reads what was written (without the wait it reads zeros)."""
    from piper_ir import Instruction, NodeKind, Phase
    from piper_runtime.backends import CudaBackend
    from piper_runtime.rank.streams import run_streams

    backend = CudaBackend()
    x = torch.zeros(1 << 20, device=backend.device)
    out: dict[str, torch.Tensor] = {}

    def execute(_k: int, ins: Instruction) -> None:
        if ins.id == "produce":
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time on this stream
            x.fill_(1.0)
        else:
            out["y"] = x * 2

    plan = [
        Instruction("produce", NodeKind.COMPUTE, segment="s", phase=Phase.F, microbatch=0, stream="a", record="ev"),
        Instruction("consume", NodeKind.COMPUTE, segment="s", phase=Phase.F, microbatch=0, stream="b", waits=("ev",)),
    ]
    run_streams(plan, execute, timeout_s=30, streams=backend)
    torch.cuda.synchronize()
    assert torch.all(out["y"] == 2.0)
    assert backend.streams.stream("a").handle != backend.streams.stream("b").handle


def test_the_allocator_peak_is_reported() -> None:
    from piper_runtime.backends import CudaBackend

    backend = CudaBackend()
    tracker = backend.memory_tracker(0)
    tracker.reset()
    keep = torch.empty(64 << 20, dtype=torch.uint8, device=backend.device)
    assert tracker.result().device_peak >= keep.numel()


OPS = textwrap.dedent(
    """
    import json, sys
    import torch
    from piper_runtime.backends import CudaBackend

    rank, port = int(sys.argv[1]), int(sys.argv[2])
    b = CudaBackend()
    b.connect(rank, 2, "127.0.0.1", port, 60.0)
    dev = b.device
    group = b.communicator([0, 1])
    p2p = b.communicator([0, 1], [(0, 1), (1, 0)])
    seen = {}
    with b.lane("compute"):
        t = torch.arange(4.0, device=dev) + 10 * rank
        group.all_reduce(t)
        seen["all_reduce"] = t.tolist()
        full = torch.arange(4.0, device=dev) + 10 * rank
        shard = torch.empty(2, device=dev)
        group.reduce_scatter(shard, full)
        seen["reduce_scatter"] = shard.tolist()
        shard2 = torch.empty(2, device=dev)
        group.start_reduce_scatter(shard2, full).wait()
        seen["start_reduce_scatter"] = shard2.tolist()
        gathered = torch.empty(4, device=dev)
        group.all_gather(gathered, torch.full((2,), float(rank), device=dev))
        seen["all_gather"] = gathered.tolist()
        sends = {0: [2, 1], 1: [0, 3]}[rank]
        recvs = {0: [2, 0], 1: [1, 3]}[rank]
        x = (torch.arange(sum(sends) * 2.0, device=dev).reshape(-1, 2) + 100 * rank).contiguous()
        o = torch.full((sum(recvs), 2), -1.0, device=dev)
        group.all_to_all(o, x, recvs, sends)
        seen["all_to_all"] = o.tolist()
        mine = torch.full((3,), float(rank + 1), device=dev)
        theirs = torch.empty(3, device=dev)
        sent = p2p.send(mine, 1 - rank)  # both ranks send at once: one channel per direction
        got = p2p.recv(theirs, 1 - rank)
        got.wait()
        sent.wait()
        seen["p2p"] = theirs.tolist()
    seen["transports"] = sorted({str(how) for _, how in b.transports})
    b.shutdown()
    print(json.dumps(seen))
    """
)


def _two_processes(gpus: tuple[str, str]) -> list[dict]:
    from piper_runtime.rendezvous import free_port

    port = free_port()
    procs = []
    for rank, gpu in enumerate(gpus):
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=gpu)
        procs.append(
            subprocess.Popen([sys.executable, "-c", OPS, str(rank), str(port)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env)
        )
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, err[-3000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    return outs


def _check(r0: dict, r1: dict) -> None:
    assert r0["all_reduce"] == r1["all_reduce"] == [10.0, 12.0, 14.0, 16.0]
    assert r0["reduce_scatter"] == r0["start_reduce_scatter"] == [10.0, 12.0]
    assert r1["reduce_scatter"] == r1["start_reduce_scatter"] == [14.0, 16.0]
    assert r0["all_gather"] == [0.0, 0.0, 1.0, 1.0]
    assert r0["all_to_all"] == [[0.0, 1.0], [2.0, 3.0]]
    assert r1["all_to_all"] == [[4.0, 5.0], [100.0, 101.0], [102.0, 103.0], [104.0, 105.0]]
    assert r0["p2p"] == [2.0] * 3 and r1["p2p"] == [1.0] * 3


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_every_operation_over_nccl_between_two_gpus() -> None:
    r0, r1 = _two_processes(("0", "1"))
    _check(r0, r1)
    assert r0["transports"] == ["nccl"]


def test_every_operation_host_staged_between_two_ranks_of_one_gpu() -> None:
    r0, r1 = _two_processes(("0", "0"))
    _check(r0, r1)
    assert r0["transports"] == ["host-staged"]
