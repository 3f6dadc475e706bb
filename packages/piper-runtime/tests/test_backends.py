"""The backend seam without Ray: the registry, the host events, and every communicator
operation of the CPU (gloo) backend between two real processes."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from piper_runtime import resolve_backend
from piper_runtime.backends import (
    CpuBackend,
    HostEvent,
    backend_names,
    register_backend,
    unregister_backend,
)
from piper_runtime.backends.cpu import shm_enabled
from piper_runtime.backends.shm import shm_available
from piper_runtime.driver.cluster import worker_env
from piper_runtime.testing import free_port, ranks_as_processes


def test_the_registry_knows_cpu_and_cuda_and_takes_new_backends() -> None:
    """(What the CUDA backend says where it cannot run: tests/test_cuda_backend.py.)"""
    assert {"cpu", "cuda"} <= set(backend_names())
    backend = resolve_backend("cpu")
    assert isinstance(backend, CpuBackend) and backend.device == torch.device("cpu")
    assert backend.gpus_per_rank == 0.0
    register_backend("seam-test", CpuBackend)
    try:
        assert isinstance(resolve_backend("seam-test"), CpuBackend)
        with pytest.raises(ValueError, match="already registered"):
            register_backend("seam-test", CpuBackend)
    finally:
        unregister_backend("seam-test")
    with pytest.raises(ValueError, match=r"unknown backend 'tpu'; expected one of \['cpu', 'cuda'"):
        resolve_backend("tpu")


def test_host_event_host_side_and_empty_device_side() -> None:
    event = HostEvent()
    assert not event.wait_issued(0.01)
    threading.Timer(0.05, event.record).start()
    assert event.wait_issued(5.0)
    event.wait_device()  # nothing to wait for on the host


# Every communicator operation on a two-rank world; what the rank saw is printed as JSON.
OPS = textwrap.dedent(
    """
    import json, sys
    import torch
    from piper_runtime.backends import CpuBackend

    rank, port = int(sys.argv[1]), int(sys.argv[2])
    torch.set_num_threads(1)
    backend = CpuBackend()
    backend.connect(rank, 2, "127.0.0.1", port, 30.0)
    comm = backend.communicator([0, 1], [(0, 1)])  # its messages 0 -> 1 through shared memory
    other = backend.communicator([0, 1])  # a second group: its own tag and channel, gloo
    seen = {"shm": [sorted(comm.senders) + sorted(comm.receivers), sorted(other.senders) + sorted(other.receivers)]}
    x = torch.arange(4, dtype=torch.float32) + 10 * rank
    t = x.clone()
    comm.all_reduce(t)
    seen["all_reduce"] = t.tolist()
    out = torch.empty(2)
    comm.reduce_scatter(out, x.clone())
    seen["reduce_scatter"] = out.tolist()
    out = torch.empty(2)
    comm.start_reduce_scatter(out, x.clone()).wait()
    seen["start_reduce_scatter"] = out.tolist()
    gathered = torch.empty(4)
    comm.all_gather(gathered, torch.tensor([rank, rank + 0.5]))
    seen["all_gather"] = gathered.tolist()
    # Uneven: rank 0 sends 1 row to itself and 2 to rank 1; rank 1 sends 3 to 0, none to itself.
    sends = [[1, 2], [3, 0]][rank]
    recvs = [[1, 3], [2, 0]][rank]
    rows = torch.arange(sum(sends), dtype=torch.float32).unsqueeze(1) + 100 * rank
    got = torch.empty(sum(recvs), 1)
    comm.all_to_all(got, rows, recvs, sends)
    seen["all_to_all"] = got.flatten().tolist()
    even = torch.empty(2)
    comm.all_to_all(even, torch.tensor([rank * 2.0, rank * 2.0 + 1]))
    seen["all_to_all_even"] = even.tolist()
    # Point to point on two groups between the same ranks, sent in the other order.
    if rank == 0:
        works = [other.send(torch.tensor([7.0]), 1), comm.send(torch.tensor([5.0]), 1)]
        for w in works:
            w.wait()
    else:
        a, b = torch.empty(1), torch.empty(1)
        wa, wb = comm.recv(a, 0), other.recv(b, 0)
        wa.wait()
        wb.wait()
        seen["recv"] = [a.item(), b.item()]
    backend.shutdown()
    backend.shutdown()  # idempotent
    print(json.dumps(seen))
    """
)


def test_cpu_backend_communicator_operations_between_two_processes() -> None:
    seen = ranks_as_processes(OPS, 2, env={"PIPER_SHM_DISABLE": "0"})
    total = [10.0, 12.0, 14.0, 16.0]  # (0, 1, 2, 3) + (10, 11, 12, 13)
    for rank in range(2):
        assert seen[rank]["all_reduce"] == total
        assert seen[rank]["reduce_scatter"] == total[2 * rank : 2 * rank + 2]
        assert seen[rank]["start_reduce_scatter"] == total[2 * rank : 2 * rank + 2]
        assert seen[rank]["all_gather"] == [0.0, 0.5, 1.0, 1.5]
    assert seen[0]["all_to_all"] == [0.0, 100.0, 101.0, 102.0]
    assert seen[1]["all_to_all"] == [1.0, 2.0]
    assert seen[0]["all_to_all_even"] == [0.0, 2.0]
    assert seen[1]["all_to_all_even"] == [1.0, 3.0]
    assert seen[1]["recv"] == [5.0, 7.0]
    # Two processes on one host: the declared channel goes through shared memory, the other
    # group's point-to-point through gloo.
    assert seen[0]["shm"] == [[1], []]
    assert seen[1]["shm"] == [[0], []]


def test_piper_shm_disable_turns_the_channels_off_and_reaches_the_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIPER_SHM_DISABLE", "0")
    assert shm_enabled() == shm_available()
    assert worker_env()["PIPER_SHM_DISABLE"] == "0"
    monkeypatch.setenv("PIPER_SHM_DISABLE", "1")
    assert not shm_enabled()
    assert worker_env()["PIPER_SHM_DISABLE"] == "1"


# A receive that nothing sends, and an all-reduce one member never joins, on groups made by
# ``communicator``: each fails after connect's 2 s timeout instead of waiting forever. Rank 0
# only stays alive meanwhile.
STARVED = textwrap.dedent(
    """
    import json, sys, time
    import torch
    from piper_runtime.backends import CpuBackend

    rank, port = int(sys.argv[1]), int(sys.argv[2])
    backend = CpuBackend()
    backend.connect(rank, 2, "127.0.0.1", port, 2.0)
    comm = backend.communicator([0, 1])
    channel = backend.communicator([0, 1], [(0, 1)])
    seen = {}
    if rank == 1:
        for name, op in [("recv", lambda: comm.recv(torch.empty(1), 0).wait()),
                         ("shm_recv", lambda: channel.recv(torch.empty(1), 0).wait()),
                         ("all_reduce", lambda: comm.all_reduce(torch.ones(1)))]:
            try:
                op()
                seen[name] = "returned"
            except Exception as exc:
                seen[name] = type(exc).__name__ + ": " + str(exc)[:200]
    else:
        time.sleep(15)
    print(json.dumps(seen))
    """
)


def test_a_receive_or_collective_nothing_answers_fails_after_the_connect_timeout() -> None:
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", STARVED, str(rank), port], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        out, err = procs[1].communicate(timeout=60)
    finally:
        for p in procs:
            p.kill()
            p.communicate()
    seen = json.loads(out.strip().splitlines()[-1])
    assert "timed out" in seen["recv"].lower() or "timeout" in seen["recv"].lower(), seen
    assert seen["shm_recv"].startswith("ChannelError") and "timed out" in seen["shm_recv"], seen
    assert "timed out" in seen["all_reduce"].lower() or "timeout" in seen["all_reduce"].lower(), seen
