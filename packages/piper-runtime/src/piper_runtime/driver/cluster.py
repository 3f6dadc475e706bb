"""Connecting to (or starting) the Ray cluster the workers run on, and what it offers.

- ``ensure_ray``: reuse an initialised Ray, connect to ``address`` (checked first: an
  address nothing answers on fails within ``CONNECT_TIMEOUT_S`` with the address in the
  message; Ray itself would retry for minutes), or start an embedded single-node cluster
  bound to 127.0.0.1 (every port of it: ``piper_runtime.driver.ray_env``; checked once it runs),
  whose processes die with this one (``piper_runtime.driver.reaper``, also when this process is
  SIGKILLed). Either way the driver first sets ``INLINE_ENV``: a step's
  batches travel inside the call to each worker, not through Ray's object store. A SIGTERM
  handler the program installed stays its own (``_keeping_sigterm_handler``).
- ``choose_backend``: ``cuda`` when the cluster has a GPU for every rank and a GPU worker
  has what the CUDA backend needs, else ``cpu``; always with the reason, for the log.
- ``worker_env``: the environment every rank gets (the socket interface variables only
  where the user set them: otherwise each rank derives its own, ``piper_runtime.rendezvous``;
  ``PIPER_SHM_DISABLE`` where set, ``piper_runtime.backends.cpu``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator

import ray

from piper_ir import ClusterError
from piper_runtime.driver import early_workers, lean_head, prestart, ray_env, reaper
from piper_runtime.rendezvous import LOOPBACK, SOCKET_ENV, is_loopback

# Environment every Piper worker gets, and what it gets from the driver's where set there.
WORKER_ENV = {"OMP_NUM_THREADS": "1"}
# Ray settings of the driver's own Ray process, unless set in its environment: a call's
# arguments (the step's batches) travel inside the call's message, straight to the worker, up
# to these sizes. Ray's defaults (100 KiB per argument, 10 MiB per call) put larger ones in
# the object store, whose bookkeeping cost the raylet 4.5 ms of CPU per 125 ms step at one
# step per call on the 2-core benchmark host (1 ms inline, and the step 4% faster; no
# difference at ``fit``'s automatic call sizes: docs/benchmarks.md). Only the caller
# decides, so this holds on a cluster Piper connects to as well.
INLINE_ENV = {
    "RAY_max_direct_call_object_size": str(64 << 20),
    "RAY_task_rpc_inlined_bytes_limit": str(64 << 20),
}
FORWARDED_ENV = (*SOCKET_ENV, "PIPER_SHM_DISABLE")
CONNECT_TIMEOUT_S = 30.0
_HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # + empty SETTINGS

_started_here = False


def worker_env() -> dict[str, str]:
    """``WORKER_ENV`` plus the ``FORWARDED_ENV`` variables set in this (the driver's) process."""
    env = dict(WORKER_ENV)
    env.update({name: os.environ[name] for name in FORWARDED_ENV if os.environ.get(name)})
    return env


def ensure_ray(address: str | None = None, num_cpus: int | None = None, *, prestart_world: int | None = None) -> None:
    """Make sure Ray is initialised in this process.

    An already initialised Ray is reused as is. With ``address`` (or ``RAY_ADDRESS``:
    ``requested_address``) we check that a Ray cluster answers there (``check_address``) and
    connect to it; otherwise we start a local embedded cluster bound to 127.0.0.1 (no
    dashboard, nor the head processes it has no use for: ``lean_head``; quiet logs; ``num_cpus``
    logical CPUs; never one ``ray start`` runs on this machine, whose ``num_cpus`` is not ours
    to set) and remember that we did, so ``shutdown`` stops only what we started. With
    ``prestart_world`` ranks to come, as many as its CPUs and with the worker environment
    inherited, its raylet starts their workers along with itself (``piper_runtime.driver.prestart``).
    """
    global _started_here
    _await_early_start(address, num_cpus)
    if ray.is_initialized():
        return
    os.environ.setdefault("OMP_NUM_THREADS", WORKER_ENV["OMP_NUM_THREADS"])
    for name, value in INLINE_ENV.items():
        os.environ.setdefault(name, value)
    source = "" if address is not None else "RAY_ADDRESS: "  # where a bad address came from
    address = requested_address(address)
    if address is not None:
        try:
            check_address(address)
            try:
                with _keeping_sigterm_handler():
                    ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False)
            except (ConnectionError, RuntimeError, ValueError) as exc:
                raise ClusterError(f"cannot connect to the Ray cluster at {address!r}: {exc}") from None
        except ClusterError as exc:
            raise ClusterError(f"{source}{exc}") from None
        return
    ray_env.keep_local()  # else Ray replaces 127.0.0.1 below by the machine's address (ray_env)
    # The watcher first: a start cut short (a SIGTERM or Ctrl-C during ray.init) leaves Ray's
    # agents running for a minute otherwise.
    reaper.start()
    # The environment Ray's processes inherit: rank actors that would get the same need no runtime_env.
    prestart.record((*WORKER_ENV, *FORWARDED_ENV))
    prestarting = (prestart.prestart_fits(num_cpus or os.cpu_count() or 1, prestart_world)
                   and prestart.inherits(worker_env()) and prestart.supported(ray.__version__))
    with _keeping_sigterm_handler(), _forgetting_on_failure(), lean_head.lean_start():
        ray.init(
            address="local",  # a cluster of our own, not one `ray start` left a record of
            num_cpus=num_cpus,
            include_dashboard=False,
            _node_ip_address=LOOPBACK,
            logging_level=logging.ERROR,
            log_to_driver=False,
            # Ray starts one idle Python worker per CPU for tasks when the driver connects:
            # 1.1-1.4 s of CPU for two, measured with the cluster's process tree, for tasks
            # (Piper runs none but a GPU probe). Rank workers, where they are one per CPU, are prestarted
            # with the raylet instead, their modules imported (``prestarting``).
            _system_config=({"prestart_worker_first_driver": False} | lean_head.system_config()
                            | (prestart.SYSTEM_CONFIG if prestarting else {})),
        )
    _started_here = True
    node = ray.util.get_node_ip_address()
    if not is_loopback(node):  # a Ray whose rules changed: its ports would be open to the network
        shutdown()
        raise ClusterError(
            f"the embedded Ray cluster started on {node}, not on {LOOPBACK}; stopped it (its ports "
            "would be reachable from the network)"
        )


@contextlib.contextmanager
def _forgetting_on_failure() -> Iterator[None]:
    """A cluster that did not start leaves no record of its environment."""
    try:
        yield
    except BaseException:
        prestart.forget()
        raise


@contextlib.contextmanager
def _keeping_sigterm_handler() -> Iterator[None]:
    """Put back the program's own SIGTERM handler after ``ray.init``, which replaces it (with
    one that exits at once, and a native one that aborts with a stack dump): a program that
    handles SIGTERM itself (``piper train`` stops at a step boundary and checkpoints) keeps
    doing so. A program that left SIGTERM alone gets Ray's handling, as before."""
    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if main else None
    try:
        yield
    except SystemExit as exc:
        # A SIGTERM during ``ray.init`` met Ray's handler, ``sys.exit(SIGTERM)``: it is the
        # program's to handle (which may raise in its turn).
        if exc.code == signal.SIGTERM and callable(previous):
            previous(signal.SIGTERM, None)
        raise
    finally:
        if main and (callable(previous) or previous == signal.SIG_IGN):
            signal.signal(signal.SIGTERM, previous)


def requested_address(address: str | None) -> str | None:
    """The cluster to connect to: ``address``, else ``RAY_ADDRESS`` where set (Ray's own
    convention); ``None`` (or ``"local"``) starts an embedded cluster."""
    if address is None:
        address = os.environ.get("RAY_ADDRESS") or None
    return None if address == "local" else address


def shutdown() -> None:
    """Stop Ray if (and only if) ``ensure_ray`` (or ``start_early``) started it."""
    global _started_here, _early
    early, _early = _early, None
    if early is not None:
        early.started.wait(timeout=CONNECT_TIMEOUT_S)  # not ray.shutdown in the middle of ray.init
    if _started_here and ray.is_initialized():
        ray.shutdown()
        reaper.stop()
    if _started_here:
        prestart.forget()
    _started_here = False
    if early is not None:
        early.done.set()


def embedded_cpus(world: int, cpus_per_rank: float) -> int:
    """The logical CPUs of an embedded cluster for ``world`` ranks: this machine's, or a CPU
    per rank where that is more (ranks mostly wait on each other)."""
    return max(os.cpu_count() or 1, int(world * cpus_per_rank + 0.999))


class _EarlyStart:
    """``ensure_ray(None, num_cpus)`` on a thread of its own (``start_early``), then, given a
    ``request``, the rank workers it asks for (``early_workers.start``). The thread stays until
    ``shutdown``: Ray's processes get Linux's parent-death signal, which follows the *thread*
    that started them (measured: the GCS died as soon as a short-lived starting thread ended)."""

    def __init__(self, num_cpus: int, request: early_workers.WorkerRequest | None = None) -> None:
        self.num_cpus = num_cpus
        self.request = request
        self.workers: early_workers.EarlyWorkers | None = None  # until a runtime takes them
        self.asked = False  # a runtime asked for them (``take_early_workers``): later ones are discarded
        self.claimed = False  # a runtime took the cluster as it is: it is never restarted under it
        self.error: BaseException | None = None
        self.started = threading.Event()  # ray.init returned, or failed (``error``)
        self.workers_started = threading.Event()  # the workers were started, or will not be
        self.done = threading.Event()  # the cluster is stopped: the thread may end
        self.thread = threading.Thread(target=self._run, name="piper-ray-start", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            ray_env.keep_signals()
            request = self.request
            prestart_world = request.world if request is not None and request.cluster.prestart_workers else None
            ensure_ray(None, self.num_cpus, prestart_world=prestart_world)
        except BaseException as exc:  # given to the caller of ensure_ray, in its thread
            self.error = exc
        finally:
            self.started.set()
        try:
            if self.error is None and self.request is not None:
                # A failure here costs only the head start: the runtime starts its own workers.
                started = early_workers.start(self.request)
                with _early_lock:
                    late, self.workers = self.asked, None if self.asked else started
                if late:  # the runtime stopped waiting and started its own: these would hold its resources
                    started.discard()
        except Exception:
            self.workers = None
        finally:
            self.workers_started.set()
        self.done.wait()


_early: _EarlyStart | None = None
_early_lock = threading.Lock()


def start_early(address: str | None, num_cpus: int, request: early_workers.WorkerRequest | None = None) -> None:
    """Start the embedded cluster in the background, for a later ``ensure_ray`` to find
    running, and with a ``request`` the rank workers it asks for (``take_early_workers``):
    the driver captures and compiles meanwhile (the cluster's processes start on the
    machine's other cores). Nothing where Ray is up, a cluster address is given (a
    connection is quick, and its errors belong to the caller), or a start is under way."""
    global _early
    with _early_lock:
        if _early is not None or ray.is_initialized() or requested_address(address) is not None:
            return
        _early = _EarlyStart(num_cpus, request)


def take_early_workers(timeout_s: float = CONNECT_TIMEOUT_S) -> early_workers.EarlyWorkers | None:
    """The workers the background start made for its request, handed out once; None where it
    had none, their start failed, or the cluster they ran on was stopped since."""
    early = _early
    if early is None or early.request is None:
        return None
    early.workers_started.wait(timeout_s)
    with _early_lock:
        early.asked = True
        if _early is not early:
            return None
        workers, early.workers = early.workers, None
    return workers


def _await_early_start(address: str | None, num_cpus: int | None) -> None:
    """Wait for a background start (``start_early``); raise its error; stop the cluster it
    started when the first call for it wants another (a cluster address, or more CPUs than it
    has); once a call took it, later ones find Ray up and reuse it, as ``ensure_ray`` does."""
    global _early
    early = _early
    if early is None or early.claimed or early.thread is threading.current_thread():
        return
    early.started.wait()  # ray.init's own timeouts bound it
    if early.error is not None:
        _early = None
        early.done.set()
        raise early.error
    if requested_address(address) is not None or (num_cpus or 0) > early.num_cpus:
        shutdown()
    else:
        early.claimed = True


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` of a Ray address (``ray://`` client addresses default to port 10001,
    cluster addresses to 6379); ``ValueError`` for one we cannot read."""
    rest = address.removeprefix("ray://")
    default = 10001 if rest != address else 6379
    if rest.startswith("["):  # [IPv6]:port
        host, _, tail = rest[1:].partition("]")
        port = tail.removeprefix(":")
    elif rest.count(":") == 1:
        host, port = rest.split(":")
    else:
        host, port = rest, ""
    if not host:
        raise ValueError(f"no host in Ray address {address!r}")
    try:
        return host, int(port) if port else default
    except ValueError:
        raise ValueError(f"bad port in Ray address {address!r}") from None


def check_address(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """``ClusterError`` naming ``address`` unless something there speaks gRPC (as Ray's GCS
    and Ray client servers do), decided within ``timeout_s``. ``"auto"`` (find a local
    cluster) is left to Ray, which fails fast when there is none."""
    if address in ("auto", "local"):
        return
    try:
        host, port = split_address(address)
    except ValueError as exc:
        raise ClusterError(str(exc)) from None
    deadline = time.monotonic() + timeout_s
    try:
        conn = socket.create_connection((host, port), timeout=timeout_s)
    except TimeoutError:
        raise ClusterError(
            f"cannot reach the Ray cluster at {address!r}: no answer within {timeout_s:g} s (wrong address, "
            "or a firewall in the way)"
        ) from None
    except OSError as exc:
        raise ClusterError(
            f"cannot reach the Ray cluster at {address!r}: {exc.strerror or exc} (is Ray running there? "
            "`ray start --head` prints the address to use)"
        ) from None
    with conn:
        conn.settimeout(max(0.1, min(10.0, deadline - time.monotonic())))
        try:
            conn.sendall(_HTTP2_PREFACE)
            header = conn.recv(9)
        except OSError:
            header = b""
    if len(header) < 4 or header[3] != 0x04:  # a gRPC server answers with a SETTINGS frame
        raise ClusterError(
            f"{address!r} accepts connections but does not answer as a Ray cluster (expected Ray's GCS, "
            "a gRPC server; is it the right port?)"
        )


def choose_backend(requested: str | None, world_size: int, gpus_per_rank: float) -> tuple[str, str]:
    """The backend to run on and why: ``requested`` if given, else ``cuda`` when the cluster
    has ``gpus_per_rank`` GPUs for each of ``world_size`` ranks and a GPU worker has what the
    CUDA backend needs (``piper_runtime.backends.cuda.cuda_missing``), else ``cpu``."""
    if requested not in (None, "auto"):
        return requested, f"backend {requested!r} (asked for)"
    gpus = ray.cluster_resources().get("GPU", 0.0)
    need = world_size * gpus_per_rank
    if gpus <= 0:
        return "cpu", "backend 'cpu' (the Ray cluster has no GPU)"
    if gpus + 1e-9 < need:
        return "cpu", (
            f"backend 'cpu' (the Ray cluster has {gpus:g} GPUs, {world_size} ranks need {need:g}; "
            "--ranks-per-gpu shares GPUs between ranks)"
        )
    missing = _probe_gpu_worker(min(1.0, gpus_per_rank))
    if missing:
        return "cpu", f"backend 'cpu' (a GPU worker cannot run the CUDA backend: {missing})"
    return "cuda", f"backend 'cuda' ({gpus:g} GPUs in the cluster for {world_size} ranks)"


def _probe_gpu_worker(gpus: float) -> str | None:
    """What a Ray worker holding ``gpus`` GPUs lacks for the CUDA backend (``None``: nothing)."""
    from piper_runtime.backends.cuda import cuda_missing

    probe = ray.remote(num_cpus=0, num_gpus=gpus, max_retries=0)(cuda_missing)
    try:
        return ray.get(probe.remote(), timeout=120)
    except Exception as exc:  # the probe itself could not run
        return f"the probe task failed ({type(exc).__name__}: {exc})"
