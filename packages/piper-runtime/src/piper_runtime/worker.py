"""The per-rank executor: walks one rank's instruction list, one step at a time.

``RankWorker`` is a plain class; the runtime wraps it with ``ray.remote`` (one actor per
rank). By default each logical stream of its ``RankPlan`` runs on a thread of its own, with
the cross-stream events honoured (``piper_runtime.streams``), so gloo communication proceeds
while compute runs and the two chunks of an overlapped slot run side by side. With
``threads=False`` (or when a collective communicator is shared by two streams) it walks the
list sequentially, where the events are satisfied by construction. Every communicator gets a
process group of its own; the tensor- and expert-parallel collectives inside backward passes
get a second one, so a forward and a backward running concurrently never share a group.
Point-to-point traffic goes through ``torch.distributed``: sends are non-blocking (waited for
at the end of the step), receives are posted ahead and block when their data is needed.

Each segment runs as its own autograd graph: a segment's floating inputs that need
gradients are detached leaves, so its backward stops at its boundary and yields
``grad:<input>`` values that the plan sends or hands to the producing segment.

A split backward runs in two instructions: ``BI`` computes only the gradients of the
segment's inputs (``torch.autograd.grad`` with the autograd graph retained) and ``BW`` then
runs the backward towards the segment's parameters on that retained graph, accumulating into
their ``.grad`` and releasing the graph. No custom autograd function is needed in the model.

Data parallelism and ZeRO (docs/ir-conventions.md, section 7). A replicated segment's
parameters are cut into ``Bucket``s, laid out by ``piper_memory.store.BucketLayout``:

- zero 0: ``ALL_REDUCE`` flattens the bucket's gradients, sums them over the group and copies
  the sum back into ``.grad``; the optimizer steps the module's parameters as usual.
- zero >= 1: at setup each bucket's parameters become views of one flat full buffer, and the
  replica's shard of it becomes an ``nn.Parameter`` (a view of the buffer with zero 1/2, a
  copy with zero 3); the optimizer is built over those shards only (so its state is
  sharded). ``REDUCE_SCATTER`` flattens the full
  gradients, reduce-scatters them and adds the result into the shard's ``.grad`` (the full
  ``.grad`` is dropped). ``ALL_GATHER`` gathers the updated shards straight into the flat
  buffer, i.e. into the module's parameters.
- zero 2/3: each bucket is reduce-scattered during the backward that produces its gradients,
  from parameter hooks (``piper_runtime.buckets.EarlyReduceScatter``); ``REDUCE_SCATTER``
  waits for that reduction and adds it into the gradient shard.
- zero 3: the flat buffer's storage is released (resized to zero bytes) except between a
  ``MATERIALIZE`` (storage back, all-gather into it) and its ``FREE``. Because the module's
  parameters, and any view of them autograd saved, share that one storage, a backward after
  a re-materialization reads the gathered values, and nothing keeps a freed copy alive.

A ``MemoryTracker`` samples what the worker holds after every instruction (see
``piper_runtime.memory``); each step reports the rank's peaks.
"""

from __future__ import annotations

import contextlib
import faulthandler
import inspect
import os
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Iterator, Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from piper_ir import (
    BUCKET_KINDS,
    ExecutionError,
    Instruction,
    NodeKind,
    Phase,
    Program,
    SegmentRole,
    ShardKind,
    grad_name,
    is_grad,
)
from piper_memory.store import accumulate_grad, shard_tensor
from piper_runtime.backend import Backend, resolve_backend
from piper_runtime.batch import split_microbatches
from piper_runtime.buckets import BucketState, EarlyReduceScatter, all_gather_flat, reduce_scatter_flat
from piper_runtime.memory import MemoryTracker
from piper_runtime.optim import OptimizerSpec
from piper_runtime.results import InstructionTiming, StepOutput
from piper_runtime.streams import lanes_share_a_communicator, run_streams

RECV_LOOKAHEAD = 2
SWITCH_INTERVAL_S = 0.0005  # the GIL hand-over interval with threads (Python's default: 5 ms)


def _KEEPS_MODEL_STATE(ins: Instruction) -> bool:  # a predicate table, read like a constant
    """Instructions that never change parameters, gradients or optimizer state."""
    return ins.kind in (NodeKind.SEND, NodeKind.RECV, NodeKind.MARKER) or (
        ins.kind is NodeKind.COMPUTE and ins.phase is Phase.F
    )  # receives posted ahead of the instruction that needs them
Key = tuple[str, int]  # (value name, microbatch)

# Instruction kinds this executor carries out; anything else is rejected at setup.
_SUPPORTED = {
    NodeKind.COMPUTE,
    NodeKind.OPTIMIZER,
    NodeKind.SEND,
    NodeKind.RECV,
    NodeKind.MARKER,
    NodeKind.ALL_REDUCE,
    NodeKind.REDUCE_SCATTER,
    NodeKind.ALL_GATHER,
    NodeKind.MATERIALIZE,
    NodeKind.FREE,
}
_COMPUTE_PHASES = {Phase.F, Phase.B, Phase.BI, Phase.BW}


class _StepState:
    """Everything one step keeps between instructions (dropped when the step ends)."""

    def __init__(self, batch: Mapping[str, tuple[torch.Tensor, ...]], keep_grads: bool) -> None:
        self.batch = batch  # batch value name -> its microbatch chunks
        self.values: dict[Key, torch.Tensor] = {}  # activations and gradients, local or received
        self.saved: dict[Key, tuple[list[torch.Tensor], tuple[torch.Tensor, ...]]] = {}
        # (segment, microbatch) -> (outputs, their gradients) between a BI and its BW; the
        # outputs keep the retained autograd graph alive until BW releases it.
        self.pending_bw: dict[Key, tuple[list[torch.Tensor], list[torch.Tensor] | None]] = {}
        self.losses: dict[int, float] = {}
        self.sends: list[tuple[Any, torch.Tensor]] = []  # (Work, tensor kept alive until waited)
        self.keep_grads = keep_grads
        self.grads: dict[str, torch.Tensor] = {}
        self.posted: dict[str, tuple[Any, torch.Tensor]] = {}  # RECV id -> (Work, buffer)
        self.posted_upto = 0  # how many of the plan's receives are posted
        self.consumed = 0  # how many of them completed
        self.received: set[Key] = set()  # values that arrived by RECV (communication buffers)
        # (segment, microbatch) -> the tensors autograd saved for its backward (for accounting)
        self.autograd_saved: dict[Key, list[weakref.ref]] = {}
        self.grad_shards: dict[str, tuple[int, torch.Tensor]] = {}
        self.lock = threading.RLock()  # shared by the stream threads
        self.reads_left: dict[Key, int] = {}  # value -> instructions still to read it

    def get(self, name: str, mb: int) -> torch.Tensor:
        if name in self.batch:
            return self.batch[name][mb]
        try:
            return self.values[(name, mb)]
        except KeyError:
            raise KeyError(f"value {name!r} of microbatch {mb} is not available on this rank") from None

    def add_grad(self, name: str, mb: int, grad: torch.Tensor) -> None:
        """Gradients may have several contributions (local and received): they are summed."""
        with self.lock:
            prev = self.values.get((name, mb))
            self.values[(name, mb)] = grad if prev is None else prev + grad
            self.received.discard((name, mb))  # a received buffer is no longer what is held


class RankWorker:
    """Executes one rank of a ``Program``; used as a Ray actor by ``Runtime``."""

    def __init__(self) -> None:
        faulthandler.enable(all_threads=True)  # a crash in native code shows every thread
        torch.set_num_threads(1)
        self.rank = -1
        self._modules: dict[str, nn.Module] = {}
        self._optimizers: dict[str, torch.optim.Optimizer] = {}
        self._buckets: dict[str, BucketState] = {}
        self._reducers: dict[str, list[EarlyReduceScatter]] = {}  # segment -> one per group
        self._reducer_of: dict[str, EarlyReduceScatter] = {}  # bucket id -> its reducer
        # Held while parameter gradients are written or read (backward passes, the optimizer,
        # bucket operations, accounting): autograd writes ``.grad`` without the GIL, so no
        # other thread may read or replace one meanwhile. Collectives run outside it.
        self._grads_lock = threading.RLock()
        self._step = 0
        self._st: _StepState | None = None

    def ping(self) -> int:
        return os.getpid()

    def setup(
        self,
        rank: int,
        world_size: int,
        master_addr: str,
        master_port: int,
        program: Program,
        modules: Mapping[str, nn.Module],
        optimizer: OptimizerSpec,
        backend: str = "cpu",
        timeout_s: float = 60.0,
        threads: bool = True,
    ) -> None:
        """Join the process group, keep this rank's segment modules, build the optimizers.
        ``threads``: one thread per stream (else one sequential walk of the plan)."""
        self.rank = rank
        self.timeout_s = timeout_s
        self.program = program
        self.plan = program.plan(rank)
        self.backend: Backend = resolve_backend(backend)
        self.device = self.backend.device()
        for ins in self.plan.instructions:
            if ins.kind not in _SUPPORTED or (
                ins.kind is NodeKind.COMPUTE and ins.phase not in _COMPUTE_PHASES
            ):
                raise ExecutionError(
                    f"rank {rank}, instruction {ins.id} ({ins.short()}): "
                    f"{ins.kind.value} {ins.phase or ''} is not supported by this runtime yet",
                    ranks=(rank,),
                    nodes=(ins.id,),
                )
        mine = self.plan.segments()
        missing = [s for s in mine if s not in modules]
        if missing:
            raise ExecutionError(f"rank {rank}: no module for segments {missing}", ranks=(rank,))
        self._modules = {s: modules[s].to(self.device) for s in mine}
        self._setup_sharding(mine)
        # Expert parameters no bucket on this rank covers (each expert on one rank of its
        # group, no data-parallel replicas of the group) are trained where they live.
        bucketed = {(b.segment, n) for b in program.buckets if not b.devices or rank in b.devices for n in b.params}
        self._expert_params = {
            sh.segment: tuple(spec.name for spec in sh.params if (sh.segment, spec.name) not in bucketed)
            for sh in program.sharding
            if sh.kind is ShardKind.EP
        }
        self._setup_buckets(mine)
        self._optimizers = {}
        for sid in mine:
            if self._zero.get(sid, 0) >= 1:
                # Only this replica's shards are trained here: the optimizer state is sharded.
                params = [b.shard for b in self._buckets.values() if b.bucket.segment == sid]
                module = self._modules[sid]
                params += [module.get_parameter(n) for n in self._expert_params.get(sid, ())]
            else:
                params = [p for p in self._modules[sid].parameters() if p.requires_grad]
            if program.segment_by_id[sid].role is SegmentRole.STAGE and params:
                self._optimizers[sid] = optimizer.build(params)
        self._memory = MemoryTracker(rank)
        self._all_params = [p for m in self._modules.values() for p in m.parameters()]  # for sampling
        for ins in self.plan.instructions:  # before joining the group: fail fast
            if ins.kind in BUCKET_KINDS:
                self._check_bucket_instruction(ins)

        if not dist.is_initialized():
            dist.init_process_group(
                self.backend.dist_backend,
                init_method=f"tcp://{master_addr}:{master_port}",
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=timeout_s),
            )
        # One tag per communicator keeps, e.g., activations and gradients between the same two
        # ranks in separate FIFO channels. Every communicator gets a process group of its own
        # (threads must never issue collectives on one group concurrently), tensor- and
        # expert-parallel ones a second one for the collectives of backward passes, and every
        # zero-2/3 device group one for the early reduce-scatters. Every rank creates all of
        # them in program order, as new_group requires.
        self._tags: dict[str, int] = {}
        self._groups: dict[str, Any] = {}
        self._backward_groups: dict[str, Any] = {}
        for i, comm in enumerate(program.communicators):
            self._tags[comm.id] = i + 1
            self._groups[comm.id] = dist.new_group(sorted(comm.ranks))
            if comm.traffic in tuple(ShardKind):
                self._backward_groups[comm.id] = dist.new_group(sorted(comm.ranks))
        early_groups: dict[tuple[int, ...], Any] = {}
        zero = {rep.segment: rep for rep in program.replication}
        for bucket in program.buckets:
            rep = zero.get(bucket.segment)
            group = bucket.devices or (rep.devices if rep else ())
            if rep is not None and rep.zero >= 2 and len(group) > 1 and group not in early_groups:
                early_groups[group] = dist.new_group(sorted(group))
        self._bind_tensor_parallel(mine)
        self._setup_early_reduce_scatter(early_groups)
        self._reads = _reads_of(program, self.plan.instructions)
        self._read_counts: dict[Key, int] = {}
        for keys in self._reads.values():
            for key in keys:
                self._read_counts[key] = self._read_counts.get(key, 0) + 1
        self.threads = threads and not lanes_share_a_communicator(self.plan.instructions)
        if self.threads:
            # A thread woken by finished communication waits for the GIL at most this long
            # (Python's default is 5 ms, longer than many of our instructions).
            sys.setswitchinterval(SWITCH_INTERVAL_S)
        self._recv_positions = [
            k for k, ins in enumerate(self.plan.instructions) if ins.kind is NodeKind.RECV
        ]
        self._handlers: dict[NodeKind, Callable[[Instruction, _StepState], None]] = {
            NodeKind.COMPUTE: self._compute,
            NodeKind.OPTIMIZER: self._optimize,
            NodeKind.SEND: self._send,
            NodeKind.RECV: self._recv,
            NodeKind.MARKER: lambda ins, st: None,
            NodeKind.ALL_REDUCE: self._all_reduce,
            NodeKind.REDUCE_SCATTER: self._reduce_scatter,
            NodeKind.ALL_GATHER: self._all_gather,
            NodeKind.MATERIALIZE: self._materialize,
            NodeKind.FREE: self._free,
        }

    def _setup_sharding(self, mine: tuple[str, ...]) -> None:
        """Cut the parameters of this rank's tensor-parallel segments to its shard
        (``Sharding.params``, docs/ir-conventions.md, section 8)."""
        for sh in self.program.sharding:
            if sh.segment not in mine:
                continue
            if self.rank not in sh.devices:
                raise ExecutionError(
                    f"rank {self.rank}: segment {sh.segment} is sharded over {list(sh.devices)}, not on this rank",
                    ranks=(self.rank,),
                )
            tp_rank = sh.devices.index(self.rank) % sh.degree
            module = self._modules[sh.segment]
            with torch.no_grad():
                for spec in sh.params:
                    try:
                        p = module.get_parameter(spec.name)
                    except AttributeError:
                        raise ExecutionError(
                            f"rank {self.rank}: sharded parameter {spec.name!r} is not in segment {sh.segment}'s module",
                            ranks=(self.rank,),
                        ) from None
                    p.data = shard_tensor(p.data, spec, sh.degree, tp_rank)

    def _bind_tensor_parallel(self, mine: tuple[str, ...]) -> None:
        """Hand each sharded segment's module the process group of its ``tp`` (or ``ep``)
        communicator: every submodule with a ``bind_communicator`` method gets it."""
        for sh in self.program.sharding:
            if sh.segment not in mine or not sh.collectives:
                continue
            group = sh.group_of(self.rank)  # this rank's shard group (data x tensor: one of several)
            comm = next(
                (c for c in self.program.communicators if c.traffic == sh.kind and tuple(c.ranks) == group),
                None,
            )
            if comm is None:
                raise ExecutionError(
                    f"rank {self.rank}: no {sh.kind} communicator over {list(group)} for segment {sh.segment}",
                    ranks=(self.rank,),
                )
            bound = 0
            for m in self._modules[sh.segment].modules():
                bind = getattr(m, "bind_communicator", None)
                if callable(bind):
                    if "backward_group" in inspect.signature(bind).parameters:
                        bind(self._groups[comm.id], backward_group=self._backward_groups[comm.id])
                    else:
                        bind(self._groups[comm.id])
                    bound += 1
            if not bound:
                raise ExecutionError(
                    f"rank {self.rank}: segment {sh.segment} issues {sh.collectives} tensor-parallel collectives "
                    "but its module has nothing to bind the communicator to",
                    ranks=(self.rank,),
                )

    def _setup_buckets(self, mine: tuple[str, ...]) -> None:
        """The bucket states of this rank's replicated segments (see the module docstring)."""
        program, rank = self.program, self.rank
        replication = {r.segment: r for r in program.replication}
        self._zero: dict[str, int] = {}
        self._buckets = {}
        self._mirror_of: dict[str, str] = {}  # a mirror's bucket id -> the one this rank holds
        for sid in mine:
            rep = replication.get(sid)
            if rep is None or len(rep.devices) < 2:
                continue
            if rank not in rep.devices:
                raise ExecutionError(
                    f"rank {rank}: segment {sid} is replicated over {list(rep.devices)}, not on this rank",
                    ranks=(rank,),
                )
            self._zero[sid] = rep.zero
            named = dict(self._modules[sid].named_parameters())
            # Expert-parallel parameters live on one rank each: no bucket, no reduction.
            covered: set[str] = set(self._expert_params.get(sid, ()))
            for bucket in program.buckets:
                # A bucket of one shard position lives on the ranks holding that shard.
                group = bucket.devices or rep.devices
                if bucket.segment != sid or rank not in group:
                    continue
                missing = [n for n in bucket.params if n not in named]
                if missing:
                    raise ExecutionError(
                        f"rank {rank}: bucket {bucket.id} names parameters {missing} that segment {sid}'s "
                        "module does not have",
                        ranks=(rank,),
                    )
                if rep.zero >= 1 and bucket.shards != len(group):
                    raise ExecutionError(
                        f"rank {rank}: bucket {bucket.id} has {bucket.shards} shards, segment {sid} "
                        f"(zero={rep.zero}) has {len(group)} replicas",
                        ranks=(rank,),
                    )
                covered.update(bucket.params)
                self._mirror_of.update((m, bucket.id) for m in bucket.mirrors)
                self._buckets[bucket.id] = BucketState(
                    bucket, [named[n] for n in bucket.params], rep.zero, group.index(rank)
                )
            uncovered = [n for n, p in named.items() if p.requires_grad and n not in covered]
            if uncovered:
                raise ExecutionError(
                    f"rank {rank}: parameters {uncovered} of replicated segment {sid} are in no bucket",
                    ranks=(rank,),
                )

    def _setup_early_reduce_scatter(self, groups: Mapping[tuple[int, ...], Any]) -> None:
        """Zero 2/3: reduce-scatter each bucket from gradient hooks during the backward."""
        self._reducers, self._reducer_of = {}, {}
        devices = {rep.segment: rep.devices for rep in self.program.replication}
        by_group: dict[tuple[str, tuple[int, ...]], list[BucketState]] = {}
        for b in self._buckets.values():
            group = b.bucket.devices or devices[b.bucket.segment]
            if group in groups:
                by_group.setdefault((b.bucket.segment, group), []).append(b)
        for (segment, group), buckets in by_group.items():
            reducer = EarlyReduceScatter(buckets, groups[group], threading.RLock(), self._sample_buffers)
            self._reducers.setdefault(segment, []).append(reducer)
            self._reducer_of.update((b.bucket.id, reducer) for b in buckets)

    def _sample_buffers(self, buffers: list[torch.Tensor]) -> None:
        if self._st is not None:
            self._sample(self._st, *buffers)

    def _check_bucket_instruction(self, ins: Instruction) -> None:
        where = f"rank {self.rank}, instruction {ins.id} ({ins.kind.value})"
        b = self._bucket(ins)
        if b is None:
            raise ExecutionError(
                f"{where}: {ins.value!r} is not a bucket of a replicated segment on this rank",
                ranks=(self.rank,),
                nodes=(ins.id,),
            )
        if ins.kind is not NodeKind.FREE and ins.communicator not in {
            c.id for c in self.program.communicators
        }:
            raise ExecutionError(
                f"{where}: unknown communicator {ins.communicator!r}", ranks=(self.rank,), nodes=(ins.id,)
            )
        needs = {
            # Zero >= 1: only a mirrored bucket's gradient shard is all-reduced (over the
            # ranks holding its shard range in every microbatch group).
            NodeKind.ALL_REDUCE: b.zero == 0 or bool(b.bucket.mirrors),
            NodeKind.REDUCE_SCATTER: b.zero >= 1,
            NodeKind.ALL_GATHER: b.zero in (1, 2),
            NodeKind.MATERIALIZE: b.zero == 3,
            NodeKind.FREE: b.zero == 3,
        }[ins.kind]
        if not needs:
            raise ExecutionError(
                f"{where}: {ins.kind.value} does not apply to {ins.value} of a zero={b.zero} segment",
                ranks=(self.rank,),
                nodes=(ins.id,),
            )

    # -- one step -----------------------------------------------------------------------------

    def run_step(
        self, batch: Mapping[str, Any], keep_grads: bool = False, profile: bool = False
    ) -> StepOutput:
        """Run this rank's instructions once. ``batch`` maps the batch values this rank reads
        to whole-batch tensors (or Ray object refs to them); ``profile`` records when each
        instruction started and ended."""
        self._step += 1
        started = time.perf_counter()
        timings: list[InstructionTiming] = []
        chunks = {
            name: split_microbatches(
                _resolve(t).to(self.device),
                self.program.value_by_name[name].meta,
                self.program.microbatches,
            )
            for name, t in batch.items()
        }
        st = _StepState(chunks, keep_grads)
        st.reads_left = dict(self._read_counts)
        self._st = st
        self._memory.reset(excluded=[t for ts in chunks.values() for t in ts])
        self._sample(st)

        def execute(k: int, ins: Instruction) -> None:
            t0 = time.perf_counter() if profile else 0.0
            try:
                self._post_recvs(k, st)
                self._handlers[ins.kind](ins, st)
            except Exception as exc:
                raise self._error(f"instruction {ins.id} ({ins.short()})", exc, ins.id) from None
            if profile:
                timings.append(InstructionTiming(self.rank, ins.id, t0 - started, time.perf_counter() - started))
            self._release_reads(k, st)
            # Model state (parameters, gradients, optimizer state) changes only in backward,
            # optimizer and bucket instructions: forwards and transfers reuse its last count.
            self._sample(st, model_state=not _KEEPS_MODEL_STATE(ins))

        try:
            if self.threads:
                run_streams(self.plan.instructions, execute, timeout_s=self.timeout_s)
            else:
                for k, ins in enumerate(self.plan.instructions):
                    execute(k, ins)
        except BaseException:
            # Keep posted receives and unfinished sends referenced: destroying pending gloo
            # work could take the process down before the error reaches the driver (which
            # tears every rank down anyway).
            self._abandoned = st
            raise
        finally:
            self._st = None
        try:
            for work, _tensor in st.sends:
                work.wait()
        except Exception as exc:
            raise self._error("waiting for its sends to complete", exc) from None
        return StepOutput(
            self.rank,
            tuple(sorted(st.losses.items())),
            st.grads if keep_grads else None,
            tuple(sorted(timings, key=lambda t: t.start)),
            time.perf_counter() - started,
            st.grad_shards if keep_grads else None,
            self._memory.result(),
            self._collective_seconds(),
        )

    def _collective_seconds(self) -> float:
        """Seconds this step spent in collectives issued inside compute (modules that keep
        ``collective_times``, as the tensor- and expert-parallel rewrites do); resets them."""
        total = 0.0
        for module in self._modules.values():
            for m in module.modules():
                times = getattr(m, "collective_times", None)
                if isinstance(times, list):
                    total += sum(times)
                    times.clear()
        return total

    def _release_reads(self, k: int, st: _StepState) -> None:
        """Forget the values instruction ``k`` was the last to read."""
        with st.lock:
            for key in self._reads.get(k, ()):
                left = st.reads_left[key] - 1
                st.reads_left[key] = left
                if left == 0:
                    st.values.pop(key, None)
                    st.received.discard(key)

    def _error(self, where: str, exc: BaseException, node: str | None = None) -> ExecutionError:
        tb = "".join(traceback.format_exception(exc))
        return ExecutionError(
            f"rank {self.rank}, {where}: {type(exc).__name__}: {exc}\n{tb}",
            ranks=(self.rank,),
            nodes=(node,) if node else (),
            step=self._step,
        )

    def _compute(self, ins: Instruction, st: _StepState) -> None:
        if ins.phase is Phase.F:
            self._forward(ins, st)
            return
        run = {Phase.B: self._backward, Phase.BI: self._backward_input, Phase.BW: self._backward_weight}[ins.phase]
        with self._grads_lock:
            run(ins, st)

    def _forward(self, ins: Instruction, st: _StepState) -> None:
        seg = self.program.segment_by_id[ins.segment]
        mb = ins.microbatch
        args = []
        for name in seg.inputs:
            t = st.get(name, mb)
            if t.is_floating_point() and self.program.value_by_name[name].meta.requires_grad:
                t = t.detach().requires_grad_(True)
            args.append(t)
        saved: list[weakref.ref] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            # A detached alias (not ``t`` itself: saving an op's own output would make a
            # reference cycle through its grad_fn); it shares the storage being counted.
            d = t.detach()
            saved.append(weakref.ref(d))  # autograd holds ``d``; a weak reference never extends it
            return d

        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = self._modules[seg.id](*args)
        st.autograd_saved[(seg.id, mb)] = saved
        if seg.role is SegmentRole.LOSS:
            if not isinstance(out, torch.Tensor) or out.numel() != 1:
                raise TypeError(f"the loss module must return a scalar tensor, got {_describe(out)}")
            st.losses[mb] = float(out.detach())
            # The loss of one shard of a microbatch is scaled by 1/(M * N) for backward here,
            # exactly once (M microbatches, N data-parallel replicas).
            outs: tuple[torch.Tensor, ...] = (out / (self.program.microbatches * self.program.replicas),)
            for name in seg.outputs:
                # A copy: the loss may share a larger buffer, and nothing may ever read it.
                st.values[(name, mb)] = out.detach().clone()
        else:
            outs = (out,) if isinstance(out, torch.Tensor) else tuple(out)
            if len(outs) != len(seg.outputs):
                raise TypeError(
                    f"segment {seg.id} must return {len(seg.outputs)} tensors {list(seg.outputs)}, "
                    f"got {_describe(out)}"
                )
            for name, o in zip(seg.outputs, outs, strict=True):
                st.values[(name, mb)] = o.detach()
        st.saved[(seg.id, mb)] = (args, outs)

    def _backward_roots(
        self, ins: Instruction, st: _StepState
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor] | None]:
        """The saved inputs of ``ins``'s segment and microbatch, the outputs to differentiate
        and their gradients (``None`` for the loss, whose own gradient is 1)."""
        seg = self.program.segment_by_id[ins.segment]
        mb = ins.microbatch
        try:
            args, outs = st.saved.pop((seg.id, mb))
        except KeyError:
            raise RuntimeError(f"backward of {seg.id} microbatch {mb} before its forward") from None
        if seg.role is SegmentRole.LOSS:
            return args, list(outs), None
        tensors, grads = [], []
        for name, o in zip(seg.outputs, outs, strict=True):
            g = st.values.get((grad_name(name), mb))
            if o.requires_grad and g is not None:
                tensors.append(o)
                grads.append(g)
        if not tensors and any(o.requires_grad for o in outs):
            raise RuntimeError(f"no gradient is available for any output of {seg.id} {list(seg.outputs)}")
        return args, tensors, grads

    def _backward(self, ins: Instruction, st: _StepState) -> None:
        seg = self.program.segment_by_id[ins.segment]
        mb = ins.microbatch
        args, tensors, grads = self._backward_roots(ins, st)
        if tensors:
            with self._reducing(seg.id):
                torch.autograd.backward(tensors, grads)
        st.autograd_saved.pop((seg.id, mb), None)
        for name, a in zip(seg.inputs, args, strict=True):
            if a.requires_grad:
                g = a.grad if a.grad is not None else torch.zeros_like(a)
                st.add_grad(grad_name(name), mb, g)

    def _backward_input(self, ins: Instruction, st: _StepState) -> None:
        """BI: gradients of the segment's inputs only; the autograd graph is kept for BW."""
        seg = self.program.segment_by_id[ins.segment]
        mb = ins.microbatch
        args, tensors, grads = self._backward_roots(ins, st)
        wanted = [(name, a) for name, a in zip(seg.inputs, args, strict=True) if a.requires_grad]
        found: tuple[torch.Tensor | None, ...] = (None,) * len(wanted)
        if tensors and wanted:
            found = torch.autograd.grad(
                tensors, [a for _, a in wanted], grads, retain_graph=True, allow_unused=True
            )
        for (name, a), g in zip(wanted, found, strict=True):
            st.add_grad(grad_name(name), mb, g if g is not None else torch.zeros_like(a))
        st.pending_bw[(seg.id, mb)] = (tensors, grads)

    def _backward_weight(self, ins: Instruction, st: _StepState) -> None:
        """BW: the parameter gradients from the graph BI retained, accumulated into ``.grad``;
        the graph (and the activations it saved) is released afterwards."""
        key = (ins.segment, ins.microbatch)
        try:
            tensors, grads = st.pending_bw.pop(key)
        except KeyError:
            raise RuntimeError(
                f"weight backward of {ins.segment} microbatch {ins.microbatch} before its input backward"
            ) from None
        params = [p for p in self._modules[ins.segment].parameters() if p.requires_grad]
        if tensors and params:
            # ``inputs=params`` restricts the pass to what the weight gradients need; without
            # retain_graph the saved tensors are freed as the pass goes.
            with self._reducing(ins.segment):
                torch.autograd.backward(tensors, grads, inputs=params)
        st.autograd_saved.pop(key, None)

    @contextlib.contextmanager
    def _reducing(self, segment: str) -> Iterator[None]:
        """Around a weight-gradient pass: a zero-2/3 segment's buckets are reduce-scattered
        as their gradients complete, and whatever is left when the pass ends."""
        reducers = self._reducers.get(segment, ())
        for reducer in reducers:
            reducer.begin()
        try:
            yield
        finally:
            for reducer in reducers:
                reducer.finish()

    def _optimize(self, ins: Instruction, st: _StepState) -> None:
        with self._grads_lock:
            self._step_optimizer(ins, st)

    def _step_optimizer(self, ins: Instruction, st: _StepState) -> None:
        opt = self._optimizers.get(ins.segment)
        if opt is None:
            return
        if st.keep_grads:
            if self._zero.get(ins.segment, 0) >= 1:
                for b in self._segment_buckets(ins.segment):
                    g = b.shard.grad
                    g = torch.zeros_like(b.shard) if g is None else g
                    st.grad_shards[b.bucket.id] = (b.replica, g.detach().to("cpu", copy=True))
                module = self._modules[ins.segment]
                for qname in self._expert_params.get(ins.segment, ()):
                    g = module.get_parameter(qname).grad
                    if g is not None:
                        st.grads[qname] = g.detach().to("cpu", copy=True)
            else:
                for qname, p in self._modules[ins.segment].named_parameters():
                    if p.grad is not None:
                        st.grads[qname] = p.grad.detach().to("cpu", copy=True)
        opt.step()
        opt.zero_grad(set_to_none=True)

    # -- data-parallel buckets ------------------------------------------------------------------

    def _segment_buckets(self, segment: str) -> list[BucketState]:
        return [b for b in self._buckets.values() if b.bucket.segment == segment]

    def _bucket(self, ins: Instruction) -> BucketState | None:
        """The bucket ``ins`` names, or the mirror of it this rank holds (``Bucket.mirrors``)."""
        return self._buckets.get(ins.value) or self._buckets.get(self._mirror_of.get(ins.value, ""))

    def _all_reduce(self, ins: Instruction, st: _StepState) -> None:
        """Zero 0: sum the bucket's gradients over the group, in place of the local ones.
        Zero >= 1 (a mirrored bucket): sum the gradient shard, in place."""
        b = self._bucket(ins)
        if b.zero >= 1:
            with self._grads_lock:
                if b.shard.grad is None:
                    b.shard.grad = torch.zeros_like(b.shard)
                grad = b.shard.grad
            dist.all_reduce(grad, group=self._groups[ins.communicator])
            return
        with self._grads_lock:
            flat = b.layout.flatten([p.grad for p in b.params])
            self._sample(st, flat)
        dist.all_reduce(flat, group=self._groups[ins.communicator])
        with self._grads_lock:
            for p, g in zip(b.params, b.layout.unflatten(flat), strict=True):
                if p.grad is None:
                    p.grad = g.clone()
                else:
                    p.grad.copy_(g)

    def _reduce_scatter(self, ins: Instruction, st: _StepState) -> None:
        """Zero >= 1: reduce the full gradients, add this replica's shard into the gradient
        shard and drop the full gradients (ZeRO-2/3 keep only shards between microbatches).
        With zero 2/3 the backward already started the reduction: wait for it."""
        b = self._buckets[ins.value]
        reducer = self._reducer_of.get(b.bucket.id)
        if reducer is not None:
            reducer.wait(b.bucket.id)
            return
        with self._grads_lock:
            flat, shard = b.take_gradients(sample=lambda flat, shard: self._sample(st, flat, shard))
        reduce_scatter_flat(shard, flat, group=self._groups[ins.communicator])
        accumulate_grad(b.shard, shard)

    def _all_gather(self, ins: Instruction, st: _StepState) -> None:
        """Zero 1/2 after the step: the updated shards, gathered into the full parameters."""
        b = self._buckets[ins.value]
        # The shard is a view of the output buffer: gather from a copy of it.
        shard = b.shard.detach().clone()
        self._sample(st, shard)
        all_gather_flat(b.flat, shard, group=self._groups[ins.communicator])

    def _materialize(self, ins: Instruction, st: _StepState) -> None:
        """Zero 3: gather the bucket's parameters for a chain of uses."""
        b = self._buckets[ins.value]
        b.allocate()
        all_gather_flat(b.flat, b.shard.detach(), group=self._groups[ins.communicator])

    def _free(self, ins: Instruction, st: _StepState) -> None:
        """Zero 3: drop the gathered parameters (the shard stays)."""
        self._buckets[ins.value].release()

    # -- memory accounting ----------------------------------------------------------------------

    def _sample(self, st: _StepState, *buffers: torch.Tensor, model_state: bool = True) -> None:
        """Record what this rank holds now; ``buffers`` are a collective's live buffers.
        With ``model_state=False`` the parameters, gradients and optimizer state counted at
        the previous sample are taken as unchanged."""
        with self._grads_lock if model_state else contextlib.nullcontext(), st.lock:
            held: dict[str, list] = {}
            if model_state:
                gathered = {id(p) for b in self._buckets.values() if b.zero == 3 for p in b.params}
                params = [p for p in self._all_params if id(p) not in gathered]
                shards = [b.shard for b in self._buckets.values() if b.shard is not None]
                grads = [p.grad for p in self._all_params]
                grads += [s.grad for s in shards]
                held["parameters"] = params + shards
                held["gradients"] = grads
                held["optimizer_state"] = [
                    t
                    for opt in self._optimizers.values()
                    for per_param in list(opt.state.values())
                    for t in list(per_param.values())
                    if isinstance(t, torch.Tensor)
                ]
            # Other threads change these dicts: ``list(...)`` copies each one atomically.
            comm = [b.flat for b in self._buckets.values() if b.zero == 3]
            comm += [t for _work, t in list(st.posted.values())] + [t for _work, t in list(st.sends)]
            values = list(st.values.items())
            received = set(st.received)
            comm += [t for k, t in values if k in received]
            comm += buffers
            acts = [t for refs in list(st.autograd_saved.values()) for r in refs if (t := r()) is not None]
            for args, outs in list(st.saved.values()):
                acts += args
                acts += outs
            for outs, grads_ in list(st.pending_bw.values()):
                acts += outs
                acts += grads_ or []
            acts += [t for k, t in values if k not in received]
            held["communication"] = comm
            held["activations"] = acts
            self._memory.sample(held, model_state=model_state)

    def _send(self, ins: Instruction, st: _StepState) -> None:
        t = st.get(ins.value, ins.microbatch).detach().contiguous()
        if ins.meta is not None and tuple(t.shape) != tuple(ins.meta.shape):
            raise ValueError(f"{ins.value} has shape {tuple(t.shape)}, the plan sends {ins.meta.shape}")
        work = dist.isend(
            t, dst=ins.peer, group=self._groups[ins.communicator], tag=self._tags[ins.communicator]
        )
        st.sends.append((work, t))

    def _post_recvs(self, position: int, st: _StepState) -> None:
        """Post the receives of the next ``RECV_LOOKAHEAD`` RECV instructions from ``position``
        on, so data is already moving when the compute that needs it comes up. Receives from
        one peer on one communicator are posted in plan order, which the verifier proved is
        the order the peer sends in."""
        recvs = self._recv_positions
        with st.lock:
            self._post_recvs_locked(position, st, recvs)

    def _post_recvs_locked(self, position: int, st: _StepState, recvs: list[int]) -> None:
        while st.posted_upto < len(recvs) and (
            st.posted_upto < st.consumed + RECV_LOOKAHEAD or recvs[st.posted_upto] <= position
        ):
            ins = self.plan.instructions[recvs[st.posted_upto]]
            meta = ins.meta
            t = torch.empty(meta.shape, dtype=getattr(torch, meta.dtype), device=self.device)
            work = dist.irecv(
                t, src=ins.peer, group=self._groups[ins.communicator], tag=self._tags[ins.communicator]
            )
            st.posted[ins.id] = (work, t)
            st.posted_upto += 1

    def _recv(self, ins: Instruction, st: _StepState) -> None:
        work, t = st.posted.pop(ins.id)
        work.wait()
        key = (ins.value, ins.microbatch)
        with st.lock:
            st.consumed += 1
            if is_grad(ins.value):
                st.add_grad(ins.value, ins.microbatch, t)
                if st.values[key] is t:
                    st.received.add(key)
            else:
                st.values[key] = t
                st.received.add(key)

    # -- state --------------------------------------------------------------------------------

    def parameters(self) -> dict[str, torch.Tensor]:
        """This rank's current full parameters by qualified name (CPU copies); ZeRO-3
        parameters, which live only as shards between steps, are in ``parameter_shards``."""
        sharded = {id(p) for b in self._buckets.values() if b.zero == 3 for p in b.params}
        return {
            qname: p.detach().to("cpu", copy=True)
            for module in self._modules.values()
            for qname, p in module.named_parameters()
            if id(p) not in sharded
        }

    def parameter_shards(self) -> dict[str, tuple[int, torch.Tensor]]:
        """``bucket id -> (replica, this replica's parameter shard)`` of the ZeRO-3 buckets."""
        return {
            bid: (b.replica, b.shard.detach().to("cpu", copy=True))
            for bid, b in self._buckets.items()
            if b.zero == 3
        }

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def _reads_of(program: Program, instructions: tuple[Instruction, ...]) -> dict[int, list[Key]]:
    """Instruction index -> the (value, microbatch) entries it reads; a value is dropped once
    every instruction that reads it has run (in whatever order the stream threads run them)."""
    reads_at: dict[int, list[Key]] = {}
    for k, ins in enumerate(instructions):
        mb = ins.microbatch
        if ins.kind is NodeKind.COMPUTE and ins.phase is Phase.F:
            seg = program.segment_by_id[ins.segment]
            reads = [n for n in seg.inputs if n not in program.inputs and n not in program.targets]
        elif ins.kind is NodeKind.COMPUTE and ins.phase is not Phase.BW:
            # BW reads the output gradients that its BI kept with the retained graph.
            reads = [grad_name(n) for n in program.segment_by_id[ins.segment].outputs]
        elif ins.kind is NodeKind.SEND:
            reads = [ins.value]
        else:
            reads = []
        if reads:
            reads_at[k] = [(name, mb) for name in reads]
    return reads_at


def _resolve(value: Any) -> torch.Tensor:
    """A tensor, fetching it from the Ray object store when given a reference."""
    if isinstance(value, torch.Tensor):
        return value
    import ray  # only when running under Ray

    return ray.get(value, timeout=300)


def _describe(out: object) -> str:
    if isinstance(out, torch.Tensor):
        return f"a tensor of shape {tuple(out.shape)}"
    return type(out).__name__
