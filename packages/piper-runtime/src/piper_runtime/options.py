"""What a run is started with, as typed, frozen objects, one per concern, passed whole from the
command line (or ``Trainer``) through the driver to every rank.

- ``ExecutionOptions``: how a rank walks its plan (threads per stream, gradient fusion, cores);
- ``FaultOptions``: what bounds a run and what a NaN does (watchdog, step and setup bounds);
- ``ClusterOptions``: which runtime starts the ranks and where they run (address, backend,
  placement, GPU sharing, worker reuse);
- ``RunOptions``: the three together, and the seed every forward's random numbers derive from.

Each value is checked once, here, when the object is made; a bad one raises ``ValueError``
naming the field. ``RunOptions.build(**settings)`` routes flat keyword names (``timeout_s=``,
``threads=``, ...) to their concern, for callers that set one or two.
"""

from __future__ import annotations

import math
import os
from typing import Any

import attrs

DEFAULT_TIMEOUT_S = 60.0  # no progress on a rank for this long: the step fails (HangError)
MIN_WEIGHT_BYTES = 2**20  # the smallest ``nn.Linear`` weight whose gradient sums in its product
PLACEMENTS = ("pack", "spread")
COMPILE_BACKENDS = ("inductor", "aot_eager")  # ``ExecutionOptions.compile`` (piper_runtime.rank.compiled)
RUNTIME_ENV = "PIPER_RUNTIME"  # the runtime a run starts unless told otherwise (default: ray)
REUSE_ENV = "PIPER_REUSE_WORKERS"  # "1": runtimes use the shared pool unless told otherwise
ON_NAN = ("stop", "skip-step", "continue")  # ``FaultOptions.on_nan`` (piper_runtime.numerics)


def default_runtime() -> str:
    """``$PIPER_RUNTIME`` where set, else ``ray``."""
    return os.environ.get(RUNTIME_ENV) or "ray"


def reuse_by_default() -> bool:
    """What a ``reuse_workers`` of ``None`` means: the shared pool where ``REUSE_ENV`` is ``1``."""
    return os.environ.get(REUSE_ENV, "") == "1"


def check_on_nan(policy: str) -> str:
    """``policy`` if it is one of ``ON_NAN``, else ``ValueError`` naming them."""
    if policy not in ON_NAN:
        raise ValueError(f"on_nan must be one of {', '.join(ON_NAN)}; got {policy!r}")
    return policy


def _positive(_: object, attribute: attrs.Attribute, value: float | None) -> None:
    if value is not None and not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
        raise ValueError(f"{attribute.name} must be a finite number > 0, got {value!r}")


@attrs.frozen
class ExecutionOptions:
    """How each rank runs its plan. ``threads``: one thread per logical stream (else one
    sequential walk of the same plan). ``fuse_loss_backward``: a loss's backward runs with its
    stage's where the plan allows (off: a profile times each segment alone).
    ``grad_fusion_min_bytes``: ``nn.Linear`` weights of at least this many bytes add each
    microbatch's gradient inside the product that computes it (``None``: autograd adds every
    one). ``input_grads_first``: a stage's last backward sends its input gradient before those
    layers add their weight products. ``bind_cores``: bind each rank's step threads to cores of
    its own where the host has a free core per rank. ``profile_kernels``: a profiled step
    (``profile=True``) also records torch.profiler's trace of the operators (and kernels) each
    instruction ran (piper_runtime.rank.kernel_profile). ``memory_snapshot``: a profiled step
    also keeps every memory sample (what the rank holds by category after each instruction)
    and, on a GPU, CUDA's memory history (piper_runtime.rank.memory_snapshot). ``compile``:
    run each segment's forward and backward passes as compiled functions (``"inductor"``, or
    ``"aot_eager"``: the traced graphs without code generation; ``None``: eagerly, under
    autograd; piper_runtime.rank.compiled)."""

    threads: bool = True
    fuse_loss_backward: bool = True
    grad_fusion_min_bytes: int | None = MIN_WEIGHT_BYTES
    input_grads_first: bool = True
    bind_cores: bool = True
    profile_kernels: bool = False
    memory_snapshot: bool = False
    compile: str | None = None

    def __attrs_post_init__(self) -> None:
        if self.compile not in (None, *COMPILE_BACKENDS):
            raise ValueError(f"compile must be one of {', '.join(COMPILE_BACKENDS)} or None, got {self.compile!r}")
        if self.grad_fusion_min_bytes is not None and self.grad_fusion_min_bytes < 0:
            raise ValueError(f"grad_fusion_min_bytes must be >= 0 or None, got {self.grad_fusion_min_bytes!r}")


@attrs.frozen
class FaultOptions:
    """What bounds a run. ``timeout_s``: a rank that makes no progress for this long during a
    step fails it (``HangError`` naming the rank); ``step_timeout_s``: when given, also bounds
    each step's whole duration; ``setup_timeout_s``: bounds start-up (workers, rendezvous).
    ``on_nan``: ``"stop"``, ``"skip-step"`` or ``"continue"`` (``piper_runtime.numerics``)."""

    timeout_s: float = attrs.field(default=DEFAULT_TIMEOUT_S, validator=_positive)
    step_timeout_s: float | None = attrs.field(default=None, validator=_positive)
    setup_timeout_s: float = attrs.field(default=120.0, validator=_positive)
    on_nan: str = "stop"

    def __attrs_post_init__(self) -> None:
        check_on_nan(self.on_nan)

    def worker_timeout(self) -> float:
        """The bound on any single wait inside a rank: twice ``timeout_s`` plus a margin (and
        at least a minute, the join's bound), so the driver's watchdog, which names the
        culprit, fires first."""
        return max(60.0, 2 * self.timeout_s + 10.0)


@attrs.frozen
class ClusterOptions:
    """Where the ranks run. ``runtime``: the implementation that starts them (``ray``: one Ray
    actor per rank; ``local``: every rank a thread of this process; ``torchrun``: this process
    is one rank of a job ``torchrun``/``srun`` launched; others by entry point:
    ``piper_runtime.runtimes``; default: ``$PIPER_RUNTIME``, else ``ray``). ``address``: a Ray cluster to join (``None``: an embedded
    one). ``backend``: a registered backend name or ``None`` to choose. ``placement``:
    ``pack`` or ``spread``; ``ranks_per_gpu`` > 1 shares GPUs; ``cpus_per_rank``: what each
    rank reserves. ``reuse_workers``: take Ray workers from the process's pool (``True``) or
    from a given ``piper_runtime.WorkerPool``, and give them back (``None``: as
    ``PIPER_REUSE_WORKERS`` says). ``prestart_workers``: an embedded cluster started for as many
    ranks as it has CPUs starts their processes with its raylet, their heavy imports done
    (``piper_runtime.driver.prestart``); ``False`` starts them when the ranks are asked for."""

    runtime: str = attrs.field(factory=default_runtime)
    address: str | None = None
    backend: str | None = None
    placement: str = "pack"
    ranks_per_gpu: int = 1
    cpus_per_rank: float = attrs.field(default=1.0, validator=_positive)
    reuse_workers: Any = None  # bool | WorkerPool | None (a pool lives with Ray, not here)
    prestart_workers: bool = True

    def __attrs_post_init__(self) -> None:
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}, got {self.placement!r}")
        if not isinstance(self.ranks_per_gpu, int) or self.ranks_per_gpu < 1:
            raise ValueError(f"ranks_per_gpu must be an integer >= 1, got {self.ranks_per_gpu!r}")


_CONCERNS = {"execution": ExecutionOptions, "faults": FaultOptions, "cluster": ClusterOptions}


@attrs.frozen
class RunOptions:
    """Everything a runtime is started with (module doc). ``seed``: every forward draws its
    random numbers for (seed, segment, microbatch, step, replica), steps counted from 0."""

    execution: ExecutionOptions = ExecutionOptions()
    faults: FaultOptions = FaultOptions()
    # Made per instance: its runtime defaults to ``$PIPER_RUNTIME`` as it is when the options
    # are made, not when this module was imported.
    cluster: ClusterOptions = attrs.field(factory=ClusterOptions)
    seed: int = 0

    @classmethod
    def build(cls, base: RunOptions | None = None, **settings: Any) -> RunOptions:
        """``base`` (default options without it) with flat ``settings`` set on the concern each
        name belongs to; an unknown name raises ``TypeError`` naming it."""
        options = base or cls()
        by_concern: dict[str, dict[str, Any]] = {}
        for name, value in settings.items():
            if name == "seed":
                options = attrs.evolve(options, seed=value)
                continue
            concern = next((c for c, kind in _CONCERNS.items() if name in attrs.fields_dict(kind)), None)
            if concern is None:
                raise TypeError(f"unknown run option {name!r}")
            by_concern.setdefault(concern, {})[name] = value
        changes = {c: attrs.evolve(getattr(options, c), **values) for c, values in by_concern.items()}
        return attrs.evolve(options, **changes)


@attrs.frozen
class RankSetup:
    """What one rank is set up with, from the run's options (``RankWorker.setup``):
    ``execution`` whole; ``wait_s``, the bound on any single wait (joining, a receive, a
    collective, an event: ``FaultOptions.worker_timeout``); ``seed`` for every forward's random
    numbers (``None`` leaves the process's generators as they are: a test backend running
    several ranks in one process without the local runtime's care); ``backup``: keep the state
    from before each step, to undo it (``on_nan="skip-step"``); ``cores``: claim these and bind
    the thread that runs steps to them (empty: every core of the host)."""

    execution: ExecutionOptions = ExecutionOptions()
    wait_s: float = 60.0
    seed: int | None = 0
    backup: bool = False
    cores: tuple[int, ...] = ()
