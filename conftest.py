"""Fixtures shared by every package's tests and the integration tests.

One Ray cluster serves the whole pytest session: starting Ray costs a few seconds, and the
runtime reuses an initialised Ray instead of starting its own. It has 16 logical CPUs (each
rank reserves one; the ranks mostly wait on each other) and no GPU, so tests that leave the
backend to be chosen run on the CPU backend wherever they run; the GPU tests make their own.
Tests that need a cluster of several nodes start it in a process of their own
(``integration/test_multinode.py``). Runtimes also reuse their workers
(``PIPER_REUSE_WORKERS=1``, ``piper_runtime.driver.pool``): starting a worker process costs seconds,
more than most tests' training. ``PIPER_REUSE_WORKERS=0 ./dev test`` runs every
test on new workers.
"""

from __future__ import annotations

import logging
import os

import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("PIPER_REUSE_WORKERS", "1")


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    from piper_runtime.driver.cluster import INLINE_ENV

    started = False
    if not ray.is_initialized():
        for name, value in INLINE_ENV.items():  # as ``ensure_ray`` starts Ray: batches inline
            os.environ.setdefault(name, value)
        ray.init(
            address="local",  # as ``ensure_ray`` starts one: never a cluster RAY_ADDRESS names
            num_cpus=16,
            num_gpus=0,
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            logging_level=logging.ERROR,
            log_to_driver=False,
        )
        started = True
    yield
    if started:
        ray.shutdown()
