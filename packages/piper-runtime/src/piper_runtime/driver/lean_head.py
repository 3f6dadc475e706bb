"""An embedded Ray cluster without the head processes it has no use for.

``ray.init(address="local", include_dashboard=False)`` still starts three Python processes
on the head node besides the GCS and the raylet:

- the API server (``ray/dashboard/dashboard.py``), which without the dashboard loads only
  Ray's usage-statistics module (no job or state API: Ray's own note says so), and which
  ``ray.init`` waits for until it registers, polling every 0.1 s;
- the autoscaler's monitor: a single fixed node has nothing to scale;
- the log monitor, which publishes the workers' output to drivers that ask for it
  (``log_to_driver``): Piper's driver does not (``cluster.ensure_ray``); the workers' logs
  stay in the session's log folder.

Together about 1 s of CPU on the 2-core machine this is developed on, and the rank actors of
a freshly started cluster answered 0.65 s sooner without them (2.85 against 3.5 s from the
process's start; docs/runtimes.md). ``lean_start`` skips them for the one ``ray.init`` that
starts Piper's embedded cluster, by standing in for the three methods of Ray's ``Node`` that
start them while that call runs. These are Ray's private names: only the Ray versions this
was measured with (``MIN_RAY`` on, as ``prestart``) and only where all three exist; any other
Ray starts its cluster as it always did. A cluster Piper connects to (``--address``) is never
touched, and a user who wants Ray's dashboard starts one (``ray start --head``) and passes its
address.

``SYSTEM_CONFIG`` also has the raylet, and the workers connecting to it, try a local socket
every 50 ms rather than every second, up to 200 times (the same 10 s bound as Ray's 10 tries of
1 s). The raylet connects to its own object store as it starts, and where the store was not
listening yet at the first try, the start waited a whole second (the raylet's log: the store's
first line, then a second of nothing). Measured: in 5 of 10 starts made while the driver
imported torch (``piper_train.cli.early_start``), 1 of 10 alternated starts made after it, and
none of 6 early starts with the shorter wait (the store answered 1-51 ms later).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import ray

from piper_runtime.driver import prestart

# ray._private.node.Node's methods that start the processes the module doc names.
SKIPPED = ("start_api_server", "start_monitor", "start_log_monitor")
_lock = threading.Lock()  # one start at a time replaces and restores the methods
SYSTEM_CONFIG: dict[str, int] = {
    "raylet_client_connect_timeout_milliseconds": 50,
    "raylet_client_num_connect_attempts": 200,
}


def supported() -> bool:
    """Whether this Ray is one the lean start was measured with and has the methods it skips."""
    if not prestart.supported(ray.__version__):
        return False
    try:
        from ray._private.node import Node
    except ImportError:
        return False
    return all(callable(getattr(Node, name, None)) for name in SKIPPED)


def system_config() -> dict[str, int]:
    """Ray settings of the embedded cluster (``SYSTEM_CONFIG``) where this Ray knows them."""
    return dict(SYSTEM_CONFIG) if prestart.supported(ray.__version__) else {}


def _skip(_node: object, *_args: object, **_kwargs: object) -> None:
    """Start nothing (module doc)."""


@contextlib.contextmanager
def lean_start() -> Iterator[bool]:
    """While it is open, a head node Ray starts has no API server, monitor or log monitor;
    yields whether that holds (``supported``), and puts Ray's methods back when it closes."""
    if not supported():
        yield False
        return
    from ray._private.node import Node

    with _lock:
        saved = {name: Node.__dict__.get(name) for name in SKIPPED}
        for name in SKIPPED:
            setattr(Node, name, _skip)
        try:
            yield True
        finally:
            for name, method in saved.items():
                if method is None:  # inherited: remove the stand-in
                    delattr(Node, name)
                else:
                    setattr(Node, name, method)
