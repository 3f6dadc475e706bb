"""``SpmdRanks``: this process is one rank of a job ``torchrun`` launched (on one node, on several,
or one torchrun per node under ``srun``): the ``torchrun`` runtime.

Every process of the job runs the same front door (capture and compile are deterministic: the
same ``Program`` everywhere) and the same ``Runtime``, whose driver calls every rank in the same
order; each process holds only its own rank, a ``RankWorker`` on threads of its own (one per
lane, as ``ThreadRanks``), on the ``cpu`` backend or, where this process has a usable GPU, the
``cuda`` one (GPU ``LOCAL_RANK``), in torch.distributed's default world.

- **Calls.** A call on the own rank runs here; its outcome (the value, or the exception with its
  traceback) is published in the store under (lane, sequence number of the calls to that rank
  on that lane, rank). A call on a peer is a handle on that peer's outcome of the same call,
  polled for (``wait``) and read (``get``); the last process to read one deletes it, so a long
  run does not grow the store. An outcome names its method: drivers that diverged fail, naming
  both. The watchdog's ``progress`` (lane ``monitor``) reaches the own rank only; a peer's is
  ``None`` at once ("cannot say"): each process watches its own rank.
- **Agreement.** What a driver decides by its clock (``fit``'s automatic steps per call) must be
  the same in every process: ``agree(value)`` is the coordinator's value in all of them.
- **Rendezvous.** torchrun's agent serves a TCPStore at ``MASTER_ADDR:MASTER_PORT``: every rank
  is a client there (``rendezvous.attach_store``), its keys under ``piper/<run id>/<restart
  count>/<runtime number in this process>``, as the store outlives both; nothing is opened here.
- **Failure.** ``kill`` publishes that this process ended the run (its peers' waits for it fail
  at once), after the outcomes its rank has made are published (a peer then reads why the
  rank failed, not only that the run ended; at most ``PUBLISH_WAIT_S``), and stops the own
  rank's threads (daemons: one blocked in a receive does not keep the process alive); the
  command exits 3, torchrun ends the other processes and, within its ``--max-restarts``,
  starts them again (``piper train`` then resumes: docs/torchrun.md). A process names its own
  rank's failure, unless another process ended the run before: then that process's rank's
  failure, the run's cause (this rank's is mostly its consequence: a message to or from a
  process that exited), so every process names the same one.
- **Shared files.** Only the coordinator (rank 0) writes what the job writes once (a
  checkpoint's index, manifest and rename, metrics, the ``--json`` document); ``writer`` names
  the temporary directory every process writes its rank's checkpoint files into.
- **Trust.** Outcomes travel as data (``outcomes``: a JSON tree and a safetensors buffer,
  rebuilding only the records a rank returns), never as pickles: whoever can write to the
  job's store can send wrong numbers, not run code here (docs/torchrun.md).
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import contextlib
import copy
import hashlib
import itertools
import json
import os
import socket
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import attrs
import torch
import torch.distributed as dist

from piper_ir import ClusterError, ExecutionError, Program
from piper_runtime.backends import Backend, BackendFactory, backend_factory
from piper_runtime.driver.outcomes import Outcome, unpack
from piper_runtime.driver.ranks import LANES, Lane, RankFailure
from piper_runtime.options import RunOptions
from piper_runtime.rank.worker import RankWorker
from piper_runtime.rendezvous import attach_store, store_client

ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
LAUNCH_HINT = "launch every rank with `torchrun --nproc-per-node N -m piper_train train --runtime torchrun ...`"
_POLL_S = (0.0002, 0.005)  # the first and the longest pause between looks at the store
_ABORT = "abort"  # set by a process that ended the run: its rank
PUBLISH_WAIT_S = 5.0  # how long ending the run waits for the own rank's made outcomes to be published
# Runtimes started here, by launch and rank (one of each per process; tests hold several): every
# process of a job starts as many, in one order, so their numbers agree.
_started: collections.Counter[Launch] = collections.Counter()


@attrs.frozen
class Launch:
    """What torchrun told this process, in its environment."""

    rank: int
    world_size: int
    local_rank: int
    address: str
    port: int
    run_id: str = "none"
    restart: int = 0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Launch:
        """The launch, or ``ClusterError`` saying how to launch where a variable is missing."""
        env = os.environ if environ is None else environ
        missing = [name for name in ENV if not env.get(name)]
        if missing:
            raise ClusterError(
                f"runtime 'torchrun': {', '.join(missing)} not set: this process was not launched by torchrun; "
                f"{LAUNCH_HINT} (docs/torchrun.md)"
            )
        if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
            raise ClusterError(
                "runtime 'torchrun': TORCHELASTIC_USE_AGENT_STORE is not True, so no torchrun agent serves the store "
                f"the ranks meet at; {LAUNCH_HINT}"
            )
        try:
            return cls(
                int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"]), env["MASTER_ADDR"],
                int(env["MASTER_PORT"]), env.get("TORCHELASTIC_RUN_ID") or "none",
                int(env.get("TORCHELASTIC_RESTART_COUNT") or 0),
            )
        except ValueError as err:
            raise ClusterError(f"runtime 'torchrun': a torchrun variable is not a number ({err})") from None


def choose_backend(requested: str | None, local_rank: int) -> tuple[str, str, BackendFactory]:
    """The backend of this process's rank, why, and its factory: ``requested`` if given, else
    ``cuda`` where this process has a usable GPU (``cuda_missing``), else ``cpu``."""
    from piper_runtime.backends.cuda import cuda_missing

    if requested == "local":
        raise ClusterError(
            "backend 'local' runs ranks as threads of one process; runtime 'torchrun' runs one rank per process "
            "(backend cpu or cuda)"
        )
    if requested not in (None, "auto"):
        if requested == "cuda":
            lacking = cuda_missing()
            if lacking:
                raise ClusterError(f"backend 'cuda' needs a usable GPU in every process, and this one has none: {lacking}")
            return "cuda", "backend 'cuda' (asked for)", _cuda_factory(local_rank)
        return requested, f"backend {requested!r} (asked for)", backend_factory(requested)
    lacking = cuda_missing()
    if lacking:
        return "cpu", f"backend 'cpu' ({lacking})", backend_factory("cpu")
    return "cuda", f"backend 'cuda' (GPU {local_rank % torch.cuda.device_count()} of this process)", _cuda_factory(
        local_rank)


def _cuda_factory(local_rank: int) -> BackendFactory:
    """The CUDA backend on GPU ``LOCAL_RANK`` of those this process sees (every process of a node
    sees them all under torchrun; one that sees fewer shares them)."""

    def make() -> Backend:
        from piper_runtime.backends.cuda import CudaBackend
        from piper_runtime.backends.device import CupyDevice

        return CudaBackend(device=CupyDevice(local_rank % max(1, torch.cuda.device_count())))

    return make


class SpmdRanks:
    """``Ranks`` of a launched job, this process holding its own (module doc)."""

    binds_cores = True  # each rank is a process of its own, as a Ray worker is

    def __init__(
        self,
        program: Program,
        options: RunOptions,
        log: Callable[[str], None] | None,
        by_value: Sequence[str],
        launch: Launch | None = None,  # tests: what the environment would say
    ) -> None:
        launch = launch or Launch.from_env()
        if launch.world_size != program.world_size:
            raise ClusterError(
                f"the program has {program.world_size} ranks, but torchrun launched WORLD_SIZE={launch.world_size} "
                "processes: pp*dp*tp*ep must equal --nproc-per-node x nodes"
            )
        self.launch = launch
        self.rank = launch.rank
        self.coordinator = launch.rank == 0
        self.backend_name, reason, self.factory = choose_backend(options.cluster.backend, launch.local_rank)
        self.backend_reason = (
            f"runtime 'torchrun': rank {launch.rank} of {launch.world_size} in this process (local rank "
            f"{launch.local_rank}, restart {launch.restart}); {reason}"
        )
        if log is not None:
            log(self.backend_reason)
        self.address = _resolve(launch.address)
        namespace = f"piper/{launch.run_id}/{launch.restart}/{_started[launch]}"
        _started[launch] += 1
        attach_store(self.address, launch.port, f"{namespace}/world")  # the backend's world, beside the calls
        client = store_client(self.address, launch.port, launch.world_size, options.faults.worker_timeout())
        self._store = dist.PrefixStore(f"{namespace}/calls", client)
        self._readers = launch.world_size - 1  # every outcome is read by each peer
        self._closed = False
        self.writer = self._hello(namespace, options.faults.setup_timeout_s)
        self._sequence: dict[tuple[int, str | None], Iterator[int]] = collections.defaultdict(itertools.count)
        self._agreements = itertools.count()
        self._publishing: list[_Own] = []  # own calls whose outcomes the peers read, until published
        self._lanes = {lane: Lane(f"piper-rank{launch.rank}-{lane or 'calls'}") for lane in LANES}
        # Made on its own thread: a worker made on the main thread would take its signals.
        self.worker: RankWorker = self._lanes[None].submit(RankWorker).result()

    def _hello(self, namespace: str, timeout_s: float) -> str:
        """Meet every rank once: all chose one backend (else ``ClusterError``); the name of the
        coordinator's temporary checkpoint directories (``writer``: its process and this launch)."""
        me = {"backend": self.backend_name, "writer": f"{os.getpid()}@{socket.gethostname()}"}
        self._store.set(f"hello/{self.rank}", json.dumps(me))
        keys = [f"hello/{r}" for r in range(self.launch.world_size)]
        deadline = time.monotonic() + timeout_s
        while not self._store.check(keys):  # not the store's own wait, which holds the GIL while it blocks
            if time.monotonic() >= deadline:
                absent = [r for r, key in enumerate(keys) if not self._store.check([key])]
                raise ClusterError(f"runtime 'torchrun': ranks {absent} did not join within {timeout_s:g} s")
            time.sleep(_POLL_S[1])
        hello = [json.loads(self._store.get(key)) for key in keys]
        backends = {r: h["backend"] for r, h in enumerate(hello)}
        if len(set(backends.values())) > 1:
            raise ClusterError(f"runtime 'torchrun': the processes chose different backends ({backends}); give "
                               "--backend cpu or cuda")
        return f"{hello[0]['writer']}-{hashlib.sha256(namespace.encode()).hexdigest()[:8]}"

    @property
    def world_size(self) -> int:
        return self.launch.world_size

    @property
    def closed(self) -> bool:
        return self._closed

    def call(self, rank: int, method: str, *args: Any, group: str | None = None) -> Any:
        if self._closed:
            raise RuntimeError("the torchrun ranks are closed")
        if method == "open_rendezvous":  # torchrun's agent serves the store already
            return _Answered(self.launch.port)
        if group == "monitor":  # each process watches its own rank
            if rank != self.rank:
                return _Answered(None)
            monitored = getattr(self.worker, method)
            return _Own(self._lanes[group].submit(lambda: monitored(*args)), method, published=False)
        key = f"{group or 'calls'}/{next(self._sequence[(rank, group)])}/{rank}"
        if rank != self.rank:
            return _Peer(rank, key, method)
        kept = {id(a): a for a in args if isinstance(a, Program)}  # immutable: shared, not copied
        args = copy.deepcopy(args, kept)
        bound = getattr(self.worker, method)

        handle = _Own(None, method, published=True)

        def run() -> Outcome:
            outcome = Outcome(method, lambda: bound(*args))
            # Ready before its peers can read it: a peer that reads a failure ends the run at
            # once, and this process must then see its own rank's failure, not that ending.
            handle.failed = outcome.error is not None
            handle.settled = True
            if self._readers:
                self._store.set(key, outcome.pack())
            return outcome

        handle.future = self._lanes[group].submit(run)
        self._publishing = [h for h in self._publishing if not h.future.done()]  # type: ignore[union-attr]
        self._publishing.append(handle)
        return handle

    def share(self, value: Any) -> Any:
        return value

    def wait(self, handles: Sequence[Any], timeout_s: float | None, every: bool = False) -> list[Any]:
        if not handles:
            return []
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        pause = _POLL_S[0]
        while True:
            self._poll(handles)
            # The own rank's first: where it failed, that is why, not a peer's process ending the run.
            ready = sorted((h for h in handles if h.ready), key=lambda h: not isinstance(h, _Own))
            if any(isinstance(h, _Own) and h.failed for h in ready):
                ready = self._cause_first(handles, ready)
            if len(ready) == len(handles) or (ready and not every):
                return ready
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return ready
            time.sleep(pause if deadline is None else min(pause, deadline - now))
            pause = min(2 * pause, _POLL_S[1])

    def _poll(self, handles: Sequence[Any]) -> None:
        """Read the peers' outcomes once all are published; fail those that will not come (a
        process ended the run, the store is gone). Two round trips a look, whatever the
        world's size: a gather waits for every rank anyway, and a rank that fails makes its
        process end the run (``kill``), which every waiting process sees."""
        waiting = [h for h in handles if isinstance(h, _Peer) and not h.ready]
        if not waiting:
            return
        try:
            if self._store.check([h.key for h in waiting]):  # true once every key is there
                for h in waiting:
                    h.blob = self._store.get(h.key)
                    self._read(h.key)
                return
            if not self._store.check([_ABORT]):
                return
            ended = int(self._store.get(_ABORT))
            # Look again: a rank publishes its outcome before its process ends the run, so an
            # outcome set between the two looks above is read, not reported as a death.
            for h in waiting:
                if self._store.check([h.key]):
                    h.blob = self._store.get(h.key)
                    self._read(h.key)
            waiting = [h for h in waiting if h.blob is None]
            culprits = [h for h in waiting if h.rank == ended] or waiting
            for h in culprits:
                h.failure = RankFailure("died", f"the process of rank {ended} ended the run (a rank failed)")
        except (RuntimeError, ValueError) as err:  # torch's store errors are RuntimeErrors
            for h in waiting:
                h.failure = RankFailure("died", f"the job's store at {self.address}:{self.launch.port} failed: {err}")

    def _cause_first(self, handles: Sequence[Any], ready: list[Any]) -> list[Any]:
        """``ready`` (this rank's call failed), with the call of the rank whose process ended
        the run first where that call failed too: that failure is the run's, this rank's mostly
        its consequence (a message to or from a process that exited). Its outcome was published
        before its process ended the run (``kill``); an ending without one (a process that read
        this rank's failure and ended the run for it) leaves this rank's first."""
        try:
            if not self._store.check([_ABORT]) or (ended := int(self._store.get(_ABORT))) == self.rank:
                return ready
        except (RuntimeError, ValueError):  # the store is gone with the job: nothing to tell
            return ready
        self._poll(handles)
        for h in handles:
            if isinstance(h, _Peer) and h.rank == ended and h.blob is not None:
                try:
                    unpack(h.blob, h.method, h.rank)
                except RankFailure:
                    rest = (r for r in handles if r.ready and r is not h)
                    return [h, *sorted(rest, key=lambda r: not isinstance(r, _Own))]
        return ready

    def _read(self, key: str) -> None:
        """Count a read of ``key``; the last of its readers deletes it."""
        if self._store.add(f"{key}/reads", 1) >= self._readers:
            self._store.delete_key(key)
            self._store.delete_key(f"{key}/reads")

    def get(self, handle: Any, rank: int) -> Any:
        if isinstance(handle, _Answered):
            return handle.value
        if isinstance(handle, _Own):
            assert handle.future is not None  # ``call`` sets it before it returns the handle
            try:
                result = handle.future.result(timeout=10)
            except cf.TimeoutError:
                raise RankFailure("silent", "did not answer") from None
            except cf.CancelledError:
                raise RankFailure("died", "its call was cancelled (the run was torn down)") from None
            except Exception as exc:
                raise RankFailure("raised", "".join(traceback.format_exception(exc)), exc) from None
            return copy.deepcopy(result.result(rank)) if handle.published else result  # as a peer gets its own
        if handle.failure is not None:
            raise handle.failure
        if handle.blob is None:
            raise RankFailure("silent", "did not answer")
        return unpack(handle.blob, handle.method, rank)

    def agree(self, value: Any) -> Any:
        """The coordinator's ``value``, in every process (module doc); each process must ask
        as often, in one order."""
        if not self._readers or self._closed:
            return value
        key = f"agree/{next(self._agreements)}"
        if self.coordinator:
            self._store.set(key, Outcome("agree", lambda: value).pack())
            return value
        handle = _Peer(0, key, "agree")
        self.wait([handle], None)
        try:
            return self.get(handle, 0)
        except RankFailure as failure:
            raise ExecutionError(f"waiting for rank 0's decision: {failure.text}", ranks=(0,)) from None

    def kill(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._readers:
            # An outcome made (``settled``: its call was ready here) is published first: the
            # peers look for it once more when they see the run ended (``_poll``). A call
            # still running is not waited for (its rank may be the one that hung).
            made = [h.future for h in self._publishing if h.settled and h.future is not None]
            cf.wait(made, timeout=PUBLISH_WAIT_S)
            with contextlib.suppress(Exception):  # the store may be gone with the job
                self._store.set(_ABORT, str(self.rank))
        abort = getattr(self.worker.backend, "abort", None)
        if abort is not None:
            abort()
        self._stop()

    def close(self, clean: bool) -> None:
        if self._closed:
            return
        if not clean:
            self.kill()
            return
        self._closed = True
        try:
            self._lanes[None].submit(self.worker.shutdown).result(timeout=30)
        finally:
            self._stop()

    def _stop(self) -> None:
        for lane in self._lanes.values():
            lane.stop()


@attrs.define(eq=False)
class _Answered:
    """A call answered without running anything (a peer's progress, the rendezvous port)."""

    value: Any
    ready = True


@attrs.define(eq=False)
class _Own:
    """A call on this process's rank: the future of its ``Outcome`` (``published``: the call's
    peers read it; else the future's value is the call's own). ``settled``: the outcome is
    made (the future is done a moment later, once it is published)."""

    future: cf.Future | None
    method: str
    published: bool
    settled: bool = False
    failed: bool = False  # the outcome made is a failure (``settled`` then too)

    @property
    def ready(self) -> bool:
        return self.settled or (self.future is not None and self.future.done())


@attrs.define(eq=False)
class _Peer:
    """A call on a peer: its outcome once published (``blob``), or why none will come."""

    rank: int
    key: str
    method: str
    blob: bytes | None = None
    failure: RankFailure | None = None

    @property
    def ready(self) -> bool:
        return self.blob is not None or self.failure is not None


def _resolve(address: str) -> str:
    """``MASTER_ADDR`` as an address (torchrun may give a host name, ``localhost`` on one node):
    what the ranks' socket interfaces are chosen by (``rendezvous.set_socket_interfaces``)."""
    for family in (socket.AF_INET, socket.AF_UNSPEC):  # IPv4 first: ``localhost`` may list ::1 before it
        try:
            return str(socket.getaddrinfo(address, None, family, socket.SOCK_STREAM)[0][4][0])
        except OSError:
            continue
    return address
