"""Which runtime runs a program: the ``TrainingRuntime`` protocol the front door talks to, and
runtimes found by name.

A runtime is started by a *starter*: ``starter(program, modules, optimizer, options, *, log,
by_value) -> TrainingRuntime``. The built-in ones (``ray``, ``local``, ``torchrun``) are
``piper_runtime.Runtime`` over different ``Ranks``; another package adds one by declaring an
entry point in the group ``piper.runtimes`` (``name = "package.module:starter"``), or, within
one process, with ``register_runtime``. ``RunOptions.cluster.runtime`` names the one to start.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, Protocol

from piper_ir import ClusterError, Program
from piper_runtime.options import RunOptions, reuse_by_default

if TYPE_CHECKING:  # annotations only: ``prepare_runtime`` runs before the command imports torch
    import torch
    from torch import nn

    from piper_runtime.optim import OptimizerSpec
    from piper_runtime.results import StepResult

ENTRY_POINTS = "piper.runtimes"


class PendingResult(Protocol):
    def result(self) -> StepResult: ...


class PendingWrite(Protocol):
    def done(self) -> bool: ...

    def wait(self, timeout_s: float = 300.0) -> None: ...

    def abandon(self) -> None: ...


class TrainingRuntime(Protocol):
    """What the front door (``piper_train``) needs of a runtime: start (the starter), run
    steps, evaluate, checkpoint, load, read parameters, close. Requests and results are
    ``piper_runtime``'s typed objects (``StepRequest``, ``StepResult``). Optional, read with
    ``getattr``: ``add_variant(program, forward=False)`` and ``drain()`` (``Runtime``'s) let
    batches of other shapes than the program's run; a runtime without them runs the
    program's shapes only."""

    on_nan: str
    # Under a launcher every process runs the front door: only the coordinator writes what the
    # run writes once (checkpoint renames, metrics); ``writer`` names the checkpoint temporary
    # directory every process derives alike (``None``: one driver). The front door reads both
    # with defaults (True, None), so a runtime with one driver may leave them out.
    coordinator: bool
    writer: str | None

    @property
    def closed(self) -> bool: ...

    def agree(self, value: Any) -> Any:
        """The coordinator's ``value`` in every process (one driver: ``value``)."""
        ...

    def submit_steps(self, requests: Sequence[Any]) -> Sequence[PendingResult]:
        """Send consecutive training steps (``StepRequest``s); one pending result each."""
        ...

    def load_forward(self, program: Program) -> None:
        """Keep a forward-only program of the same world for ``evaluate``."""
        ...

    def evaluate(self, inputs: Sequence[torch.Tensor], targets: Sequence[torch.Tensor]) -> StepResult: ...

    def parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter by qualified name, whole."""
        ...

    def save_checkpoint(
        self, path: str, objects: Mapping[str, Any] | None = None, timeout_s: float = 300.0, *, wait: bool = True
    ) -> PendingWrite | None: ...

    def load_checkpoint(self, path: str, step: int, rng: bool = False, timeout_s: float = 300.0) -> None: ...

    def worker_pids(self) -> list[int]: ...

    def shutdown(self) -> None: ...


Starter = Callable[..., TrainingRuntime]

_registered: dict[str, Starter] = {}
_lock = threading.Lock()


def register_runtime(name: str, starter: Starter, *, replace: bool = False) -> None:
    """Make ``starter`` the runtime ``name`` in this process (an entry point does it for every
    process that has the package installed)."""
    with _lock:
        if name in _registered and not replace:
            raise ValueError(f"runtime {name!r} is already registered")
        _registered[name] = starter


def unregister_runtime(name: str) -> None:
    with _lock:
        _registered.pop(name, None)


def _declared() -> dict[str, Any]:
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINTS)}


def runtime_names() -> tuple[str, ...]:
    """Every runtime this process can start: declared by entry point or registered here."""
    with _lock:
        registered = set(_registered)
    return tuple(sorted(registered | set(_declared())))


def starter(name: str) -> Starter:
    """The starter of runtime ``name``; an unknown name raises ``ClusterError`` listing the
    known ones."""
    with _lock:
        found = _registered.get(name)
    if found is not None:
        return found
    declared = _declared().get(name)
    if declared is None:
        raise ClusterError(f"unknown runtime {name!r}; this installation has: {', '.join(runtime_names())}")
    return declared.load()


def start_runtime(
    program: Program,
    modules: Mapping[str, nn.Module],
    optimizer: OptimizerSpec | None,
    options: RunOptions,
    *,
    log: Callable[[str], None] | None = None,
    by_value: Sequence[str] = (),
) -> TrainingRuntime:
    """Start the runtime ``options.cluster.runtime`` names, running ``program``."""
    return starter(options.cluster.runtime)(program, modules, optimizer, options, log=log, by_value=by_value)


def prepare_runtime(options: RunOptions, world: int) -> None:
    """Start in the background what the runtime ``options`` names will need for ``world``
    ranks, while the caller captures and compiles: the ``ray`` runtime's embedded cluster
    (``piper_runtime.driver.cluster.start_early``; its processes start on the machine's other
    cores). The other runtimes start nothing ahead, nor does ``ray`` with the ``cuda`` backend
    (refused without a GPU before anything starts) or a cluster address (connecting is quick).
    Without worker reuse the same thread then starts the ``world`` rank workers, which import
    what a rank needs meanwhile (``piper_runtime.driver.early_workers``). A wrong ``world``
    costs nothing but time: a cluster with too few CPUs is started again, workers that do not
    fit are replaced."""
    cluster = options.cluster
    if cluster.runtime != "ray" or cluster.backend == "cuda" or world < 1:
        return
    from piper_runtime.driver.cluster import embedded_cpus, start_early
    from piper_runtime.driver.early_workers import WorkerRequest

    reuse = cluster.reuse_workers if cluster.reuse_workers is not None else reuse_by_default()
    request = None if reuse is not False else WorkerRequest(world, cluster)
    start_early(cluster.address, embedded_cpus(world, cluster.cpus_per_rank), request)
