"""``SpmdRanks`` (the ``torchrun`` runtime) without torchrun: two of them in one process, each one
rank of a two-rank job, meet at a TCPStore this test serves as torchrun's agent would. What is
tested is the line between them: a call on the own rank runs here and is published, a peer's
is read from the store and deleted once read; exceptions, drivers that diverged, the watchdog's
progress, agreement and a run one process ended. Joining a process group needs a process per
rank: integration/test_torchrun.py launches torchrun for that."""

from __future__ import annotations

import concurrent.futures as cf
import datetime
import os
import threading
import time
import uuid
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch.distributed as dist

from piper_ir import ClusterError, ExecutionError
from piper_runtime.driver.ranks import RankFailure
from piper_runtime.driver.spmd_ranks import Launch, SpmdRanks, choose_backend
from piper_runtime.options import RunOptions
from piper_runtime.rendezvous import LOOPBACK, attach_store, free_port, make_store

AGENT = {"TORCHELASTIC_USE_AGENT_STORE": "True"}


@pytest.fixture
def agent() -> Iterator[tuple[Any, int]]:
    """A store served as torchrun's agent serves one: the ranks are clients."""
    port = free_port()
    store = dist.TCPStore(LOOPBACK, port, 2, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
    yield store, port
    del store


@pytest.fixture
def pair(agent: tuple[Any, int]) -> Iterator[list[SpmdRanks]]:
    """Ranks 0 and 1 of one launch, as two processes would start them (they meet at start)."""
    _, port = agent
    run = uuid.uuid4().hex
    launches = [Launch(r, 2, r, LOOPBACK, port, run, 0) for r in range(2)]
    with cf.ThreadPoolExecutor(2) as pool:
        pair = list(pool.map(lambda launch: SpmdRanks(SimpleNamespace(world_size=2), RunOptions(), None, (),
                                                      launch=launch), launches))
    yield pair
    for ranks in pair:
        ranks.close(clean=True)


def _both(pair: list[SpmdRanks], rank: int, method: str, *args: Any) -> list[Any]:
    """Each process's call of ``method`` on ``rank``, as both drivers make it."""
    return [ranks.call(rank, method, *args) for ranks in pair]


def test_each_process_runs_its_own_rank_and_reads_the_peers(pair: list[SpmdRanks]) -> None:
    a, b = pair
    assert (a.coordinator, b.coordinator) == (True, False)
    assert a.writer == b.writer and a.writer.startswith(f"{os.getpid()}@")  # rank 0's process names it
    calls = [_both(pair, rank, "ping") for rank in (0, 1)]  # in one order in every process
    for p, ranks in enumerate(pair):
        handles = [calls[0][p], calls[1][p]]
        assert ranks.wait(handles, 10, every=True) == sorted(handles, key=lambda h: h is not calls[p][p])  # own first
        assert [ranks.get(h, r) for r, h in enumerate(handles)] == [os.getpid(), os.getpid()]
    # Each outcome was read by its one peer, which deleted it.
    assert not any(a._store.check([key]) for key in ("calls/0/0", "calls/0/0/reads", "calls/0/1", "calls/0/1/reads"))


def test_an_exception_reaches_every_process_with_its_type(pair: list[SpmdRanks]) -> None:
    handles = _both(pair, 1, "restore")  # a worker that was not set up with a backup raises
    for ranks, handle in zip(pair, handles, strict=True):
        ranks.wait([handle], 10)
        with pytest.raises(RankFailure) as failure:
            ranks.get(handle, 1)
        assert failure.value.how == "raised" and isinstance(failure.value.cause, ExecutionError)
        assert "restore without a backup" in failure.value.text


def test_drivers_that_diverged_are_named(pair: list[SpmdRanks]) -> None:
    a, b = pair
    a.call(0, "ping")
    handle = b.call(0, "cores")  # process 1's driver made another call than process 0's
    b.wait([handle], 10)
    with pytest.raises(RankFailure, match="drivers diverged: this one's call was cores, the process of rank 0 "
                                          "answered ping"):
        b.get(handle, 0)


def test_each_process_watches_its_own_rank(pair: list[SpmdRanks]) -> None:
    a, _ = pair
    peer = a.call(1, "progress", group="monitor")
    assert a.wait([peer], 0) == [peer] and a.get(peer, 1) is None  # cannot say, at once
    own = a.call(0, "progress", group="monitor")
    a.wait([own], 10)
    assert a.get(own, 0) is None  # the own worker answered: not set up yet


def test_every_process_takes_the_coordinators_decision(pair: list[SpmdRanks]) -> None:
    a, b = pair
    assert a.agree(3) == 3
    assert b.agree(7) == 3
    assert [a.agree("x"), b.agree("y")] == ["x", "x"]


def test_a_run_one_process_ended_fails_the_others_waits(pair: list[SpmdRanks]) -> None:
    a, b = pair
    handle = b.call(0, "ping")  # process 0 never makes this call: its run failed
    a.kill()
    assert b.wait([handle], 10) == [handle]
    with pytest.raises(RankFailure, match="the process of rank 0 ended the run") as failure:
        b.get(handle, 0)
    assert failure.value.how == "died"


def test_a_process_not_launched_by_torchrun_is_told_how(agent: tuple[Any, int]) -> None:
    with pytest.raises(ClusterError, match="RANK, WORLD_SIZE.*not set.*torchrun --nproc-per-node"):
        Launch.from_env({})
    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": LOOPBACK, "MASTER_PORT": "1"}
    with pytest.raises(ClusterError, match="TORCHELASTIC_USE_AGENT_STORE"):
        Launch.from_env(env)
    assert Launch.from_env({**env, **AGENT}) == Launch(0, 2, 0, LOOPBACK, 1)


def test_a_world_of_another_size_names_both_numbers() -> None:
    with pytest.raises(ClusterError, match=r"4 ranks, but torchrun launched WORLD_SIZE=2 processes: pp\*dp\*tp\*ep "
                                           "must equal --nproc-per-node x nodes"):
        SpmdRanks(SimpleNamespace(world_size=4), RunOptions(), None, (), launch=Launch(0, 2, 0, LOOPBACK, 1))


def test_backends_of_one_process_per_rank() -> None:
    assert choose_backend("cpu", 0)[0] == "cpu"
    with pytest.raises(ClusterError, match="one rank per process"):
        choose_backend("local", 0)


def test_every_rank_is_a_client_of_a_store_a_launcher_serves(agent: tuple[Any, int]) -> None:
    server, port = agent
    attach_store(LOOPBACK, port, "job/world")
    store = make_store(0, 2, LOOPBACK, port, 10.0)  # rank 0 too: the launcher's store is there already
    store.set("k", "v")
    assert server.get("job/world/k") == b"v"


def test_an_outcome_published_before_its_process_ended_the_run_is_read_not_a_death(
        pair: list[SpmdRanks], monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = pair
    handles = _both(pair, 0, "restore")  # process 0's rank raises; its process then ends the run
    a.wait([handles[0]], 10)
    a.kill()
    # Process 1 looked for the outcome just before it was published, and at the abort just after.
    monkeypatch.setattr(b, "_store", _LateStore(b._store, handles[1].key))
    assert b.wait([handles[1]], 10) == [handles[1]]
    with pytest.raises(RankFailure) as failure:
        b.get(handles[1], 0)
    assert failure.value.how == "raised" and "restore without a backup" in failure.value.text


def test_ending_the_run_first_publishes_what_its_own_rank_raised(
        pair: list[SpmdRanks], monkeypatch: pytest.MonkeyPatch) -> None:
    """Process 0's call is ready as soon as its rank raised, before the outcome is in the store;
    ending the run then still lets process 1 read why rank 0 failed, not only that it died."""
    a, b = pair
    monkeypatch.setattr(a, "_store", _SlowStore(a._store, "calls/0/0", 0.5))
    handles = _both(pair, 0, "restore")  # process 0's rank raises
    assert a.wait([handles[0]], 10) == [handles[0]]
    a.kill()
    assert b.wait([handles[1]], 10) == [handles[1]]
    with pytest.raises(RankFailure) as failure:
        b.get(handles[1], 0)
    assert failure.value.how == "raised" and "restore without a backup" in failure.value.text


def test_a_rank_that_fails_after_a_peer_ended_the_run_names_the_peers_failure(pair: list[SpmdRanks]) -> None:
    """Process 1's rank fails too (as a rank does whose peer's process exited), but process 0
    ended the run first: process 1 names rank 0's failure, the run's cause, as process 0 does."""
    a, b = pair
    peer_of_b, own_of_b = _both([b], 0, "restore")[0], b.call(1, "restore")  # both ranks raise: no backup
    assert b.wait([own_of_b], 10) == [own_of_b]  # process 1's rank failed; its driver has not acted yet
    own_of_a, _ = a.call(0, "restore"), a.call(1, "restore")
    assert a.wait([own_of_a], 10) == [own_of_a]
    a.kill()  # process 0 ends the run first
    ready = b.wait([peer_of_b, own_of_b], 10, every=True)
    assert ready == [peer_of_b, own_of_b]
    with pytest.raises(RankFailure) as failure:
        b.get(peer_of_b, 0)
    assert failure.value.how == "raised" and "restore without a backup" in failure.value.text


class _SlowStore:
    """A store whose ``set`` of ``slow`` takes ``delay_s`` before the value is in: a publishing
    thread that lost its core."""

    def __init__(self, store: Any, slow: str, delay_s: float) -> None:
        self._store, self._slow, self._delay_s = store, slow, delay_s

    def set(self, key: str, value: Any) -> None:
        if key == self._slow:
            time.sleep(self._delay_s)
        self._store.set(key, value)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


class _LateStore:
    """A store whose first look for ``late`` finds nothing, as a look just before it was set would."""

    def __init__(self, store: Any, late: str) -> None:
        self._store, self._late = store, late

    def check(self, keys: list[str]) -> bool:
        if keys == [self._late] and self._late:
            self._late = ""
            return False
        return self._store.check(keys)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def test_a_rank_whose_failure_ended_the_run_is_named_by_its_own_process(
        pair: list[SpmdRanks], monkeypatch: pytest.MonkeyPatch) -> None:
    """Process 1's rank raises; process 0 reads that and ends the run before process 1's call
    has returned from publishing it. Process 1 still names its own rank's failure, not process
    0's ending of the run (a race seen under torchrun on a loaded machine)."""
    a, b = pair
    published = threading.Event()
    release = threading.Event()
    monkeypatch.setattr(b, "_store", _HeldStore(b._store, "calls/0/1", published, release))
    try:
        own = b.call(1, "restore")  # raises: no backup
        assert published.wait(10)  # the outcome is in the store; the call has not returned
        peer_of_a = a.call(1, "restore")
        a.wait([peer_of_a], 10)
        with pytest.raises(RankFailure):
            a.get(peer_of_a, 1)
        a.kill()  # what process 0 does on a failure: it ends the run
        waiting_on_0 = b.call(0, "ping")  # never made by process 0
        ready = b.wait([own, waiting_on_0], 10)
        assert ready[0] is own
    finally:
        release.set()
    with pytest.raises(RankFailure) as failure:
        b.get(own, 1)
    assert failure.value.how == "raised" and "restore without a backup" in failure.value.text


class _HeldStore:
    """A store whose ``set`` of ``held`` returns only once ``release`` is set (``published`` tells
    that the value is in): a thread that loses its core right after publishing."""

    def __init__(self, store: Any, held: str, published: threading.Event, release: threading.Event) -> None:
        self._store, self._held, self._published, self._release = store, held, published, release

    def set(self, key: str, value: Any) -> None:
        self._store.set(key, value)
        if key == self._held:
            self._published.set()
            self._release.wait(10)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)
