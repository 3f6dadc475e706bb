"""Placement (which rank on which node), the cluster checks that come before it, backend
choice, and what a real run listens on."""

from __future__ import annotations

import importlib.util
import ipaddress
import socket
import time
from pathlib import Path

import pytest

from piper_directives import Place, Shard, Split, Strategy, build_schedule, capture, shard_modules
from piper_ir import ClusterError
from piper_memory import plan_memory
from piper_runtime import cluster
from piper_runtime.cluster import check_address, choose_backend, split_address
from piper_runtime.placement import affinity_units, assign_ranks, check_resources
from piper_scheduler import compile_program
from piper_train.models import build_model

_spec = importlib.util.spec_from_file_location("rendezvous_tests", Path(__file__).with_name("test_rendezvous.py"))
_rendezvous_tests = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_rendezvous_tests)
listening = _rendezvous_tests.listening


def _program(model: str, stages: int, strategy: Strategy):
    workload = build_model(model, stages=stages, seed=0)
    captured = capture(workload.model, workload.example_inputs, workload.example_targets, workload.loss_fn)
    graph, modules = shard_modules(strategy.apply(captured.graph), captured.modules)
    return compile_program(plan_memory(graph)), modules, workload


# -- which ranks belong together ---------------------------------------------------------------------


def test_pipeline_replicas_are_laid_out_one_chain_after_the_other() -> None:
    program, _, _ = _program("mlp", 2, build_schedule("1f1b", 2, 4, stages=2, dp=2))
    # ranks 0-1 are one pipeline, 2-3 the other; data-parallel pairs (0, 2), (1, 3)
    assert affinity_units(program) == [(0,), (1,), (2,), (3,)]


def test_tensor_parallel_groups_are_units() -> None:
    program, _, _ = _program(
        "transformer", 1, Strategy([Split(2), Place({"PP": 0}, (0, 1)), Shard({"PP": 0}, (0, 1))])
    )
    assert affinity_units(program) == [(0, 1)]
    program, _, _ = _program("transformer", 2, build_schedule("1f1b", 2, 2, stages=2, tp=2))
    units = affinity_units(program)
    assert sorted(len(u) for u in units) == [2, 2] and units[0] == (0, 1)


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


def test_an_address_that_is_not_ray_is_refused() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)  # accepts, then says nothing
        port = s.getsockname()[1]
        with pytest.raises(ClusterError, match="accepts connections but does not answer as a Ray cluster"):
            check_address(f"127.0.0.1:{port}", timeout_s=2)


def test_a_running_ray_cluster_passes_the_check(ray_cluster) -> None:
    import ray

    check_address(ray.get_runtime_context().gcs_address)


# -- a real run ---------------------------------------------------------------------------------------------


def test_a_run_listens_on_loopback_only_and_reserves_a_bundle_per_rank(ray_cluster) -> None:
    """Every socket the run opened (the store on rank 0, gloo's pairs) listens on a loopback
    address, none on 0.0.0.0 or ::. A Ray worker listens on a wildcard address by itself (its
    core worker server, Ray's own): a worker of the run has no more of those than a bare one."""
    import ray

    from piper_runtime import OptimizerSpec, RankWorker, Runtime

    wildcards = {"0.0.0.0", "::"}
    program, modules, workload = _program("mlp", 2, build_schedule("1f1b", 2, 2, stages=2))
    bare = ray.remote(RankWorker).options(num_cpus=1).remote()
    ray_own = sum(a in wildcards for a, _ in listening(ray.get(bare.ping.remote(), timeout=60)))
    ray.kill(bare)
    with Runtime(program, modules, OptimizerSpec("sgd", 0.1)) as rt:
        assert rt.backend_name == "cpu" and rt.placement.node_count == 1
        assert rt.rendezvous[0] == "127.0.0.1"
        assert ray.util.placement_group_table(rt.placement.group)["state"] == "CREATED"
        pids = ray.get([w.ping.remote() for w in rt._workers], timeout=60)
        rt.step(*workload.batches(0))
        opened = {rank: listening(p) for rank, p in enumerate(pids)}
    assert ray.util.placement_group_table(rt.placement.group)["state"] == "REMOVED"  # released with the run
    assert ("127.0.0.1", rt.rendezvous[1]) in opened[0]  # the store, on the rendezvous address
    for rank, sockets in opened.items():
        wild = [s for s in sockets if s[0] in wildcards]
        assert len(wild) == ray_own, f"rank {rank} listens on a wildcard address beyond Ray's own: {sockets}"
        ours = [s for s in sockets if s[0] not in wildcards]
        assert ours and all(_loopback(a) for a, _ in ours), (rank, sockets)


def _loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    return ip.is_loopback or (ip.version == 6 and ip.ipv4_mapped is not None and ip.ipv4_mapped.is_loopback)


def test_a_cluster_with_fewer_cpus_than_ranks_is_refused_before_anything_is_reserved(ray_cluster) -> None:
    import ray

    from piper_runtime import Runtime

    program, modules, _ = _program("mlp", 2, build_schedule("1f1b", 2, 2, stages=2))
    cpus = ray.cluster_resources()["CPU"]
    groups = len(ray.util.placement_group_table())
    started = time.monotonic()
    with pytest.raises(ClusterError, match=rf"the Ray cluster has {cpus:g} CPUs; the program's 2 ranks need {2 * cpus:g}"):
        Runtime(program, modules, cpus_per_rank=cpus)
    assert time.monotonic() - started < 10
    assert len(ray.util.placement_group_table()) == groups
