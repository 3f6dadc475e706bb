"""What keeps an embedded Ray cluster on loopback, set before Ray is imported.

Ray decides once, when it is imported (``ray._private.ray_constants``), whether this
machine may be a node of a multi-node cluster: ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER``, true on
Linux unless set to 0. While it may, ``ray.init(_node_ip_address="127.0.0.1")`` swaps the
loopback address for the machine's external one, and the embedded cluster's GCS, both raylet
ports, the driver's and every worker's core worker listen on every interface, the runtime-env
agent on the external address: all that stands between the network and code running in the
workers is Ray's token (``~/.ray/auth_token``, readable by every local user; none at all with
``RAY_AUTH_MODE=disabled``). Setting the variable in ``ensure_ray`` came too late: by then
Ray had read it.

So this module sets ``LOOPBACK_ENV`` when it is imported, and ``piper_runtime/__init__.py``
imports it before anything else: every import of Piper's runtime (and so of Ray, through it)
runs it first, whatever the environment held (measured: without the variable in the
environment, ``piper train`` listened on ``*`` and the external address; with it, on
127.0.0.1 only: ``integration/test_listeners.py``). A module rather than a line in
``cluster.py``: ``cluster.py`` imports ``ray`` at its top, and any other module of the
package may come first. A program that imported Ray before Piper (or set the variable to 1
and imported ``piper_train.tuning.api``, which imports ``ray`` first) read it already;
``keep_local`` makes that Ray agree before the embedded cluster starts.

Joining a cluster (``--address``) is unaffected: the driver takes its address from the node
it connects to (found by the cluster's own records, not by this setting), and its Ray listens
as that cluster's processes do (Ray's servers: every interface unless the node address is
loopback; a cluster's network is its operator's to fence). Piper's own rendezvous listens on
rank 0's node address only (``piper_runtime.rendezvous``).
"""

from __future__ import annotations

import os
import sys

LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}

os.environ.update(LOOPBACK_ENV)


def keep_local() -> None:
    """Before starting an embedded cluster: ``LOOPBACK_ENV`` in this process's environment
    (Ray's processes inherit it; their own address lookups then say loopback too), and in a
    Ray that was imported before this module (a private flag: no public API decides it;
    ``cluster.ensure_ray`` checks the address Ray ended up with)."""
    os.environ.update(LOOPBACK_ENV)
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None and getattr(constants, "ENABLE_RAY_CLUSTER", False):
        constants.ENABLE_RAY_CLUSTER = False


def keep_signals() -> None:
    """Before ``ray.init`` on a thread other than the main one (``cluster.start_early``): no
    native failure-signal handler in this process's Ray core worker. Ray installs one that
    catches SIGTERM with a stack dump (measured: ``piper train`` then died by SIGABRT instead
    of stopping cleanly with 143), and only the main thread can put the program's own Python
    handler back over it (``cluster._keeping_sigterm_handler`` does, when ``ray.init`` runs
    there). Ray reads the flag when the core worker starts (a private constant; its
    environment variable ``RAY_DISABLE_FAILURE_SIGNAL_HANDLER`` is read only when Ray is
    imported). Rank workers keep Ray's handler: this process only."""
    import ray._private.ray_constants as constants

    constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = True
