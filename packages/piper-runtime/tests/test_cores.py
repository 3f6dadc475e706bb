"""Binding ranks' step threads to cores of their own (``piper_runtime.rank.cores``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from piper_runtime.driver.pool import _answering
from piper_runtime.rank import cores as cores_module
from piper_runtime.rank.cores import bind_this_thread, claim, core_slices, describe, host_cores, unclaimed

linux_affinity = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux CPU affinity")


def test_ranks_of_a_host_split_its_cores_in_rank_order() -> None:
    hosts = [("a", (0, 1, 2, 3)), ("b", (0, 1)), ("a", (0, 1, 2, 3)), ("b", (0, 1))]
    assert core_slices(hosts) == {0: (0, 1), 2: (2, 3), 1: (0,), 3: (1,)}


def test_a_cpuset_with_gaps_is_split_by_position_and_spare_cores_stay_unused() -> None:
    assert core_slices([("a", (6, 0, 4, 2, 8))] * 2) == {0: (0, 2), 1: (4, 6)}


def test_a_host_offers_the_cores_all_of_its_ranks_saw_free() -> None:
    # Rank 1 looked after another job claimed core 1; rank 2 is on a host of its own.
    hosts = [("a", (0, 1, 2)), ("a", (0, 2)), ("b", (5,))]
    assert core_slices(hosts) == {0: (0,), 1: (2,), 2: (5,)}


def test_a_host_with_fewer_cores_than_ranks_binds_none_of_them() -> None:
    hosts = [("small", (0, 1))] * 3 + [("big", (0, 1, 2, 3))]
    assert core_slices(hosts) == {3: (0, 1, 2, 3)}
    assert core_slices([("x", ())]) == {}  # a platform that cannot say


def test_the_log_line_says_who_got_what_or_why_nobody_did() -> None:
    assert describe({0: (0,), 1: (2, 3), 2: (4, 6)}, 4) == (
        "cores: each rank's step threads bound to cores of their own (rank 0: 0, rank 1: 2-3, rank 2: 4,6, "
        "rank 3: unbound)"
    )
    assert describe({}, 2) == "cores: not bound (no host has a free core for each of its ranks)"
    assert describe({0: (0,)}, 2, claimed={"h": (2, 3), "g": ()}) == (
        "cores: each rank's step threads bound to cores of their own (rank 0: 0, rank 1: unbound; cores 2-3 of h "
        "held by another job)"
    )
    assert "bind_cores=False" in describe({0: (0,)}, 1, enabled=False)
    # Cores free when the job looked, claimed by another job before its ranks claimed them.
    assert describe({}, 2, planned={0: (0,), 1: (1,)}) == "cores: not bound (another job claimed the cores meanwhile)"
    assert describe({0: (0,)}, 2, planned={0: (0,), 1: (1,)}) == (
        "cores: each rank's step threads bound to cores of their own (rank 0: 0, rank 1: unbound (another job "
        "claimed its cores meanwhile))"
    )


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


def test_a_claim_is_all_or_nothing_and_other_processes_see_it_until_it_is_released(tmp_path: Path) -> None:
    first = claim((0, 1), tmp_path)
    assert first is not None and first.cores == (0, 1)
    assert unclaimed((0, 1, 2, 3), tmp_path) == (2, 3)
    assert claim((1, 2), tmp_path) is None  # core 1 is held: core 2 is not taken either
    assert unclaimed((0, 1, 2, 3), tmp_path) == (2, 3)
    first.release()
    assert unclaimed((0, 1, 2, 3), tmp_path) == (0, 1, 2, 3)
    both = claim((1, 2), tmp_path)
    assert both is not None
    both.release()


def test_the_claims_of_a_killed_process_are_gone_with_it(tmp_path: Path) -> None:
    """A job's claims cannot outlive it, however it ends (here SIGKILL)."""
    holder = subprocess.Popen(
        [sys.executable, "-c", (
            "import importlib.util, sys, pathlib\n"
            f"spec = importlib.util.spec_from_file_location('cores', {cores_module.__file__!r})\n"
            "cores = importlib.util.module_from_spec(spec); spec.loader.exec_module(cores)\n"
            f"held = cores.claim((3,), pathlib.Path({str(tmp_path)!r}))\n"
            "print(held.cores, flush=True); sys.stdin.read()\n"
        )],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "(3,)"
        assert unclaimed((2, 3), tmp_path) == (2,)
        assert claim((3,), tmp_path) is None
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    assert unclaimed((2, 3), tmp_path) == (2, 3)
    mine = claim((3,), tmp_path)
    assert mine is not None
    mine.release()


def test_where_no_claim_can_be_made_binding_goes_ahead_unclaimed(tmp_path: Path) -> None:
    blocked = tmp_path / "a-file-not-a-directory"
    blocked.write_text("")
    assert unclaimed((0, 1), blocked) == (0, 1)
    held = claim((0, 1), blocked)
    assert held is not None and held.cores == (0, 1)
    held.release()
