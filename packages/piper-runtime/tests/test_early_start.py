"""``prepare_runtime``: the Ray runtime's embedded cluster started on a thread of its own while
the driver captures and compiles, found running by the runtime later; restarted when the
runtime needs more CPUs than it was started with; the rank workers prestarted with the raylet
where there is a CPU per rank, and no idle task workers; SIGTERM
still the program's to handle; the rank workers started with it run the program, and only
workers that fit are taken. Each cluster in a fresh interpreter (this one's Ray is the test
session's): a cluster costs seconds to start and stop, so one interpreter checks every fact
of a cluster started early for what the runtime then asks (``SCRIPT`` with ``TRAIN``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import attrs
import ray

from piper_runtime import ClusterOptions
from piper_runtime.driver import prestart
from piper_runtime.driver.cluster import embedded_cpus
from piper_runtime.driver.early_workers import EarlyWorkers, WorkerRequest

SCRIPT = """
import json, os, signal, sys, threading, time
import ray
from piper_runtime import ClusterOptions, RunOptions, prepare_runtime
from piper_runtime.driver import cluster, early_workers

terms = []
signal.signal(signal.SIGTERM, lambda signum, frame: terms.append(signum))  # as piper train does
asked = []  # when the rank workers were asked for, in seconds since boot (as /proc counts)
_start = early_workers.start
def start(request):
    asked.append(float(open("/proc/uptime").read().split()[0]))
    return _start(request)
early_workers.start = start
options = RunOptions(cluster=ClusterOptions(runtime="ray"))
prepare_runtime(options, {hinted})
early = cluster._early
cluster.ensure_ray(None, num_cpus={needed})

seen = {{}}
{train}
children = open(f"/proc/{{os.getpid()}}/task/{{os.getpid()}}/children").read().split()
raylet = [c for c in children if b"raylet" in open(f"/proc/{{c}}/cmdline", "rb").read()]
idle = []
for r in raylet:
    for c in open(f"/proc/{{r}}/task/{{r}}/children").read().split():
        idle += [c] if b"ray::IDLE" in open(f"/proc/{{c}}/cmdline", "rb").read() else []

# Asked for once the idle workers are counted: its worker stays idle for a while after it
# (``prestart.IDLE_GRACE_MS``). The rank workers' bundles may hold every CPU; a runtime_env
# of its own keeps this task off the workers the raylet prestarted.
@ray.remote(num_cpus=0, runtime_env={{"env_vars": {{"PIPER_TEST_TASK": "1"}}}})
def pid():
    return os.getpid()

answered = ray.get(pid.remote()) != os.getpid()
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(0.2)
cpus = ray.cluster_resources()["CPU"]
{train_end}
cluster.shutdown()
early.thread.join(timeout=30)
print(json.dumps({{**seen, "started_early": early is not None, "sigterm_handled": terms == [signal.SIGTERM],
                  "answered": answered, "cpus": cpus, "idle_workers": len(idle),
                  "thread_ended": not early.thread.is_alive(), "threads": [t.name for t in threading.enumerate()]}}))
"""

# Without worker reuse, the two rank workers started with the cluster (while the program was
# captured and compiled, before it existed) train a step; the runtime holds them until the
# cluster's own checks ran (a rank worker is never counted as an idle task worker then).
TRAIN = """
sys.path.insert(0, {tests!r})
from test_runtime import MSE, Stage0, Stage1, _batch, _layers, gpipe_program
from piper_runtime import OptimizerSpec, Runtime

early.workers_started.wait(60)
handles = list(early.workers.workers) if early.workers else []
seen["started"] = [w._actor_id.hex() for w in handles]
l0, l1 = _layers()
rt = Runtime(gpipe_program(), {{"s0": Stage0(l0), "s1": Stage1(l1), "loss": MSE()}}, OptimizerSpec("sgd", lr=0.1),
             runtime="ray")
seen["used"] = [w._actor_id.hex() for w in rt._ranks.workers]
def began(worker):  # when the worker's process started, in seconds since boot
    pid = ray.get(worker.__ray_call__.remote(lambda self: os.getpid()))
    ticks = int(open(f"/proc/{{pid}}/stat").read().rsplit(")", 1)[1].split()[19])
    return ticks / os.sysconf("SC_CLK_TCK")
seen["prestarted"] = [began(w) < asked[0] for w in handles]
x, t = _batch(0)
seen["loss"] = float(rt.step((x,), (t,)).loss)
def answers(worker):
    try:
        return ray.get(worker.ping.remote(), timeout=20) > 0
    except Exception:  # killed: Ray refuses the call, or the call fails
        return False
seen["alive"] = [answers(w) for w in handles]  # while the runtime holds them
"""


def _run(hinted: int, needed: int, train: bool = False) -> dict:
    script = SCRIPT.format(hinted=hinted, needed=needed, train=TRAIN.format(tests=str(Path(__file__).parent)) if train
                           else "", train_end="rt.shutdown()" if train else "")
    env = {**os.environ, "PIPER_REUSE_WORKERS": "0"} if train else None  # early workers only without reuse
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    # Ray's native failure handler would have dumped a stack on SIGTERM (and may abort)
    assert "SIGTERM received" not in done.stderr, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_cluster_started_early_is_the_one_the_runtime_uses_and_its_workers_run_the_program() -> None:
    """The cluster started early is the one the runtime uses, and stops; the two rank workers
    started with it are the ones that run the program, each rank the worker in its bundle,
    and they train."""
    # The starting thread outlives ray.init: Ray's processes die with the thread that started
    # them (Linux's parent-death signal), so a thread that ended would take the GCS along.
    seen = _run(hinted=2, needed=2, train=True)
    assert seen["started_early"] and seen["answered"] and seen["cpus"] >= 2
    assert seen["sigterm_handled"]  # the program's own handler, not Ray's (ray_env.keep_signals)
    # The raylet prestarts one worker per CPU where that is one per rank (here: 2 CPUs), and the
    # ranks take them: their processes began before the ranks were asked for, none is left idle.
    prestarted = prestart.prestart_fits(embedded_cpus(2, 1.0), 2) and prestart.supported(ray.__version__)
    assert seen["prestarted"] == [prestarted, prestarted]
    assert seen["idle_workers"] == 0
    assert seen["thread_ended"] and "piper-ray-start" not in seen["threads"]
    assert len(seen["started"]) == 2 and sorted(seen["used"]) == sorted(seen["started"])
    assert seen["loss"] > 0 and all(seen["alive"])


def test_a_cluster_started_early_with_too_few_cpus_is_started_again() -> None:
    seen = _run(hinted=1, needed=64)
    assert seen["answered"] and seen["cpus"] == 64


def test_workers_fit_only_what_the_runtime_would_start() -> None:
    """``RayRanks`` takes early workers only for the same world size, CPUs and GPUs per rank,
    backend, placement and worker environment; any other are discarded (killed, bundles given
    back) and it starts its own."""
    cluster = ClusterOptions(runtime="ray")
    early = EarlyWorkers(WorkerRequest(2, cluster), "cpu", "", (("OMP_NUM_THREADS", "1"),), None, ())
    env = {"OMP_NUM_THREADS": "1"}
    assert early.fits(2, cluster, env)
    assert not early.fits(4, cluster, env)
    for other in (attrs.evolve(cluster, cpus_per_rank=2.0), attrs.evolve(cluster, placement="spread"),
                  attrs.evolve(cluster, backend="cpu"), attrs.evolve(cluster, ranks_per_gpu=2)):
        assert not early.fits(2, other, env)
    assert not early.fits(2, cluster, {**env, "GLOO_SOCKET_IFNAME": "lo"})


def test_ranks_ask_for_no_runtime_env_only_where_the_cluster_inherited_theirs(monkeypatch) -> None:
    """A rank actor's environment comes from what the embedded cluster inherited where that is
    the same (then it may take a prestarted worker), else from its ``runtime_env``: a user's
    ``OMP_NUM_THREADS=4`` in the driver still gives the ranks 1, and a socket variable set
    after the cluster started still reaches them."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    try:
        assert prestart.runtime_env_for({"OMP_NUM_THREADS": "1"}) == {"env_vars": {"OMP_NUM_THREADS": "1"}}  # none
        prestart.record(("OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME"))
        assert prestart.runtime_env_for({"OMP_NUM_THREADS": "1"}) is None
        assert prestart.runtime_env_for({"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}) == {
            "env_vars": {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}}
        monkeypatch.setenv("OMP_NUM_THREADS", "4")
        prestart.record(("OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME"))
        assert prestart.runtime_env_for({"OMP_NUM_THREADS": "1"}) == {"env_vars": {"OMP_NUM_THREADS": "1"}}
    finally:
        prestart.forget()
    assert prestart.prestart_fits(2, 2) and not prestart.prestart_fits(16, 2) and not prestart.prestart_fits(2, None)
    assert prestart.supported("2.60.0") and prestart.supported("3.1.0") and not prestart.supported("2.9.3")


def test_the_early_start_asks_for_prestarted_rank_workers_unless_told_not_to(monkeypatch) -> None:
    """The background start passes the ranks it will ask for to ``ensure_ray`` (which then
    has the raylet prestart them where they are one per CPU); ``prestart_workers=False``
    passes none. No cluster is started: ``ensure_ray`` and the workers' start are stand-ins."""
    from piper_runtime.driver import cluster

    asked: list[int | None] = []
    monkeypatch.setattr(cluster, "ensure_ray", lambda address, num_cpus, *, prestart_world: asked.append(prestart_world))
    monkeypatch.setattr(cluster.early_workers, "start", lambda request: None)
    monkeypatch.setattr(cluster.ray_env, "keep_signals", lambda: None)  # this process's Ray is the session's
    for prestart_workers in (True, False):
        start = cluster._EarlyStart(2, WorkerRequest(2, ClusterOptions(runtime="ray", prestart_workers=prestart_workers)))
        start.workers_started.wait(10)
        start.done.set()
        start.thread.join(10)
    assert asked == [2, None]
