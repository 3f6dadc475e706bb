"""Placement (which rank on which node), the cluster checks that come before it, and the
backend choice, as functions; on compiled programs and real runs: integration/test_cluster.py."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import ray

from piper_ir import ClusterError
from piper_runtime.driver import cluster
from piper_runtime.driver.cluster import (
    _keeping_sigterm_handler,
    check_address,
    choose_backend,
    requested_address,
    split_address,
)
from piper_runtime.driver.placement import assign_ranks, check_resources

# -- which ranks go together (compiled programs: integration/test_cluster.py) ------------------


def test_pack_keeps_pipeline_neighbours_on_a_node_and_spreads_replicas() -> None:
    units = [(0,), (1,), (2,), (3,)]
    assert assign_ranks(units, ["A", "A", "B", "B"]) == [0, 1, 2, 3]
    # Ray's SPREAD interleaves bundles over nodes; ranks still pair up by node
    bundles = assign_ranks(units, ["A", "B", "A", "B"])
    node = ["A", "B", "A", "B"]
    assert node[bundles[0]] == node[bundles[1]] and node[bundles[2]] == node[bundles[3]]
    assert node[bundles[0]] != node[bundles[2]]
    assert sorted(bundles) == [0, 1, 2, 3]


def test_a_group_goes_whole_to_a_node_with_room_and_is_split_only_when_none_has() -> None:
    # nodes of 3: the second group does not fit beside the first, so it takes the other node
    six = ["A", "A", "A", "B", "B", "B"]
    got = assign_ranks([(0, 1), (2, 3), (4, 5)], six)
    node = [six[b] for b in got]
    assert node[0] == node[1] and node[2] == node[3] and node[0] != node[2]
    assert node[4] != node[5]  # one node of room left on each: the last group must be split
    assert sorted(got) == list(range(6))
    with pytest.raises(ValueError, match="2 ranks for 3 bundles"):
        assign_ranks([(0, 1)], ["A", "A", "B"])


# -- what the cluster has --------------------------------------------------------------------------------


def test_too_few_cpus_or_gpus_name_what_is_missing() -> None:
    check_resources(4, 1.0, 0.0, {"CPU": 4.0}, "cpu")
    with pytest.raises(ClusterError, match=r"the Ray cluster has 2 CPUs; the program's 4 ranks need 4 \(1 each\)"):
        check_resources(4, 1.0, 0.0, {"CPU": 2.0}, "cpu")
    with pytest.raises(ClusterError, match=r"backend 'cuda': the Ray cluster has no GPU; the program's 4 ranks need 4"):
        check_resources(4, 1.0, 1.0, {"CPU": 8.0}, "cuda")
    with pytest.raises(ClusterError, match=r"has 1 GPUs; the program's 4 ranks need 4 \(one GPU each\); to share "
                                           r"GPUs between ranks, pass --ranks-per-gpu 4"):
        check_resources(4, 1.0, 1.0, {"CPU": 8.0, "GPU": 1.0}, "cuda")
    check_resources(4, 1.0, 0.25, {"CPU": 8.0, "GPU": 1.0}, "cuda")  # --ranks-per-gpu 4 fits


def test_backend_choice_says_why(monkeypatch) -> None:
    resources = {"CPU": 8.0}
    monkeypatch.setattr(cluster.ray, "cluster_resources", lambda: resources)
    assert choose_backend("cuda", 4, 1.0) == ("cuda", "backend 'cuda' (asked for)")
    assert choose_backend(None, 4, 1.0) == ("cpu", "backend 'cpu' (the Ray cluster has no GPU)")
    resources["GPU"] = 2.0
    name, why = choose_backend(None, 4, 1.0)
    assert name == "cpu" and "has 2 GPUs, 4 ranks need 4" in why and "--ranks-per-gpu" in why
    probed = []
    monkeypatch.setattr(cluster, "_probe_gpu_worker", lambda gpus: probed.append(gpus) or None)
    assert choose_backend(None, 4, 0.5) == ("cuda", "backend 'cuda' (2 GPUs in the cluster for 4 ranks)")
    assert probed == [0.5]
    monkeypatch.setattr(cluster, "_probe_gpu_worker", lambda gpus: "cupy is not importable")
    assert choose_backend(None, 2, 1.0) == (
        "cpu",
        "backend 'cpu' (a GPU worker cannot run the CUDA backend: cupy is not importable)",
    )


# -- the address of an existing cluster -----------------------------------------------------------------


def test_ray_addresses_are_read_with_their_default_ports() -> None:
    assert split_address("10.0.0.5") == ("10.0.0.5", 6379)
    assert split_address("head:6380") == ("head", 6380)
    assert split_address("ray://head") == ("head", 10001)
    assert split_address("[fd00::2]:6379") == ("fd00::2", 6379)
    with pytest.raises(ValueError, match="bad port"):
        split_address("head:x")


def test_an_address_nothing_listens_on_fails_at_once_naming_it() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connections are refused
        started = time.monotonic()
        with pytest.raises(ClusterError, match=rf"cannot reach the Ray cluster at '127.0.0.1:{port}'"):
            check_address(f"127.0.0.1:{port}")
        assert time.monotonic() - started < 30


def test_ray_address_in_the_environment_is_where_to_connect(monkeypatch) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert requested_address(None) is None  # an embedded cluster
    assert requested_address("head:6379") == "head:6379"
    monkeypatch.setenv("RAY_ADDRESS", "head:6380")
    assert requested_address(None) == "head:6380"  # Ray's convention
    assert requested_address("head:6379") == "head:6379"  # an explicit address wins
    monkeypatch.setenv("RAY_ADDRESS", "local")
    assert requested_address(None) is None


def test_ensure_ray_checks_the_address_ray_address_names() -> None:
    # In a fresh interpreter (this one's Ray is up): an embedded start used to pass num_cpus
    # to Ray, which then tried to join RAY_ADDRESS and failed with Ray's own message.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connections are refused
        code = "from piper_runtime import ensure_ray\nensure_ray(num_cpus=2)"
        done = subprocess.run([sys.executable, "-c", code], env={**os.environ, "RAY_ADDRESS": f"127.0.0.1:{port}"},
                              capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert f"ClusterError: RAY_ADDRESS: cannot reach the Ray cluster at '127.0.0.1:{port}'" in done.stderr


def test_an_address_that_is_not_ray_is_refused() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)  # accepts (the kernel does, at once: loopback), then says nothing
        port = s.getsockname()[1]
        with pytest.raises(ClusterError, match="accepts connections but does not answer as a Ray cluster"):
            check_address(f"127.0.0.1:{port}", timeout_s=0.5)


def test_a_running_ray_cluster_passes_the_check(ray_cluster) -> None:
    import ray

    check_address(ray.get_runtime_context().gcs_address)


def test_a_large_argument_travels_inside_the_call(ray_cluster) -> None:
    # Ray's default puts an argument over 100 KiB in the object store, where the caller owns a
    # reference to it until the call ends; the driver's settings (``cluster.INLINE_ENV``, which
    # the session's Ray was started with, as ``ensure_ray`` starts it) send it inside the call.
    @ray.remote(num_cpus=0)
    def hold(a: np.ndarray, seconds: float) -> int:
        time.sleep(seconds)
        return a.nbytes

    caller = ray._private.worker.global_worker.core_worker
    before = set(caller.get_all_reference_counts())
    ref = hold.remote(np.ones(2**18, dtype=np.float32), 1.0)  # 1 MiB
    added = {k: v for k, v in caller.get_all_reference_counts().items() if k not in before}
    assert ref.hex().encode() in added
    # An argument in the object store is a reference the running call holds ("submitted").
    assert not [k for k, counts in added.items() if counts.get("submitted")], added
    assert ray.get(ref, timeout=60) == 2**20


def test_a_sigterm_handler_of_the_program_outlives_ray_init() -> None:
    """``ray.init`` replaces SIGTERM's handler; ``ensure_ray`` puts the program's own back
    (``piper train`` stops at a step boundary on SIGTERM), and leaves Ray's where the
    program had none. Ray's replacing it is played here by a handler set inside; a SIGTERM
    that Ray's handler turned into ``SystemExit(15)`` goes to the program's handler."""
    previous = signal.getsignal(signal.SIGTERM)

    def ours(signum, frame) -> None:
        pass

    def rays(signum, frame) -> None:
        pass

    try:
        signal.signal(signal.SIGTERM, ours)
        with _keeping_sigterm_handler():
            signal.signal(signal.SIGTERM, rays)
        assert signal.getsignal(signal.SIGTERM) is ours
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        with _keeping_sigterm_handler():
            signal.signal(signal.SIGTERM, rays)
        assert signal.getsignal(signal.SIGTERM) is rays

        def raising(signum, frame) -> None:
            raise KeyboardInterrupt("ours")

        signal.signal(signal.SIGTERM, raising)
        with pytest.raises(KeyboardInterrupt, match="ours"), _keeping_sigterm_handler():
            raise SystemExit(signal.SIGTERM)  # what Ray's handler does with a SIGTERM during ray.init
        assert signal.getsignal(signal.SIGTERM) is raising
    finally:
        signal.signal(signal.SIGTERM, previous)
