"""Rank workers that the embedded cluster's raylet starts along with itself, with their
heavy modules already imported.

A Ray rank worker is a Python process that imports Ray, torch, Piper's rank modules and
torch's compiler stack (a torch optimizer's constructor imports ``torch._dynamo``): about 3 s
of CPU each here. Left to the driver, these processes start only once ``ray.init`` has
returned and the actors are asked for. An actor with a ``runtime_env`` (the worker
environment, ``cluster.worker_env``) also waits for Ray's runtime-env agent, itself a Python
process still starting: measured, the workers' processes began 1.5 s after ``ray.init``
returned.

So, where Piper starts the embedded cluster for as many ranks as the cluster has CPUs
(``prestart_fits``; ``prepare_runtime`` knows the count before anything is captured), unless
``ClusterOptions.prestart_workers`` is False:

- the raylet starts one Python worker per CPU as it starts (Ray's ``enable_worker_prestart``),
  and each imports ``PRELOAD`` before it takes work (Ray's ``preload_python_modules``), while
  the driver captures and compiles;
- a rank actor asks for no ``runtime_env`` where the cluster's processes inherited the worker
  environment from the driver (``runtime_env_for``). Ray hands idle workers only to actors of
  the same ``runtime_env``, so the prestarted workers become the rank workers.

Ray keeps only as many idle workers as its node has CPUs *available*, and stops the others
once they have been idle ``idle_worker_killing_time_threshold_ms`` (1 s by default). The
ranks' bundles (``placement.reserve``) take every CPU, so from the moment they are reserved
until the rank actors lease the prestarted workers, Ray wants no idle worker: the raylet's
log showed both prestarted workers stopped 66 ms after the reservation, 91 ms before the
actors were created, which then started two workers of their own (``tests/test_early_start.py``
here: in 1 of 4 runs of the test alone, 2 of 3 runs of the package's tests, 4 of 4 with no
task asked for before the ranks). ``SYSTEM_CONFIG`` gives an idle worker of the embedded
cluster ``IDLE_GRACE_MS`` instead (then 6 of 6, and 2 of 2 runs of the package's tests,
passed); a worker nobody takes still goes, later.

The record of what the cluster inherited (``record``, ``forget``) is kept for every embedded
cluster, so rank actors on one skip the runtime-env agent with or without prestarting.
``SYSTEM_CONFIG``'s keys are Ray's own settings, read when its processes start: a Ray that
lacks one fails to start, so they are used only from ``MIN_RAY`` on (measured with Ray 2.60).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

# Imported by each prestarted worker before its first call: what a rank's setup and first
# optimizer step would import (``RankWorker.warm`` then finds them loaded).
PRELOAD = ("piper_runtime.rank.worker", "torch._dynamo")
IDLE_GRACE_MS = 10_000  # how long an idle worker of a prestarting cluster lives past the soft limit (module doc)
SYSTEM_CONFIG: dict[str, Any] = {"enable_worker_prestart": True, "preload_python_modules": list(PRELOAD),
                                 "idle_worker_killing_time_threshold_ms": IDLE_GRACE_MS}
MIN_RAY = (2, 60)

_inherited: dict[str, str | None] | None = None  # what the embedded cluster's processes inherited


def supported(version: str) -> bool:
    """Whether Ray ``version`` knows ``SYSTEM_CONFIG``'s settings."""
    try:
        return tuple(int(part) for part in version.split(".")[:2]) >= MIN_RAY
    except ValueError:  # a development build: no promise
        return False


def prestart_fits(num_cpus: int, world: int | None) -> bool:
    """Whether the raylet's prestarted workers (one per CPU) would be exactly the ``world``
    rank workers: more would cost their imports for nothing, fewer would leave some ranks to
    start late anyway."""
    return world is not None and world == num_cpus


def record(names: Iterable[str]) -> None:
    """Just before the embedded cluster starts: the values of ``names`` its processes
    inherit from this one."""
    global _inherited
    _inherited = {name: os.environ.get(name) for name in names}


def forget() -> None:
    """The embedded cluster stopped: nothing is known of the next one's environment."""
    global _inherited
    _inherited = None


def inherits(env: Mapping[str, str]) -> bool:
    """Whether the embedded cluster's workers already run with exactly ``env`` among the
    recorded names (none set that ``env`` leaves out)."""
    if _inherited is None or not set(env) <= set(_inherited):
        return False
    return all(_inherited[name] == env.get(name) for name in _inherited)


def runtime_env_for(env: Mapping[str, str]) -> dict[str, Any] | None:
    """The ``runtime_env`` that gives a rank actor ``env``: none where the embedded cluster's
    workers inherited it (module doc), else ``env`` as its ``env_vars``."""
    return None if inherits(env) else {"env_vars": dict(env)}
