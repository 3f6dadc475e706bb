"""One Ray cluster for the whole test session (starting Ray costs a few seconds)."""

from __future__ import annotations

import logging
import os

import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    ray.init(
        num_cpus=4,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        logging_level=logging.ERROR,
        log_to_driver=False,
    )
    yield
    ray.shutdown()
