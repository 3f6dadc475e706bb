"""``piper_runtime.driver.ray_env``: an embedded cluster stays on loopback whatever the environment
held, also in a program that imported Ray before Piper (the usual order, Piper first, with an
environment that says nothing: integration/test_listeners.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from piper_runtime.driver import ray_env
from piper_runtime.driver.ray_env import LOOPBACK_ENV

RAY_FIRST = """
import importlib.util, json, os, sys
import ray  # before Piper, with RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1: Ray may be a node of a cluster
from ray._private import ray_constants, services

spec = importlib.util.spec_from_file_location("ray_env", sys.argv[1])  # alone: no torch to import
ray_env = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ray_env)

before = ray_constants.ENABLE_RAY_CLUSTER
ray_env.keep_local()
print(json.dumps({"before": before, "after": ray_constants.ENABLE_RAY_CLUSTER,
                  "node": services.resolve_ip_for_localhost("127.0.0.1"),
                  "env": os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"]}))
"""


def test_keep_local_makes_an_earlier_imported_ray_keep_loopback() -> None:
    env = {**os.environ, **{name: "1" for name in LOOPBACK_ENV}}
    done = subprocess.run([sys.executable, "-c", RAY_FIRST, ray_env.__file__], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    # ray.init(_node_ip_address="127.0.0.1") keeps the address it is given (was: the machine's
    # external one), and Ray's processes, which inherit the environment, agree.
    assert seen == {"before": True, "after": False, "node": "127.0.0.1", "env": "0"}
