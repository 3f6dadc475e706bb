"""piper-runtime: runtimes executing a Piper ``Program`` (``runtimes``: Ray actors, threads of one
process, ranks ``torchrun``/``srun`` launched; others by entry point) behind one backend
protocol (``piper_runtime.backends``: CPU with gloo, CUDA with cupy streams and NCCL).

Its names are imported where they are first used (PEP 562's module ``__getattr__``): starting
the embedded Ray cluster ahead (``prepare_runtime``, which ``piper train`` calls before it
imports torch) imports neither torch nor the rank modules. The ``TYPE_CHECKING`` imports below
are the same names for type checkers; ``_HOMES`` says where each lives (a test holds the two
to each other)."""

# First: Ray reads what keeps an embedded cluster on loopback when it is imported (ray_env).
from piper_runtime.driver import ray_env as ray_env  # isort: skip
import importlib
from typing import TYPE_CHECKING, Any

from piper_runtime._version import __version__ as __version__

if TYPE_CHECKING:
    from piper_runtime.backends import Backend, register_backend, resolve_backend
    from piper_runtime.backends.cpu import shm_enabled as shm_enabled
    from piper_runtime.batch import (
        BatchCut,
        Signature,
        check_batch,
        cut_batch,
        describe_signature,
        loss_divisors,
        piece_sizes,
        program_signature,
        split_microbatches,
        weighted_losses,
    )
    from piper_runtime.batch import full_batch_shape as full_batch_shape
    from piper_runtime.driver.cluster import ensure_ray, shutdown
    from piper_runtime.driver.cluster import worker_env as worker_env
    from piper_runtime.driver.pool import WorkerPool, shared_pool
    from piper_runtime.driver.runtime import DEFAULT_TIMEOUT_S, PendingSave, PendingStep, Runtime, StepRequest
    from piper_runtime.optim import OptimizerSpec
    from piper_runtime.options import MIN_WEIGHT_BYTES as MIN_WEIGHT_BYTES
    from piper_runtime.options import (
        ClusterOptions,
        ExecutionOptions,
        FaultOptions,
        RankSetup,
        RunOptions,
        default_runtime,
    )
    from piper_runtime.rank.memory import CATEGORIES as MEMORY_CATEGORIES
    from piper_runtime.rank.memory import RankMemory
    from piper_runtime.rank.worker import TORCH_THREADS as TORCH_THREADS
    from piper_runtime.rank.worker import RankWorker
    from piper_runtime.results import InstructionTiming, StepOutput, StepResult
    from piper_runtime.runtimes import (
        TrainingRuntime,
        prepare_runtime,
        register_runtime,
        runtime_names,
        start_runtime,
        unregister_runtime,
    )

# The module each public name is imported from (``MEMORY_CATEGORIES`` is ``CATEGORIES`` there).
_HOMES: dict[str, tuple[str, ...]] = {
    "piper_runtime.backends": ("Backend", "register_backend", "resolve_backend"),
    "piper_runtime.backends.cpu": ("shm_enabled",),
    "piper_runtime.batch": (
        "BatchCut", "Signature", "check_batch", "cut_batch", "describe_signature", "loss_divisors", "piece_sizes",
        "program_signature", "split_microbatches", "weighted_losses", "full_batch_shape",
    ),
    "piper_runtime.driver.cluster": ("ensure_ray", "shutdown", "worker_env"),
    "piper_runtime.driver.pool": ("WorkerPool", "shared_pool"),
    "piper_runtime.driver.runtime": ("DEFAULT_TIMEOUT_S", "PendingSave", "PendingStep", "Runtime", "StepRequest"),
    "piper_runtime.optim": ("OptimizerSpec",),
    "piper_runtime.options": (
        "MIN_WEIGHT_BYTES", "ClusterOptions", "ExecutionOptions", "FaultOptions", "RankSetup", "RunOptions",
        "default_runtime",
    ),
    "piper_runtime.rank.memory": ("MEMORY_CATEGORIES", "RankMemory"),
    "piper_runtime.rank.worker": ("TORCH_THREADS", "RankWorker"),
    "piper_runtime.results": ("InstructionTiming", "StepOutput", "StepResult"),
    "piper_runtime.runtimes": (
        "TrainingRuntime", "prepare_runtime", "register_runtime", "runtime_names", "start_runtime",
        "unregister_runtime",
    ),
}
_ALIASES = {"MEMORY_CATEGORIES": "CATEGORIES"}
_MODULE_OF = {name: module for module, names in _HOMES.items() for name in names}


def __getattr__(name: str) -> Any:
    """A public name, imported from its module on first use and kept (module doc)."""
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), _ALIASES.get(name, name))
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_MODULE_OF})


__all__ = [
    "ClusterOptions",
    "ExecutionOptions",
    "FaultOptions",
    "RankSetup",
    "RunOptions",
    "default_runtime",
    "TrainingRuntime",
    "register_runtime",
    "runtime_names",
    "start_runtime",
    "unregister_runtime",
    "DEFAULT_TIMEOUT_S",
    "Backend",
    "InstructionTiming",
    "OptimizerSpec",
    "PendingSave",
    "PendingStep",
    "RankMemory",
    "RankWorker",
    "Runtime",
    "StepOutput",
    "StepRequest",
    "StepResult",
    "WorkerPool",
    "check_batch",
    "BatchCut",
    "Signature",
    "cut_batch",
    "describe_signature",
    "loss_divisors",
    "piece_sizes",
    "program_signature",
    "weighted_losses",
    "ensure_ray",
    "prepare_runtime",
    "register_backend",
    "resolve_backend",
    "shared_pool",
    "shutdown",
    "split_microbatches",
    "MIN_WEIGHT_BYTES",
    "MEMORY_CATEGORIES",
    "TORCH_THREADS",
    "full_batch_shape",
    "shm_enabled",
    "worker_env",
]
