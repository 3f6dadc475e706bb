"""Starting rank workers, and ``WorkerPool``: idle workers kept for the next ``Runtime``.

Starting a Ray actor means starting a Python process and importing torch in it: seconds per
rank, often more than the whole run on a small program. A ``WorkerPool`` keeps the actors of
a cleanly shut down ``Runtime`` (after ``RankWorker.reset``: the rank has left its process
group and dropped its program, modules and optimizer state, and the process-wide settings
the run touched are back to a fresh actor's) and hands them to the next ``Runtime`` whose
workers would be started with the same options (``WorkerSpec``: backend, GPUs, environment).

What the pool never does: reuse a worker of a run that failed, timed out or was interrupted
(``Runtime`` kills those), or a worker whose reset did not answer. It drops idle workers
that no longer answer a ping, and every idle worker when Ray was restarted since they
were started. Reuse is opt-in (``Runtime(..., reuse_workers=True)`` or
``PIPER_REUSE_WORKERS=1``): a pooled worker keeps the Python modules it imported, so code
imported by reference and edited on disk in between is not reloaded.

Spare workers (``WorkerPool(spares=N)``): a failed run's workers are killed, so the runtime a
restart starts (``fit(..., max_restarts=...)``) would wait seconds for new processes. Once a
runtime's workers are set up, it has the pool start, in the background, enough new workers
of their spec that ``N`` wait idle (``start_spares``; not before: starting processes beside a
setup slowed it from 0.2 s to 2-5 s): the next runtime of that spec, a restart's, takes warm
ones. A spare also imports, while idle, what a rank's first step would (``RankWorker.warm``:
building a torch optimizer imports ``torch._dynamo``, 2.4 s of a new worker's 2.7 s first
setup, measured). A spare still starting (or warming) when it is taken is
handed out as a new worker is (the runtime waits for its start, which began earlier); one
that started is pinged like any idle worker.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import attrs
import ray

from piper_runtime.driver.prestart import runtime_env_for
from piper_runtime.options import reuse_by_default
from piper_runtime.rank.worker import RankWorker

_PING_TIMEOUT_S = 10.0
# The concurrency group of ``RankWorker.progress``: the watchdog's reads run on a thread of
# their own, beside a step (every other method runs one at a time, in call order).
MONITOR = "monitor"
# The concurrency group of ``RankWorker.checkpoint_write``: a checkpoint's files are written on
# a thread of their own while the next steps run (``Runtime.save_checkpoint(wait=False)``).
WRITER = "writer"


def worker_actor(**options: Any) -> Any:
    """The ``RankWorker`` actor class, with ``options``."""
    actor = ray.remote(concurrency_groups={MONITOR: 1, WRITER: 1})(RankWorker)
    return actor.options(**options) if options else actor


@attrs.frozen
class WorkerSpec:
    """What a rank worker is started with; workers are interchangeable only within one spec
    (``backend`` is the backend's name: a worker's reset is that backend's)."""

    backend: str
    gpus: float = 0.0
    env: tuple[tuple[str, str], ...] = ()

    @classmethod
    def of(cls, backend: str, gpus: float, env: Mapping[str, str]) -> WorkerSpec:
        return cls(backend, gpus, tuple(sorted(env.items())))

    def start(self, count: int) -> list[Any]:
        """``count`` new ``RankWorker`` actors (the process starts in the background; the
        first call to an actor waits for it)."""
        actor = worker_actor(
            num_cpus=0.01,  # ranks mostly wait on each other; never block on whole CPUs
            num_gpus=self.gpus,
            max_restarts=0,
            runtime_env=runtime_env_for(dict(self.env)),
        )
        return [actor.remote() for _ in range(count)]


def kill_workers(workers: list[Any]) -> None:
    """Kill ``workers`` (already dead ones, or all after Ray shut down, are fine). Nothing to
    do once Ray is shut down (an actor dies with its driver's connection), and nothing may be
    called then: ``ray.kill`` would start a new local Ray instance (Ray's auto-init), as a
    ``Runtime`` collected at interpreter exit, after Ray's own exit hook, used to."""
    if not ray.is_initialized():
        return
    for w in workers:
        try:
            ray.kill(w, no_restart=True)
        except Exception:  # already dead, or Ray already shut down
            pass


class WorkerPool:
    """Idle rank workers by ``WorkerSpec``, at most ``max_idle`` of them (module doc).

    ``acquire`` hands out idle workers that still answer, then starts new ones;
    ``start_spares`` starts ``spares`` (module doc; at most ``max_idle`` idle in all);
    ``release`` takes back workers that were reset, killing what exceeds ``max_idle``;
    ``clear`` kills every idle worker.
    ``started`` counts the workers the pool started (for a runtime or as spares), ``reused``
    those it handed out from its idle ones (spares included). Thread-safe."""

    def __init__(self, max_idle: int = 8, spares: int = 0) -> None:
        if max_idle < 0:
            raise ValueError(f"max_idle must be >= 0, got {max_idle}")
        if not 0 <= spares <= max_idle:
            raise ValueError(f"spares must be between 0 and max_idle ({max_idle}), got {spares}")
        self.max_idle = max_idle
        self.spares = spares
        self.started = 0
        self.reused = 0
        self._idle: dict[WorkerSpec, list[Any]] = {}
        self._starting: dict[Any, Any] = {}  # a spare -> its warm-up call, until it is handed out
        self._ray: str | None = None  # the Ray connection the idle workers belong to
        self._lock = threading.Lock()

    @property
    def idle(self) -> int:
        """How many workers are waiting for a runtime."""
        with self._lock:
            return sum(len(ws) for ws in self._idle.values())

    def acquire(self, count: int, spec: WorkerSpec) -> list[Any]:
        """``count`` workers for ``spec``: idle ones first (each answers a ping, else it is
        killed and replaced), then new ones."""
        with self._lock:
            self._forget_if_ray_restarted()
            idle = self._idle.get(spec, [])
            taken, self._idle[spec] = idle[:count], idle[count:]
            warm_ups = {w: self._starting.pop(w) for w in taken if w in self._starting}
        # A spare still starting or warming is handed out as a new worker is: it is further along.
        starting = {w for w, ref in warm_ups.items() if not ray.wait([ref], timeout=0)[0]}
        answering = set(_answering([w for w in taken if w not in starting]))
        kill_workers([w for w in taken if w not in starting and w not in answering])
        kept = [w for w in taken if w in starting or w in answering]
        fresh = spec.start(count - len(kept))
        with self._lock:
            self.reused += len(kept)
            self.started += len(fresh)
        return kept + fresh

    def release(self, workers: list[Any], spec: WorkerSpec) -> None:
        """Take back ``workers``, which must have been reset (``RankWorker.reset``)."""
        with self._lock:
            self._forget_if_ray_restarted()
            idle = self._idle.setdefault(spec, [])
            room = max(0, self.max_idle - sum(len(ws) for ws in self._idle.values()))
            idle.extend(workers[:room])
            extra = workers[room:]
        kill_workers(extra)

    def clear(self) -> None:
        """Kill every idle worker."""
        with self._lock:
            workers = [w for ws in self._idle.values() for w in ws]
            self._idle.clear()
            self._starting.clear()
        kill_workers(workers)

    def start_spares(self, spec: WorkerSpec) -> None:
        """Start workers of ``spec`` until ``spares`` of them are idle (within ``max_idle``); their
        processes start in the background (``RayRanks.after_setup`` calls this)."""
        if self.spares == 0:
            return
        with self._lock:
            self._forget_if_ray_restarted()
            idle = self._idle.setdefault(spec, [])
            room = self.max_idle - sum(len(ws) for ws in self._idle.values())
            count = min(self.spares - len(idle), room)
            if count <= 0:
                return
            spares = spec.start(count)
            idle.extend(spares)
            self._starting.update((w, w.warm.remote()) for w in spares)
            self.started += count

    def _forget_if_ray_restarted(self) -> None:
        # Idle workers die with the Ray connection that started them: after ray.shutdown and
        # ray.init the old handles are stale. A new local cluster is a new node (the driver's
        # worker id can repeat); a reconnection to the same cluster gets a new worker id.
        current = None
        if ray.is_initialized():
            context = ray.get_runtime_context()
            current = f"{context.get_node_id()}/{context.get_worker_id()}"
        if current != self._ray:
            self._idle.clear()
            self._starting.clear()
            self._ray = current


def _answering(workers: list[Any]) -> list[Any]:
    """The workers that answer a ping within ``_PING_TIMEOUT_S``, in their order."""
    if not workers:
        return []
    pings = {}
    for w in workers:
        try:
            pings[w.ping.remote()] = w
        except Exception:  # a handle Ray no longer knows (its actor is gone)
            continue
    if not pings:
        return []
    ready, _ = ray.wait(list(pings), num_returns=len(pings), timeout=_PING_TIMEOUT_S)
    answered = set()
    for ref in ready:
        try:
            ray.get(ref, timeout=_PING_TIMEOUT_S)
        except Exception:  # died while idle
            continue
        answered.add(ref)
    return [w for ref, w in pings.items() if ref in answered]


_shared: WorkerPool | None = None
_shared_lock = threading.Lock()


def shared_pool() -> WorkerPool:
    """The process's pool, used by ``Runtime(..., reuse_workers=True)``."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = WorkerPool()
        return _shared


def pool_for(reuse_workers: bool | WorkerPool | None) -> WorkerPool | None:
    """The pool a runtime uses: the given pool, the shared one (``True``), none (``False``);
    ``None`` follows ``PIPER_REUSE_WORKERS`` (``1``: the shared pool)."""
    if isinstance(reuse_workers, WorkerPool):
        return reuse_workers
    if reuse_workers is None:
        reuse_workers = reuse_by_default()
    return shared_pool() if reuse_workers else None
