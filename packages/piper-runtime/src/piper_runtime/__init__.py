"""piper-runtime: runtimes executing a Piper ``Program`` (``runtimes``: Ray actors, threads of one
process, ranks ``torchrun``/``srun`` launched; others by entry point) behind one backend
protocol (``piper_runtime.backends``: CPU with gloo, CUDA with cupy streams and NCCL)."""

# First: Ray reads what keeps an embedded cluster on loopback when it is imported (ray_env).
from piper_runtime.driver import ray_env as ray_env  # isort: skip
from piper_runtime._version import __version__ as __version__
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
