"""How the driver reaches its ranks: the ``Ranks`` protocol, and ``ThreadRanks``, every rank a
``RankWorker`` on threads of this process (the ``local`` runtime).

``Runtime`` (``piper_runtime.driver.runtime``) holds the driver's logic once: steps in flight,
gathering answers in rank order, the hung-rank watchdog, checkpoints, merging. What differs
between runtimes is only how a call reaches a rank and how its answer comes back: a Ray actor
(``ray_ranks.RayRanks``), a thread here (``ThreadRanks``), or this very process's own rank
of a launched job (``spmd_ranks.SpmdRanks``).

A call returns a handle at once; ``wait`` returns the handles answered; ``get`` returns an
answered call's value or raises ``RankFailure`` (the rank raised, died, or said nothing).
Calls to one rank run one at a time in the order sent, except on the ``monitor`` lane (the
watchdog's progress reads, beside a running step) and the ``writer`` lane (a checkpoint's
files, written while the next steps run).

``ThreadRanks``: one thread per rank and lane. What a call is given and what it returns is
copied (a rank must not share tensors with the driver or another rank, as it does not over
Ray), except ``Program``s, which are immutable. A user can set a breakpoint in their model
and step through a pipeline rank by rank; ranks run on the CPU only (backend ``local``).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import copy
import queue
import sys
import threading
import traceback
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from piper_ir import ClusterError, Program
from piper_runtime.backends import BackendFactory, backend_factory
from piper_runtime.backends.local import forget_world, new_world
from piper_runtime.options import RunOptions
from piper_runtime.rank.process import TORCH_THREADS, ProcessSettings
from piper_runtime.rank.worker import RankWorker

LANES = (None, "monitor", "writer")


class RankFailure(Exception):
    """A call on a rank that did not return a value: ``how`` is ``"raised"`` (``cause``: what
    the rank raised; ``text``: it, with the rank's traceback), ``"died"`` or ``"silent"``."""

    def __init__(self, how: str, text: str, cause: BaseException | None = None) -> None:
        super().__init__(text)
        self.how = how
        self.text = text
        self.cause = cause


class Ranks(Protocol):
    """The driver's line to its ranks (module doc)."""

    backend_name: str
    backend_reason: str
    factory: BackendFactory
    address: str  # where rank 0 opens the rendezvous (``"local"``: no network)
    binds_cores: bool  # whether each rank may bind its step threads to cores of its own
    # Whether this process writes what the run writes once (a checkpoint's index): False in the
    # processes of a launched job but rank 0's (``spmd_ranks``), where each runs the driver.
    coordinator: bool
    # The name every process of a launched job gives the temporary directory it writes a
    # checkpoint's rank files into (``<pid>@<host>-<8 hex>``); None where one process drives.
    writer: str | None

    @property
    def world_size(self) -> int: ...

    @property
    def closed(self) -> bool: ...

    def call(self, rank: int, method: str, *args: Any, group: str | None = None) -> Any:
        """Call ``RankWorker.<method>(*args)`` on ``rank`` (on lane ``group``); a handle."""
        ...

    def share(self, value: Any) -> Any:
        """``value`` as several ranks' calls receive it best (Ray: in its object store)."""
        ...

    def wait(self, handles: Sequence[Any], timeout_s: float | None, every: bool = False) -> list[Any]:
        """The handles answered once one (``every``: all) is, or ``timeout_s`` passed."""
        ...

    def get(self, handle: Any, rank: int) -> Any:
        """An answered call's value, or ``RankFailure``."""
        ...

    def kill(self) -> None:
        """End every rank now (a failed run: peers may wait for the culprit forever)."""
        ...

    def close(self, clean: bool) -> None:
        """End the run's ranks; ``clean``: nothing is in flight (they may be reused)."""
        ...


class ThreadRanks:
    """``Ranks`` as threads of this process (module doc)."""

    address = "local"
    binds_cores = False  # the ranks' threads share this process's cores
    coordinator = True
    writer = None

    def __init__(
        self, program: Program, options: RunOptions, log: Callable[[str], None] | None, by_value: Sequence[str]
    ) -> None:
        if options.cluster.backend not in (None, "local", "cpu"):
            raise ClusterError(
                f"runtime 'local' runs every rank as a thread of this process on the CPU; backend "
                f"{options.cluster.backend!r} needs runtime 'ray' or 'torchrun'"
            )
        self.backend_name = "local"
        self.backend_reason = (
            f"runtime 'local': {program.world_size} ranks as threads of this process (gloo groups on loopback)"
        )
        if log is not None:
            log(self.backend_reason)
        self.factory = backend_factory("local")
        self._process = ProcessSettings.read()  # what the ranks' setup changes, put back at the end
        self._lanes = [{lane: Lane(f"piper-rank{rank}-{lane or 'calls'}") for lane in LANES}
                       for rank in range(program.world_size)]
        self.workers = [RankWorker(own_process=False) for _ in range(program.world_size)]
        self._world = new_world()  # the key of this run's in-process store
        # Ends the ranks on kill, close, garbage collection or interpreter exit, whichever first.
        self._finalizer = weakref.finalize(self, _end, self.workers, self._lanes, self._world, self._process)

    @property
    def world_size(self) -> int:
        return len(self.workers)

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def call(self, rank: int, method: str, *args: Any, group: str | None = None) -> cf.Future:
        if self.closed:
            raise RuntimeError("the local ranks are closed")
        if method == "open_rendezvous":  # no network: the run's in-process store
            done: cf.Future = cf.Future()
            done.set_result(self._world)
            return done
        kept = {id(a): a for a in args if isinstance(a, Program)}  # immutable: shared, not copied
        args = copy.deepcopy(args, kept)
        bound = getattr(self.workers[rank], method)
        return self._lanes[rank][group].submit(lambda: copy.deepcopy(bound(*args)))

    def share(self, value: Any) -> Any:
        return value

    def wait(self, handles: Sequence[cf.Future], timeout_s: float | None, every: bool = False) -> list[cf.Future]:
        when = cf.ALL_COMPLETED if every else cf.FIRST_COMPLETED
        done, _ = cf.wait(handles, timeout=timeout_s, return_when=when)
        return [h for h in handles if h in done]

    def get(self, handle: cf.Future, rank: int) -> Any:
        try:
            return handle.result(timeout=10)
        except cf.TimeoutError:
            raise RankFailure("silent", "did not answer") from None
        except cf.CancelledError:
            raise RankFailure("died", "its call was cancelled (the run was torn down)") from None
        except Exception as exc:
            text = "".join(traceback.format_exception(exc))
            raise RankFailure("raised", text, exc) from None

    def kill(self) -> None:
        self._finalizer()

    def close(self, clean: bool) -> None:
        if clean and not self.closed:
            for rank, worker in enumerate(self.workers):  # leave the world as a worker process would
                self._lanes[rank][None].submit(worker.shutdown).result(timeout=30)
        self._finalizer()


def _end(workers: list[RankWorker], lanes: list[dict[str | None, Lane]], world: int,
         process: ProcessSettings) -> None:
    """Abort every rank's groups (a rank blocked in a wait gets an error at once), stop the
    lanes, drop the run's store, and put back what the ranks' setup changed in the process."""
    for worker in workers:
        abort = getattr(worker.backend, "abort", None)
        if abort is not None:
            abort()
    for per_rank in lanes:
        for lane in per_rank.values():
            lane.stop()
    forget_world(world)
    sys.setswitchinterval(process.switch_interval)
    torch.set_num_threads(process.threads)


class Lane:
    """One daemon thread running calls one at a time, in the order submitted: a rank stuck for
    good (a hung forward the watchdog reported, a receive from a peer that died) must not keep
    the interpreter from exiting, as an executor's thread would (they are joined at exit)."""

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue[tuple[cf.Future, Callable[[], Any]] | None] = queue.SimpleQueue()
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def submit(self, call: Callable[[], Any]) -> cf.Future:
        future: cf.Future = cf.Future()
        self._calls.put((future, call))
        return future

    def stop(self) -> None:
        """Cancel the calls not started; the thread ends after the one running, if that returns."""
        with contextlib.suppress(queue.Empty):
            while True:
                item = self._calls.get_nowait()
                if item is not None:
                    item[0].cancel()
        self._calls.put(None)

    def _run(self) -> None:
        torch.set_num_threads(TORCH_THREADS)  # per thread under OpenMP: as in a worker process
        while (item := self._calls.get()) is not None:
            future, call = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(call())
            except BaseException as exc:  # the driver reads it from the future
                future.set_exception(exc)
