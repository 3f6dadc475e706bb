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
SYSTEM_CONFIG: dict[str, Any] = {"enable_worker_prestart": True, "preload_python_modules": list(PRELOAD)}
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
