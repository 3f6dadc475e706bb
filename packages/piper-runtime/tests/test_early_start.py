"""``prepare_runtime``: the Ray runtime's embedded cluster started on a thread of its own while
the driver captures and compiles, found running by the runtime later; restarted when the
runtime needs more CPUs than it was started with; no idle task workers prestarted; SIGTERM
still the program's to handle. Each case
in a fresh interpreter (this one's Ray is the test session's)."""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = """
import json, os, signal, threading, time
import ray
from piper_runtime import ClusterOptions, RunOptions, prepare_runtime
from piper_runtime.driver import cluster

terms = []
signal.signal(signal.SIGTERM, lambda signum, frame: terms.append(signum))  # as piper train does
options = RunOptions(cluster=ClusterOptions(runtime="ray"))
prepare_runtime(options, {hinted})
early = cluster._early
cluster.ensure_ray(None, num_cpus={needed})

@ray.remote
def pid():
    return os.getpid()

answered = ray.get(pid.remote()) != os.getpid()
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(0.2)
cpus = ray.cluster_resources()["CPU"]
children = open(f"/proc/{{os.getpid()}}/task/{{os.getpid()}}/children").read().split()
raylet = [c for c in children if b"raylet" in open(f"/proc/{{c}}/cmdline", "rb").read()]
idle = []
for r in raylet:
    for c in open(f"/proc/{{r}}/task/{{r}}/children").read().split():
        idle += [c] if b"ray::IDLE" in open(f"/proc/{{c}}/cmdline", "rb").read() else []
cluster.shutdown()
early.thread.join(timeout=30)
print(json.dumps({{"started_early": early is not None, "sigterm_handled": terms == [signal.SIGTERM], "answered": answered, "cpus": cpus,
                  "idle_workers": len(idle), "thread_ended": not early.thread.is_alive(),
                  "threads": [t.name for t in threading.enumerate()]}}))
"""


def _run(hinted: int, needed: int) -> dict:
    done = subprocess.run([sys.executable, "-c", SCRIPT.format(hinted=hinted, needed=needed)], capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    # Ray's native failure handler would have dumped a stack on SIGTERM (and may abort)
    assert "SIGTERM received" not in done.stderr, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_cluster_started_early_is_the_one_the_runtime_uses_and_stops() -> None:
    # The starting thread outlives ray.init: Ray's processes die with the thread that started
    # them (Linux's parent-death signal), so a thread that ended would take the GCS along.
    seen = _run(hinted=2, needed=2)
    assert seen["started_early"] and seen["answered"] and seen["cpus"] >= 2
    assert seen["sigterm_handled"]  # the program's own handler, not Ray's (ray_env.keep_signals)
    assert seen["idle_workers"] == 0  # Ray's prestarted task workers: no rank could use one
    assert seen["thread_ended"] and "piper-ray-start" not in seen["threads"]


def test_a_cluster_started_early_with_too_few_cpus_is_started_again() -> None:
    seen = _run(hinted=1, needed=64)
    assert seen["answered"] and seen["cpus"] == 64
