"""The cluster around a run: which ranks go together on compiled programs, what a run
listens on, and a cluster too small (or without a GPU) refused before anything starts.
(Placement and cluster checks as functions: packages/piper-runtime/tests/test_placement.py;
across two nodes: test_multinode.py.)"""

from __future__ import annotations

import ipaddress
import os
import time

import pytest
import torch

from piper_directives import Place, Shard, Split, Strategy, build_schedule, capture, shard_modules
from piper_ir import ClusterError
from piper_memory import plan_memory
from piper_runtime.driver.placement import affinity_units
from piper_runtime.testing import listening
from piper_scheduler import compile_program
from piper_train.models import build_model


def _program(model: str, stages: int, strategy: Strategy):
    workload = build_model(model, stages=stages, seed=0)
    captured = capture(workload.model, workload.example_inputs, workload.example_targets, workload.loss_fn)
    graph, modules = shard_modules(strategy.apply(captured.graph), captured.modules)
    return compile_program(plan_memory(graph)), modules, workload


# -- which ranks go together ---------------------------------------------------------------------


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



# -- a real run ---------------------------------------------------------------------------------------------


@pytest.mark.ray
def test_a_run_listens_on_loopback_only_and_reserves_a_bundle_per_rank(ray_cluster) -> None:
    """Every socket the run opened (the store on rank 0, gloo's pairs) listens on a loopback
    address, none on 0.0.0.0 or ::. A Ray worker listens on a wildcard address by itself (its
    core worker server, Ray's own): a worker of the run has no more of those than a bare one
    (an actor of a class that imports nothing: a rank's worker would import torch first,
    seconds for a baseline that only needs Ray's sockets)."""
    import ray

    from piper_runtime import OptimizerSpec, Runtime

    class Bare:
        def ping(self) -> int:
            return os.getpid()

    wildcards = {"0.0.0.0", "::"}
    program, modules, workload = _program("mlp", 2, build_schedule("1f1b", 2, 2, stages=2))
    bare = ray.remote(Bare).options(num_cpus=1).remote()
    ray_own = sum(a in wildcards for a, _ in listening(ray.get(bare.ping.remote(), timeout=60)))
    ray.kill(bare)
    # New workers, placed in a placement group (pooled ones reserve no bundle).
    with Runtime(program, modules, OptimizerSpec("sgd", 0.1), reuse_workers=False) as rt:
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


@pytest.mark.ray
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


@pytest.mark.ray
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_cuda_on_a_machine_without_a_gpu_is_refused_before_ray_starts(monkeypatch) -> None:
    import ray

    from piper_runtime import Runtime

    program, modules, _ = _program("mlp", 2, build_schedule("1f1b", 2, 2, stages=2))
    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # as in a fresh process
    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("Ray was started"))
    with pytest.raises(ClusterError, match=r"backend 'cuda' needs a GPU for each rank.*torch.cuda.is_available\(\) is False"):
        Runtime(program, modules, backend="cuda")
