"""Ship the user's own Python modules to the Ray workers by value.

Ray pickles actor arguments (the segment modules) with its copy of cloudpickle, which
pickles a function or class by reference — "import it from module M" — unless its module is
registered by value. A worker can import installed packages and the standard library, but not
the ``--model`` file (loaded under a private name), a module next to it, a test file or a
script's helper module. ``ship_by_value`` registers those modules (named by
``CapturedModel.user_modules``, piper_directives.user_code) so their code travels inside the
pickle.

Why this and not Ray's ``runtime_env`` (``working_dir``/``py_modules``): it needs no change to
how the runtime starts its actors or joins a cluster, uploads nothing, works the same with an
embedded or a remote cluster, and ships exactly the modules the program refers to — not a
directory that happens to hold them. Its limit: code the shipped modules import from
elsewhere must be installed on the workers (true of every package in the driver's
environment on a local cluster).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

import ray.cloudpickle


def ship_by_value(module_names: Iterable[str]) -> tuple[str, ...]:
    """Register each named, imported module for pickling by value; returns the names
    registered."""
    shipped = []
    for name in module_names:
        module = sys.modules.get(name)
        if module is not None:
            ray.cloudpickle.register_pickle_by_value(module)
            shipped.append(name)
    return tuple(shipped)
