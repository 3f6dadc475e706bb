"""Connecting to (or starting) the Ray cluster the workers run on."""

from __future__ import annotations

import logging
import os

import ray

# Environment every Piper process needs on a loopback-only CPU cluster.
WORKER_ENV = {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}

_started_here = False


def ensure_ray(address: str | None = None, num_cpus: int | None = None) -> None:
    """Make sure Ray is initialised in this process.

    An already initialised Ray is reused as is. With ``address`` we connect to that cluster;
    otherwise we start a local embedded cluster bound to 127.0.0.1 (no dashboard, quiet logs)
    and remember that we did, so ``shutdown`` stops only what we started.
    """
    global _started_here
    if ray.is_initialized():
        return
    for key, val in WORKER_ENV.items():
        os.environ.setdefault(key, val)
    if address is not None:
        ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False)
        return
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    ray.init(
        num_cpus=num_cpus,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        logging_level=logging.ERROR,
        log_to_driver=False,
    )
    _started_here = True


def shutdown() -> None:
    """Stop Ray if (and only if) ``ensure_ray`` started it."""
    global _started_here
    if _started_here and ray.is_initialized():
        ray.shutdown()
    _started_here = False
