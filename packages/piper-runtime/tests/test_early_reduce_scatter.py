"""The early reduce-scatter of sharded gradients (``piper_runtime.rank.buckets.EarlyReduceScatter``)
in one process, on a one-rank communicator of the CPU backend (a reduce-scatter over one rank
is the identity): buckets are issued during the backward, last bucket first, so the full
gradients of both buckets never exist at once, and every reduced shard lands in the gradient
shard exactly once."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

from piper_ir import Bucket
from piper_memory import zero_residency
from piper_runtime.backends import Communicator, CpuBackend
from piper_runtime.rank.buckets import BucketState, EarlyReduceScatter


@pytest.fixture
def group() -> Iterator[Communicator]:
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    backend = CpuBackend()
    backend.connect(0, 1, "127.0.0.1", port, 30.0)
    try:
        yield backend.communicator([0])
    finally:
        backend.shutdown()


def _buckets(model: nn.Sequential) -> list[BucketState]:
    out = []
    for k, layer in enumerate((model[0], model[2])):
        params = [layer.weight, layer.bias]
        numel = sum(p.numel() for p in params)
        bucket = Bucket(f"bucket:s:{k}", "s", ("weight", "bias"), numel, 1, **zero_residency(2))
        out.append(BucketState(bucket, params, replica=0))
    return out


def test_buckets_are_reduced_during_the_backward_last_first(group: Communicator) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    reference = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    reference.load_state_dict(model.state_dict())
    buckets = _buckets(model)
    issued: list[tuple[str, bool]] = []  # (bucket, did the first layer have gradients then?)

    def on_issue(_buffers: list[torch.Tensor]) -> None:
        current = next(b for b in buckets if any(p.grad is not None for p in b.params))
        issued.append((current.bucket.id, model[0].weight.grad is not None))

    reducer = EarlyReduceScatter(buckets, group, threading.RLock(), on_issue)
    x = torch.randn(5, 4)
    for step in range(2):  # two microbatches: shards accumulate
        reducer.begin()
        model(x * (step + 1)).square().sum().backward()
        reducer.finish()
        for b in buckets:
            reducer.wait(b.bucket.id)
        reference(x * (step + 1)).square().sum().backward()

    assert issued == [("bucket:s:1", False), ("bucket:s:0", True)] * 2
    for b, layer in zip(buckets, (reference[0], reference[2]), strict=True):
        assert all(p.grad is None for p in b.params)  # only the shard is kept
        expected = torch.cat([layer.weight.grad.flatten(), layer.bias.grad.flatten()])
        torch.testing.assert_close(b.shard.grad, expected)


def test_hooks_outside_a_pass_do_nothing(group: Communicator) -> None:
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    buckets = _buckets(model)
    EarlyReduceScatter(buckets, group, threading.RLock())
    model(torch.randn(2, 4)).sum().backward()  # not between begin() and finish()
    assert all(p.grad is not None for b in buckets for p in b.params)
    assert all(b.shard.grad is None for b in buckets)


@pytest.mark.parametrize("in_flight", [0, 1, 2])
def test_at_most_in_flight_reductions_run_at_once(group: Communicator, in_flight: int) -> None:
    """``ExecutionOptions.reduce_scatters_in_flight``: when a bucket is issued, at most that
    many earlier reductions still hold their buffers (three buckets, last first)."""
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    buckets = []
    for k, layer in enumerate((model[0], model[2], model[4])):
        params = [layer.weight, layer.bias]
        numel = sum(p.numel() for p in params)
        bucket = Bucket(f"bucket:s:{k}", "s", ("weight", "bias"), numel, 1, **zero_residency(2))
        buckets.append(BucketState(bucket, params, replica=0))
    running: list[int] = []  # earlier reductions alive at each issue (2 buffers each)
    reducer = EarlyReduceScatter(
        buckets, group, threading.RLock(), lambda buffers: running.append(len(buffers) // 2 - 1), in_flight
    )
    reducer.begin()
    model(torch.randn(5, 4)).square().sum().backward()
    reducer.finish()
    for b in buckets:
        reducer.wait(b.bucket.id)
    assert running == [min(k, in_flight) for k in range(3)]
    assert all(b.shard.grad is not None for b in buckets)
