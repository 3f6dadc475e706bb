"""Training across nodes: a Ray cluster of two nodes (``ray.cluster_utils.Cluster`` on
loopback, 2 CPUs each) runs PP=2 x DP=2, whose four ranks of one CPU each must use both nodes,
with every message through gloo (``PIPER_SHM_DISABLE=1``).

The cluster is started in a process of its own (``fixtures/multinode.py``), so it never meets
the test session's shared Ray cluster; the run prints what it saw as JSON.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "integration" / "fixtures" / "multinode.py"
pytestmark = [pytest.mark.own_process, pytest.mark.ray]


def test_pp2_dp2_across_two_nodes_matches_single_device_training() -> None:
    ray_tmp = tempfile.mkdtemp(prefix="piper-mn-")
    # PIPER_SHM_DISABLE: point-to-point through gloo, as between ranks on separate machines;
    # every other run of the suite sends it through shared memory.
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_USAGE_STATS_ENABLED="0", RAY_TMPDIR=ray_tmp,
               PIPER_SHM_DISABLE="1")
    env.pop("RAY_ADDRESS", None)
    try:
        done = subprocess.run([sys.executable, str(SCRIPT), "pack"], capture_output=True, text=True, timeout=300,
                              env=env, cwd=ROOT)
        leftover = subprocess.run(["pgrep", "-af", ray_tmp], capture_output=True, text=True).stdout
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert done.returncode == 0, done.stderr[-4000:]
    assert not leftover, f"Ray processes left behind: {leftover}"
    run = json.loads(done.stdout.strip().splitlines()[-1])
    nodes = run["nodes"]  # as each worker reports it
    assert nodes == run["placement_nodes"]  # the workers run where the placement put them
    assert run["node_count"] == 2 and len(set(nodes)) == 2
    # pack: each pipeline (ranks 0-1, 2-3) on one node, data-parallel replicas across nodes
    assert nodes[0] == nodes[1] and nodes[2] == nodes[3] and nodes[0] != nodes[2]
    assert [0, 2] in run["replicas"] and [1, 3] in run["replicas"]
    assert run["rendezvous"][0] == "127.0.0.1"  # rank 0's node address as Ray reports it (loopback nodes)
    assert run["backend"] == "cpu" and "backend 'cpu' (the Ray cluster has no GPU)" in run["log"]
    worst = run["worst"]
    assert worst["loss"] < 1e-12 and worst["grad"] < 1e-12 and worst["param"] < 1e-12, worst
