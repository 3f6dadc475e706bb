"""Binding ranks' step threads to cores of their own (``piper_runtime.cores``)."""

from __future__ import annotations

import os
import threading

import pytest

from piper_runtime.cores import bind_this_thread, core_slices, describe, host_cores
from piper_runtime.pool import _answering

linux_affinity = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux CPU affinity")


def test_ranks_of_a_host_split_its_cores_in_rank_order() -> None:
    hosts = [("a", (0, 1, 2, 3)), ("b", (0, 1)), ("a", (0, 1, 2, 3)), ("b", (0, 1))]
    assert core_slices(hosts) == {0: (0, 1), 2: (2, 3), 1: (0,), 3: (1,)}


def test_a_cpuset_with_gaps_is_split_by_position_and_spare_cores_stay_unused() -> None:
    assert core_slices([("a", (6, 0, 4, 2, 8))] * 2) == {0: (0, 2), 1: (4, 6)}


def test_a_host_with_fewer_cores_than_ranks_binds_none_of_them() -> None:
    hosts = [("small", (0, 1))] * 3 + [("big", (0, 1, 2, 3))]
    assert core_slices(hosts) == {3: (0, 1, 2, 3)}
    assert core_slices([("x", ())]) == {}  # a platform that cannot say


def test_the_log_line_says_who_got_what_or_why_nobody_did() -> None:
    assert describe({0: (0,), 1: (2, 3), 2: (4, 6)}, 4) == (
        "cores: each rank's step threads bound to cores of their own (rank 0: 0, rank 1: 2-3, rank 2: 4,6, "
        "rank 3: unbound)"
    )
    assert "no host has a core for each" in describe({}, 2)
    assert "bind_cores=False" in describe({0: (0,)}, 1, enabled=False)


@linux_affinity
def test_binding_holds_for_the_thread_and_the_threads_it_starts_and_is_undone() -> None:
    host = host_cores()
    assert host and set(host) == os.sched_getaffinity(os.getpid())
    seen: dict[str, set[int]] = {}

    def child() -> None:
        seen["child"] = os.sched_getaffinity(0)

    def step_thread() -> None:
        bind_this_thread(host[-1:])
        seen["bound"] = os.sched_getaffinity(0)
        t = threading.Thread(target=child)
        t.start()
        t.join()
        bind_this_thread(None)
        seen["unbound"] = os.sched_getaffinity(0)

    t = threading.Thread(target=step_thread)
    t.start()
    t.join()
    assert seen == {"bound": {host[-1]}, "child": {host[-1]}, "unbound": set(host)}
    assert os.sched_getaffinity(0) == set(host)  # the calling thread alone was bound


class _Gone:
    """An actor handle whose actor Ray no longer knows (its cluster was shut down)."""

    class ping:  # mirrors an actor method: handle.ping.remote()
        @staticmethod
        def remote() -> None:
            raise Exception("Can't find actor: it might be dead or it's from a different cluster")


def test_the_pool_skips_handles_of_a_cluster_that_is_gone() -> None:
    assert _answering([_Gone(), _Gone()]) == []


@linux_affinity
def test_cores_the_process_may_not_use_leave_the_thread_where_it_was() -> None:
    outside = max(host_cores()) + 4096  # no such core
    seen: dict[str, object] = {}

    def step_thread() -> None:
        seen["bound"] = bind_this_thread([outside])
        seen["cores"] = os.sched_getaffinity(0)

    t = threading.Thread(target=step_thread)
    t.start()
    t.join()
    assert seen == {"bound": False, "cores": set(host_cores())}
