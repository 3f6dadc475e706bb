"""``Runtime``: one Ray actor per rank executing a ``Program``, driven from this process.

Failure policy: whatever goes wrong on a worker (an exception, a dead actor, no answer
before the timeout) tears every actor down first, so no rank is left blocked in a receive,
and then raises ``piper_ir.ExecutionError`` naming the ranks (and, for an exception, the
instruction and the worker's traceback).
"""

from __future__ import annotations

import random
import socket
import time
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import ray
import torch
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from torch import nn

from piper_ir import ExecutionError, PiperError, Program
from piper_runtime.backends import backend_factory
from piper_runtime.batch import batch_reads, check_batch, replica_slice
from piper_runtime.cluster import WORKER_ENV, ensure_ray
from piper_runtime.merge import merge_outputs, merge_parameters
from piper_runtime.optim import OptimizerSpec
from piper_runtime.precision import compute_inputs
from piper_runtime.results import StepOutput, StepResult
from piper_runtime.user_code import ship_by_value
from piper_runtime.worker import RankWorker

_LOOPBACK = "127.0.0.1"
_RENDEZVOUS_PORTS_FROM = 20000  # above Ray's worker ports, below the ephemeral range
_INLINE_BYTES = 64 * 1024  # below this, batch tensors go inline with each call


class Runtime:
    """Executes ``program`` on ``program.world_size`` Ray actors.

    ``modules`` maps segment ids to the ``nn.Module`` running each segment (see
    docs/ir-conventions.md, section 6); each rank receives only the modules of the segments
    in its plan. Use as a context manager, or call ``shutdown``; actors are also killed when
    the runtime is garbage collected or the interpreter exits. ``threads`` runs each rank's
    logical streams on threads of their own (the default); ``False`` walks each rank's plan
    sequentially, the same plan on one stream. ``seed``: every forward draws its random numbers
    for (seed, segment, microbatch, step, replica) (``piper_runtime.randomness``), the steps
    counted from 0 by this runtime. ``by_value``: names of imported modules the segment
    modules refer to that a worker cannot import (the user's own code,
    ``CapturedModel.user_modules``): their code travels with the modules
    (``piper_runtime.user_code``).
    """

    def __init__(
        self,
        program: Program,
        modules: Mapping[str, nn.Module],
        optimizer: OptimizerSpec | None = None,
        *,
        address: str | None = None,
        backend: str = "cpu",
        step_timeout_s: float = 120.0,
        setup_timeout_s: float = 120.0,
        threads: bool = True,
        seed: int = 0,
        by_value: Sequence[str] = (),
    ) -> None:
        self.program = program
        self.step_timeout_s = step_timeout_s
        # Built here too, unconnected: it says what a rank needs, and fails before any actor
        # starts where the backend cannot run. Workers get the factory itself, so a backend
        # registered in this process only works too.
        factory = backend_factory(backend)
        self._backend = factory()
        self._workers: list[Any] = []
        self._steps = 0
        needed = {s for plan in program.ranks for s in plan.segments()}
        missing = sorted(needed - set(modules))
        if missing:
            raise ValueError(f"no module given for segments {missing}")
        if len(program.ranks) != program.world_size:
            raise ValueError(
                f"program has {len(program.ranks)} rank plans for world size {program.world_size}"
            )

        ensure_ray(address)
        ship_by_value(by_value)  # before anything is pickled for the workers
        actor = ray.remote(RankWorker).options(
            num_cpus=0.01,  # ranks mostly wait on each other; never block on whole CPUs
            num_gpus=self._backend.gpus_per_rank,
            max_restarts=0,
            runtime_env={"env_vars": dict(WORKER_ENV)},
        )
        self._workers = [actor.remote() for _ in range(program.world_size)]
        # Kills the actors on shutdown, garbage collection or interpreter exit, whichever first.
        self._finalizer = weakref.finalize(self, _kill, list(self._workers))
        self._batch_names = {r: batch_reads(program, r) for r in range(program.world_size)}

        port = _free_port()
        program_ref = ray.put(program)
        calls = [
            w.setup.remote(
                rank,
                program.world_size,
                _LOOPBACK,
                port,
                program_ref,
                {s: modules[s] for s in program.plan(rank).segments()},
                optimizer or OptimizerSpec(),
                factory,
                min(setup_timeout_s, 60.0),
                threads,
                seed,
            )
            for rank, w in enumerate(self._workers)
        ]
        self._gather(calls, setup_timeout_s, "setup")

    # -- public API ---------------------------------------------------------------------------

    def step(
        self,
        inputs: Sequence[torch.Tensor],
        targets: Sequence[torch.Tensor],
        keep_grads: bool = False,
        profile: bool = False,
    ) -> StepResult:
        """Run one training step on a whole batch (split into the program's microbatches).

        ``keep_grads`` returns every parameter's gradient; ``profile`` returns when each
        instruction ran on each rank (``StepResult.timings``)."""
        self._check_open()
        program = self.program
        batch = check_batch(program, compute_inputs(program.precision, inputs), targets)
        # Each rank gets only the batch values it reads, and with data parallelism only its
        # replica's shards of them. Small tensors travel inline with the call (Ray stores
        # large ones in its object store by itself); an explicit ray.put pays off only for a
        # large slice that several ranks read (an object-store round trip on every step).
        slices: dict[tuple[str, int], torch.Tensor] = {}
        readers: dict[tuple[str, int], int] = {}
        for rank, names in self._batch_names.items():
            replica = program.plan(rank).replica
            for n in names:
                key = (n, replica)
                if key not in slices:
                    meta = program.value_by_name[n].meta
                    slices[key] = replica_slice(
                        batch[n], meta, program.microbatches, program.replicas, replica
                    )
                readers[key] = readers.get(key, 0) + 1
        refs = {
            key: ray.put(t) if readers[key] > 1 and t.nbytes > _INLINE_BYTES else t
            for key, t in slices.items()
        }
        self._steps += 1
        calls = [
            w.run_step.remote(
                {n: refs[(n, program.plan(rank).replica)] for n in self._batch_names[rank]},
                keep_grads,
                profile,
            )
            for rank, w in enumerate(self._workers)
        ]
        outputs: list[StepOutput] = self._gather(calls, self.step_timeout_s, "step")
        return merge_outputs(outputs, program, keep_grads)

    def parameters(self) -> dict[str, torch.Tensor]:
        """Current parameters of every segment, by qualified name, merged over ranks."""
        self._check_open()
        per_rank = self._gather([w.parameters.remote() for w in self._workers], 60.0, "parameters")
        shards = self._gather([w.parameter_shards.remote() for w in self._workers], 60.0, "parameters")
        return merge_parameters(self.program, per_rank, shards)

    def shutdown(self) -> None:
        """Stop the workers (leaving the process group first). Safe to call more than once."""
        if not self._finalizer.alive:
            return
        try:
            ray.wait([w.shutdown.remote() for w in self._workers], num_returns=len(self._workers), timeout=10)
        finally:
            self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._workers or not self._finalizer.alive

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- internals ----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self.closed:
            raise ExecutionError("the runtime is shut down (after shutdown() or an earlier failure)")

    def _gather(self, refs: list[Any], timeout_s: float, what: str) -> list[Any]:
        """Results of one call per rank, in rank order; the first failure tears down and raises."""
        pending = {ref: rank for rank, ref in enumerate(refs)}
        results: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        step = self._steps if what == "step" else None
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                ranks = sorted(pending.values())
                self._fail(
                    ExecutionError(
                        f"{what}: ranks {ranks} did not answer within {timeout_s:g} s", ranks=ranks, step=step
                    )
                )
            for ref in ready:
                rank = pending.pop(ref)
                try:
                    results[rank] = ray.get(ref, timeout=10)
                except RayTaskError as exc:
                    cause = exc.cause
                    if isinstance(cause, PiperError):
                        err = ExecutionError(
                            cause.message, ranks=cause.ranks or (rank,), nodes=cause.nodes, step=step
                        )
                    else:
                        err = ExecutionError(
                            f"rank {rank} failed during {what}:\n{exc}", ranks=(rank,), step=step
                        )
                    self._fail(err)
                except RayActorError as exc:
                    self._fail(
                        ExecutionError(f"rank {rank} died during {what}: {exc}", ranks=(rank,), step=step)
                    )
                except GetTimeoutError:
                    self._fail(
                        ExecutionError(f"{what}: rank {rank} did not answer", ranks=(rank,), step=step)
                    )
        return [results[r] for r in range(len(refs))]

    def _fail(self, err: ExecutionError) -> None:
        self._finalizer()  # kill every actor: peers may be blocked in a receive from the culprit
        raise err


def _kill(workers: list[Any]) -> None:
    for w in workers:
        try:
            ray.kill(w, no_restart=True)
        except Exception:  # already dead, or Ray already shut down
            pass


def _free_port() -> int:
    """A free loopback port for the process group's rendezvous. Picked outside the kernel's
    ephemeral range, where every outgoing connection (gloo's pairs, Ray's) takes its local
    port, so nothing can take it between this check and rank 0 listening on it (that race
    failed a setup with EADDRINUSE), and outside Ray's worker ports (10002-19999)."""
    low = _ephemeral_ports()[0]
    for port in random.sample(range(_RENDEZVOUS_PORTS_FROM, low), min(64, max(0, low - _RENDEZVOUS_PORTS_FROM))):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((_LOOPBACK, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # no room below: any free port
        s.bind((_LOOPBACK, 0))
        return s.getsockname()[1]


def _ephemeral_ports() -> tuple[int, int]:
    """The kernel's ephemeral port range (Linux; the usual default elsewhere)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


