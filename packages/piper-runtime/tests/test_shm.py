"""Shared-memory channels (``piper_runtime.backends.shm``), both ends in this process (ranks
as threads; the ring is mapped twice, as two processes would): what arrives, in what order,
with rings too small for the traffic, and what a wrong size, a closed peer or a silent peer
does. The channels between Ray workers run in every CPU integration test."""

from __future__ import annotations

import collections
import errno
import functools
import os
import secrets
import threading
import time
from pathlib import Path

import pytest
import torch

from piper_runtime.backends import shm
from piper_runtime.backends.shm import CAPACITY, ChannelError, open_channels
from piper_runtime.testing import on_every_rank

pytestmark = pytest.mark.skipif(not shm.shm_available(), reason="no /dev/shm or FIFOs here")


class _Agree:
    """``agree`` for ranks as threads: a barrier that also says whether every rank was ok."""

    def __init__(self) -> None:
        self.barrier = threading.Barrier(2, timeout=10)
        self.calls = [0, 0]
        self.oks: collections.defaultdict[int, list[bool]] = collections.defaultdict(list)

    def __call__(self, rank: int, ok: bool) -> bool:
        n = self.calls[rank]
        self.calls[rank] += 1
        self.oks[n].append(ok)
        self.barrier.wait()
        return all(self.oks[n])


def _pair(timeout_s: float = 20.0, pairs: tuple[tuple[int, int], ...] = ((0, 1), (1, 0))) -> list:
    """Both ranks' ends of ``pairs``: ``[(senders, receivers) of rank 0, ... of rank 1]``."""
    agree = _Agree()
    prefix = f"piper-test-{secrets.token_hex(4)}"
    return on_every_rank(
        2, lambda rank: open_channels(prefix, rank, list(pairs), functools.partial(agree, rank), timeout_s)
    )


def _close(ends: list) -> None:
    for senders, receivers in ends:
        for ch in (*senders.values(), *receivers.values()):
            ch.close()


def test_messages_arrive_whole_and_in_order_whatever_their_size_and_dtype() -> None:
    ends = _pair()
    sender, receiver = ends[0][0][1], ends[1][1][0]
    messages = [
        torch.randn(4, 32, 256),  # the activation of a small model's microbatch
        torch.arange(7, dtype=torch.int64),
        torch.randn(3).to(torch.bfloat16),
        torch.tensor([True, False, True]),
        torch.empty(0),
        torch.randn(int(2.5 * CAPACITY) // 4),  # over two rings' worth: chunks and the sender thread
        torch.tensor(3.5),
    ]
    try:
        works = [sender.send(m) for m in messages]
        got = [torch.empty_like(m) for m in messages]
        for g in got:
            receiver.recv(g).wait()
        for w in works:
            w.wait()
        for m, g in zip(messages, got, strict=True):
            assert torch.equal(m, g)
    finally:
        _close(ends)


def test_many_small_messages_more_than_the_ring_holds_and_waits_out_of_order() -> None:
    ends = _pair()
    sender, receiver = ends[0][0][1], ends[1][1][0]
    n = 3 * CAPACITY // shm.ALIGN  # each takes one aligned block: three rings' worth
    try:
        works = [sender.send(torch.tensor([float(i)])) for i in range(n)]  # the rest waits on a thread
        got = [torch.empty(1) for _ in range(n)]
        posted = [receiver.recv(g) for g in got]
        posted[-1].wait()  # fills every earlier receive on the way, in order
        assert all(p.done for p in posted)
        for w in works:
            w.wait()
        assert [int(g) for g in got] == list(range(n))
    finally:
        _close(ends)


def test_two_ranks_that_both_send_more_than_a_ring_before_receiving_do_not_deadlock() -> None:
    ends = _pair()
    big = [torch.full((3 * CAPACITY // 4,), float(r)) for r in range(2)]

    def exchange(rank: int) -> torch.Tensor:
        senders, receivers = ends[rank]
        work = senders[1 - rank].send(big[rank])  # neither ring can hold it
        got = torch.empty_like(big[rank])
        receivers[1 - rank].recv(got).wait()
        work.wait()
        return got

    try:
        got = on_every_rank(2, exchange, timeout_s=60)
        assert torch.equal(got[0], big[1]) and torch.equal(got[1], big[0])
    finally:
        _close(ends)


def test_a_message_longer_than_the_posted_receive_is_an_error() -> None:
    ends = _pair()
    try:
        ends[0][0][1].send(torch.zeros(8))
        with pytest.raises(ChannelError, match="longer than the posted receive"):
            ends[1][1][0].recv(torch.empty(4)).wait()
    finally:
        _close(ends)


def test_a_receive_from_a_silent_peer_times_out() -> None:
    ends = _pair(timeout_s=0.3)
    try:
        start = time.monotonic()
        with pytest.raises(ChannelError, match="timed out"):
            ends[1][1][0].recv(torch.empty(4)).wait()
        assert time.monotonic() - start < 5
    finally:
        _close(ends)


def test_a_closed_peers_last_message_arrives_and_a_receive_past_it_fails_at_once() -> None:
    ends = _pair()
    try:
        ends[0][0][1].send(torch.tensor([1.0, 2.0]))
        ends[0][0][1].close()  # the sender's process would close its ends as it exits
        ends[0][0].clear()
        last = torch.empty(2)
        ends[1][1][0].recv(last).wait()
        assert last.tolist() == [1.0, 2.0]
        start = time.monotonic()
        with pytest.raises(ChannelError, match="closed the channel"):
            ends[1][1][0].recv(torch.empty(4)).wait()
        assert time.monotonic() - start < 5  # not the 20 s timeout
    finally:
        _close(ends)


def test_a_send_to_a_closed_peer_fails_and_a_blocked_send_gives_up_in_time() -> None:
    ends = _pair(timeout_s=0.5)
    try:
        sender = ends[0][0][1]
        blocked = sender.send(torch.zeros(2 * CAPACITY // 4))  # waits for space that never comes
        with pytest.raises(ChannelError):
            blocked.wait()
        # The wait and the sender thread each time out after timeout_s; until the thread has
        # too, a send queued behind the blocked one would inherit its timeout (seen under load).
        deadline = time.monotonic() + 10
        while sender.queue and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not sender.queue
        ends[1][1][0].close()
        ends[1][1].clear()
        with pytest.raises(ChannelError, match="closed the channel"):
            sender.send(torch.zeros(4)).wait()
    finally:
        _close(ends)


def test_no_file_is_left_behind_once_the_channels_are_open() -> None:
    before = set(os.listdir(shm.SHM_DIR))
    ends = _pair()
    try:
        assert set(os.listdir(shm.SHM_DIR)) - before == set()
    finally:
        _close(ends)


def test_when_one_rank_cannot_reserve_its_ring_no_rank_gets_channels_and_no_file_is_left(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = []
    reserve = os.posix_fallocate

    def full_once(fd: int, offset: int, length: int) -> None:
        calls.append(fd)
        if len(calls) == 1:  # the first rank to make its ring finds /dev/shm full
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        reserve(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", full_once)
    before = set(os.listdir(shm.SHM_DIR))
    assert _pair() == [None, None]  # the backend then sends through gloo
    assert len(calls) == 2
    assert set(os.listdir(shm.SHM_DIR)) == before


def test_when_a_rank_cannot_open_its_peers_files_no_rank_gets_channels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two processes that took one another for neighbours but see different /dev/shm."""
    real = shm._open_writer
    calls = []

    def elsewhere(path: Path) -> int:
        calls.append(path)
        if len(calls) == 1:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(path))
        return real(path)

    monkeypatch.setattr(shm, "_open_writer", elsewhere)
    before = set(os.listdir(shm.SHM_DIR))
    fds_before = set(os.listdir("/proc/self/fd"))
    assert _pair() == [None, None]
    assert set(os.listdir(shm.SHM_DIR)) == before
    assert set(os.listdir("/proc/self/fd")) <= fds_before  # every end made was closed
