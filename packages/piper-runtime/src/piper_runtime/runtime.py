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

from piper_ir import ExecutionError, NodeKind, Phase, PiperError, Program
from piper_memory.store import BucketLayout, unshard_tensors
from piper_runtime.backends import backend_factory
from piper_runtime.batch import check_batch, replica_slice
from piper_runtime.cluster import WORKER_ENV, ensure_ray
from piper_runtime.optim import OptimizerSpec
from piper_runtime.results import StepOutput, StepResult
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
    sequentially, the same plan on one stream.
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
        actor = ray.remote(RankWorker).options(
            num_cpus=0.01,  # ranks mostly wait on each other; never block on whole CPUs
            num_gpus=self._backend.gpus_per_rank,
            max_restarts=0,
            runtime_env={"env_vars": dict(WORKER_ENV)},
        )
        self._workers = [actor.remote() for _ in range(program.world_size)]
        # Kills the actors on shutdown, garbage collection or interpreter exit, whichever first.
        self._finalizer = weakref.finalize(self, _kill, list(self._workers))
        self._batch_names = {r: _batch_reads(program, r) for r in range(program.world_size)}

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
        batch = check_batch(program, inputs, targets)
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
        return _merge(outputs, program, keep_grads)

    def parameters(self) -> dict[str, torch.Tensor]:
        """Current parameters of every segment, by qualified name, merged over ranks."""
        self._check_open()
        merged: dict[str, torch.Tensor] = {}
        shards: dict[str, dict[int, torch.Tensor]] = {}
        per_rank = self._gather([w.parameters.remote() for w in self._workers], 60.0, "parameters")
        for params in per_rank:
            for name, tensor in params.items():
                merged.setdefault(name, tensor)  # replicas hold equal copies; keep the first
        merged.update(_unshard_tp(self.program, list(enumerate(per_rank))))
        for held in self._gather([w.parameter_shards.remote() for w in self._workers], 60.0, "parameters"):
            for bucket, (replica, shard) in held.items():
                shards.setdefault(bucket, {})[replica] = shard
        # ZeRO-3 parameters live only as shards between steps: reassemble them.
        merged.update(_unshard(self.program, shards))
        return merged

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


def _batch_reads(program: Program, rank: int) -> tuple[str, ...]:
    """The batch values rank ``rank`` reads (only those are shipped to it)."""
    batch = set(program.inputs) | set(program.targets)
    reads: dict[str, None] = {}
    for ins in program.plan(rank).instructions:
        if ins.kind is NodeKind.COMPUTE and ins.phase is Phase.F:
            names = program.segment_by_id[ins.segment].inputs
        elif ins.kind is NodeKind.SEND:
            names = (ins.value,)
        else:
            continue
        for n in names:
            if n in batch:
                reads.setdefault(n, None)
    return tuple(reads)


def _merge(outputs: list[StepOutput], program: Program, keep_grads: bool) -> StepResult:
    per_mb: dict[int, list[float]] = {}
    for out in outputs:
        for mb, loss in out.losses:
            per_mb.setdefault(mb, []).append(loss)
    # The loss of microbatch i is the mean over replicas of their shard losses.
    losses = tuple(sum(per_mb[i]) / len(per_mb[i]) for i in sorted(per_mb))
    if len(losses) != program.microbatches:
        raise ExecutionError(
            f"expected {program.microbatches} microbatch losses, the ranks reported {len(losses)}"
        )
    grads: dict[str, torch.Tensor] | None = None
    if keep_grads:
        grads = {}
        shards: dict[str, dict[int, torch.Tensor]] = {}
        for out in outputs:
            for name, g in (out.grads or {}).items():
                grads.setdefault(name, g)  # all-reduced: every replica holds the same sum
            for bucket, (replica, g) in (out.grad_shards or {}).items():
                shards.setdefault(bucket, {})[replica] = g
        grads.update(_unshard(program, shards))
        grads.update(_unshard_tp(program, [(out.rank, out.grads or {}) for out in outputs]))
    timings = tuple(t for out in outputs for t in out.timings)
    memory = tuple(out.memory for out in outputs if out.memory is not None)
    return StepResult(
        losses,
        sum(losses) / len(losses),
        grads,
        timings,
        tuple(out.seconds for out in outputs),
        memory,
        tuple(out.collective_seconds for out in outputs),
    )


def _unshard(program: Program, shards: Mapping[str, Mapping[int, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Full tensors by parameter name from every replica's shard of each bucket's flat buffer.
    A bucket of one shard position (``Bucket.devices``, data x tensor/expert parallelism)
    holds that position's pieces of the cut parameters: they are put together with the other
    positions' by ``_unshard_tp``."""
    buckets = {b.id: b for b in program.buckets}
    sharding = {s.segment: s for s in program.sharding}
    out: dict[str, torch.Tensor] = {}
    pieces: dict[int, dict[str, torch.Tensor]] = {}  # a rank holding the position -> its pieces
    for bucket_id, per_replica in shards.items():
        bucket = buckets[bucket_id]
        metas = dict(program.segment_by_id[bucket.segment].params)
        sh = sharding.get(bucket.segment) if bucket.devices else None
        if sh is not None:
            metas = {name: sh.local_meta(name, meta) for name, meta in metas.items()}
        layout = BucketLayout.from_metas(bucket, metas)
        flat = layout.assemble(per_replica)
        cut = {spec.name for spec in sh.params} if sh is not None else set()
        for name, view in zip(bucket.params, layout.unflatten(flat), strict=True):
            if name in cut:
                pieces.setdefault(bucket.devices[0], {})[name] = view.clone()
            else:
                out.setdefault(name, view.clone())  # uncut: every position holds the same
    out.update(_unshard_tp(program, list(pieces.items())))
    return out


def _unshard_tp(
    program: Program, per_rank: Sequence[tuple[int, Mapping[str, torch.Tensor]]]
) -> dict[str, torch.Tensor]:
    """Full tensors of tensor-parallel parameters from each rank's shard (``Sharding.params``);
    the ranks at one position of several data-parallel replicas hold equal shards."""
    out: dict[str, torch.Tensor] = {}
    for sh in program.sharding:
        for spec in sh.params:
            pieces = {
                sh.position(rank): held[spec.name]
                for rank, held in per_rank
                if rank in sh.devices and spec.name in held
            }
            if pieces:
                out[spec.name] = unshard_tensors(pieces, spec, sh.degree)
    return out
