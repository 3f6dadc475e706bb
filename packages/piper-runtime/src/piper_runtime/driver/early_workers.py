"""Rank workers started with the embedded cluster, while the driver captures and compiles.

A Ray rank worker is a Python process that imports torch and, at its first optimizer step,
torch's compiler stack (``torch._dynamo``, sympy: 800 modules): seconds of CPU per rank before
the first step. The embedded cluster already starts on a thread of its own while the driver
captures the model and compiles the plans (``cluster.start_early``); when the device count is
known by then (``piper_directives.device_count``), the same thread goes on to reserve one
bundle per rank (``placement.reserve``), start a ``RankWorker`` in each and have it import
what a rank needs (``RankWorker.warm``), all before the program exists.

``RayRanks`` takes them (``take``) when they are what it would have started: as many ranks,
the same CPUs per rank, backend, GPUs per rank, placement policy and worker environment, on
the cluster they were started on. It then assigns the program's ranks to their bundles as
``place_ranks`` would (``Reservation.assign``) and gives each rank the worker in its bundle.
Workers that do not fit are killed and their bundles given back; so are workers nobody takes
(they die with the embedded cluster at the latest). Only an embedded cluster without worker
reuse starts them (a pool hands out warm workers of its own).
"""

from __future__ import annotations

from typing import Any

import attrs

from piper_runtime.options import ClusterOptions


@attrs.frozen
class WorkerRequest:
    """What the driver will ask of the runtime: ``world`` ranks started with ``cluster``."""

    world: int
    cluster: ClusterOptions


@attrs.frozen
class EarlyWorkers:
    """Workers started for a ``WorkerRequest``, one per bundle of ``reserved`` (in bundle
    order), with the backend chosen for them and the environment they got."""

    request: WorkerRequest
    backend: str
    backend_reason: str
    env: tuple[tuple[str, str], ...]
    reserved: Any  # placement.Reservation
    workers: tuple[Any, ...]

    def fits(self, world: int, cluster: ClusterOptions, env: dict[str, str]) -> bool:
        """Whether these are the workers ``RayRanks`` would start for ``world`` ranks."""
        asked = self.request.cluster
        return (world == self.request.world and cluster.cpus_per_rank == asked.cpus_per_rank
                and cluster.ranks_per_gpu == asked.ranks_per_gpu and cluster.backend == asked.backend
                and cluster.placement == asked.placement and tuple(sorted(env.items())) == self.env)

    def discard(self) -> None:
        """Kill the workers and give their bundles back."""
        from ray.util.placement_group import remove_placement_group

        from piper_runtime.driver.pool import kill_workers

        kill_workers(list(self.workers))
        try:
            remove_placement_group(self.reserved.group)
        except Exception:  # already gone with the cluster
            pass


def start(request: WorkerRequest) -> EarlyWorkers:
    """Reserve the bundles and start a warming worker in each (module doc). Runs on the thread
    that started the embedded cluster, once Ray is up."""
    from piper_runtime.backends import backend_factory
    from piper_runtime.driver.cluster import choose_backend, worker_env
    from piper_runtime.driver.placement import reserve
    from piper_runtime.driver.pool import worker_actor
    from piper_runtime.driver.prestart import runtime_env_for

    cluster, world = request.cluster, request.world
    backend, reason = choose_backend(cluster.backend, world, 1.0 / cluster.ranks_per_gpu)
    gpus_per_rank = backend_factory(backend)().gpus_per_rank / cluster.ranks_per_gpu
    reserved = reserve(world, cpus_per_rank=cluster.cpus_per_rank, gpus_per_rank=gpus_per_rank,
                       policy=cluster.placement, backend=backend, timeout_s=30.0)
    env = worker_env()
    workers = tuple(
        worker_actor(max_restarts=0, runtime_env=runtime_env_for(env), **reserved.bundle_options(b)).remote()
        for b in range(world)
    )
    for w in workers:
        w.warm.remote()
    return EarlyWorkers(request, backend, reason, tuple(sorted(env.items())), reserved, workers)
