"""``RayRanks``: every rank a Ray actor (``RankWorker`` in a process of its own).

Start-up: connect to Ray (``cluster``), pick the backend, reserve one placement-group bundle
per rank (``placement``: policy ``pack`` or ``spread``, fails fast when the cluster is too
small), start the actors in their bundles (or take the ones started with the embedded
cluster while the driver captured and compiled, ``early_workers``; or, reusing workers on a
one-node cluster, take them from a ``WorkerPool``: ``pool``); the rendezvous address is loopback when every rank is
on one node, else the address Ray reports for rank 0's node, with a port that rank 0's own
process opens and keeps for its TCP store (``piper_runtime.rendezvous``).

Workers are started for the run and killed by ``close``, unless they are pooled: then a clean
``close`` resets them and gives them back. A failed run's workers are killed all the same.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from piper_ir import ClusterError, Program
from piper_runtime.backends import BackendFactory, backend_factory, cuda_missing
from piper_runtime.driver.cluster import (
    choose_backend,
    embedded_cpus,
    ensure_ray,
    take_early_workers,
    worker_env,
)
from piper_runtime.driver.placement import Placement, check_resources, place_ranks
from piper_runtime.driver.pool import MONITOR, WRITER, WorkerSpec, kill_workers, pool_for, worker_actor
from piper_runtime.driver.prestart import runtime_env_for
from piper_runtime.driver.ranks import RankFailure
from piper_runtime.driver.user_code import ship_by_value
from piper_runtime.options import RunOptions
from piper_runtime.rendezvous import LOOPBACK

_RESET_TIMEOUT_S = 30.0
_GROUPS = {"monitor": MONITOR, "writer": WRITER}


class RayRanks:
    """``Ranks`` over Ray actors (module doc)."""

    binds_cores = True
    coordinator = True  # the one driver
    writer = None

    def __init__(
        self, program: Program, options: RunOptions, log: Callable[[str], None] | None, by_value: Sequence[str]
    ) -> None:
        cluster, world = options.cluster, program.world_size
        if cluster.backend is not None:
            backend_factory(cluster.backend)  # an unknown name fails before anything starts
        if cluster.backend == "cuda" and cluster.address is None and not ray.is_initialized():
            # The embedded cluster would run on this machine: no need to start it to know.
            lacking = cuda_missing()
            if lacking:
                raise ClusterError(f"backend 'cuda' needs a GPU for each rank, and this machine has none usable: {lacking}")
        ensure_ray(cluster.address, num_cpus=embedded_cpus(world, cluster.cpus_per_rank))
        ship_by_value(by_value)  # before anything is pickled for the workers
        # Workers started while the driver captured and compiled (``early_workers``), if they fit.
        early = take_early_workers()
        if early is not None and (pool_for(cluster.reuse_workers) is not None or not early.fits(world, cluster,
                                                                                                 worker_env())):
            early.discard()
            early = None
        if early is not None:
            self.backend_name, self.backend_reason = early.backend, early.backend_reason
        else:
            self.backend_name, self.backend_reason = choose_backend(cluster.backend, world, 1.0 / cluster.ranks_per_gpu)
        if log is not None:
            log(self.backend_reason)
        # Workers get the factory itself, so a backend registered in this process only works too.
        self.factory: BackendFactory = backend_factory(self.backend_name)
        gpus_per_rank = self.factory().gpus_per_rank / cluster.ranks_per_gpu
        self._pool = pool_for(cluster.reuse_workers) if _one_node() else None
        self._spec = WorkerSpec.of(self.backend_name, gpus_per_rank, worker_env())
        self.placement: Placement | None = None
        if self._pool is not None:
            # Pooled workers reserve no bundle, but a cluster too small is refused all the same.
            check_resources(world, cluster.cpus_per_rank, gpus_per_rank, ray.cluster_resources(), self.backend_name)
            self.workers: list[Any] = self._pool.acquire(world, self._spec)
            # Kills the actors on failure, garbage collection or interpreter exit, whichever
            # first (a clean close into the pool detaches it instead).
            self._finalizer = weakref.finalize(self, kill_workers, list(self.workers))
            self.address = LOOPBACK
        elif early is not None:
            self.placement = early.reserved.assign(program)
            self.workers = [early.workers[bundle] for bundle in self.placement.bundles]
            self._finalizer = weakref.finalize(self, _kill, list(self.workers), self.placement)
            self.address = self.placement.rendezvous_address
        else:
            self.placement = place_ranks(
                program,
                cpus_per_rank=cluster.cpus_per_rank,
                gpus_per_rank=gpus_per_rank,
                policy=cluster.placement,
                backend=self.backend_name,
                timeout_s=min(options.faults.setup_timeout_s, 30.0),
            )
            env = runtime_env_for(worker_env())
            self.workers = [
                worker_actor(max_restarts=0, runtime_env=env, **self.placement.actor_options(rank)).remote()
                for rank in range(world)
            ]
            # Kills the actors and releases their reservation on close, garbage collection or
            # interpreter exit, whichever first.
            self._finalizer = weakref.finalize(self, _kill, list(self.workers), self.placement)
            self.address = self.placement.rendezvous_address

    @property
    def world_size(self) -> int:
        return len(self.workers)

    @property
    def closed(self) -> bool:
        return not self.workers or not self._finalizer.alive

    def call(self, rank: int, method: str, *args: Any, group: str | None = None) -> Any:
        bound = getattr(self.workers[rank], method)
        if group is not None:
            bound = bound.options(concurrency_group=_GROUPS[group])
        return bound.remote(*args)

    def share(self, value: Any) -> Any:
        return ray.put(value)

    def wait(self, handles: Sequence[Any], timeout_s: float | None, every: bool = False) -> list[Any]:
        if not handles:
            return []
        ready, _ = ray.wait(list(handles), num_returns=len(handles) if every else 1, timeout=timeout_s)
        return ready

    def get(self, handle: Any, rank: int) -> Any:
        try:
            return ray.get(handle, timeout=10)
        except RayTaskError as exc:
            raise RankFailure("raised", str(exc), exc.cause) from None
        except RayActorError as exc:
            raise RankFailure("died", str(exc)) from None
        except GetTimeoutError:
            raise RankFailure("silent", "did not answer") from None

    def after_setup(self) -> None:
        """The runtime set its ranks up: the pool may start its spares now (``WorkerPool.spares``),
        no longer competing with the setup for the CPU."""
        if self._pool is not None:
            self._pool.start_spares(self._spec)

    def kill(self) -> None:
        self._finalizer()

    def close(self, clean: bool) -> None:
        if not self._finalizer.alive:
            return
        if self._pool is not None and clean and self._reset_workers():
            self._finalizer.detach()
            workers, self.workers = self.workers, []  # the pool's now, maybe another runtime's
            self._pool.release(workers, self._spec)
            return
        try:
            ray.wait([w.shutdown.remote() for w in self.workers], num_returns=len(self.workers), timeout=10)
        finally:
            self._finalizer()

    def _reset_workers(self) -> bool:
        """Reset every worker for reuse; whether all of them answered in time."""
        refs = [w.reset.remote() for w in self.workers]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=_RESET_TIMEOUT_S)
        if len(ready) < len(refs):
            return False
        try:
            ray.get(refs, timeout=_RESET_TIMEOUT_S)
        except Exception:  # a worker that cannot forget its run is not reused
            return False
        return True


def _one_node() -> bool:
    """Whether the Ray cluster this process is connected to has a single live node."""
    return sum(1 for n in ray.nodes() if n.get("Alive")) == 1


def _kill(workers: list[Any], placement: Placement | None = None) -> None:
    kill_workers(workers)
    if placement is not None:
        placement.release()
