"""The bucket instructions of replicated segments on one rank (docs/ir-conventions.md, section 7).

``DataParallel`` sets up a ``BucketState`` for every bucket of this rank's replicated
segments, checks the plan's bucket instructions against where each bucket's state lives
(``Bucket.params_home``/``grads_home``/``optimizer_home``), and carries them out:

- ``ALL_REDUCE``: optimizer state full: flatten the bucket's gradients, sum them over the
  communicator, copy the sum back into ``.grad``. Optimizer state sharded (a mirrored bucket,
  ``Bucket.mirrors``): sum the gradient shard in place (a rank that does not hold ``value``
  uses the mirror it holds);
- ``REDUCE_SCATTER``: flatten the full gradients, reduce-scatter them and add the result into
  the gradient shard (the full ``.grad`` is dropped). Gradients sharded: the backward already
  started the reduction from gradient hooks (``EarlyReduceScatter``, on its own
  communicator): wait for it;
- ``ALL_GATHER``: gather the updated shards straight into the flat buffer, i.e. into the
  module's parameters;
- ``MATERIALIZE`` / ``FREE``: parameters sharded: give the flat buffer its storage back and
  gather into it / release it.

It also says what the optimizer of a segment steps (``optimizer_params``) and which
gradients a step reports (``report_grads``). Gradients are read or replaced only under the
rank's gradient lock; collectives run outside it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping

import torch
from torch import nn

from piper_ir import ExecutionError, Instruction, NodeKind, Program, Residency
from piper_memory.store import accumulate_grad
from piper_runtime.rank.buckets import BucketState, EarlyReduceScatter, bucket_group
from piper_runtime.rank.comms import Communicators
from piper_runtime.rank.state import StepState

Sample = Callable[..., None]  # (step state, *live buffers) -> None: a memory sample


class DataParallel:
    """This rank's buckets and the instructions on them (module doc)."""

    def __init__(
        self,
        program: Program,
        rank: int,
        modules: Mapping[str, nn.Module],
        experts: Mapping[str, tuple[str, ...]],
        grads_lock: threading.RLock,
    ) -> None:
        self.program = program
        self.rank = rank
        self.modules = modules
        self.experts = experts  # segment -> expert parameters no bucket covers (``sharding``)
        self.grads_lock = grads_lock
        self.buckets: dict[str, BucketState] = {}
        self.mirror_of: dict[str, str] = {}  # a mirror's bucket id -> the one this rank holds
        self._setup_buckets()
        self._reducers: dict[str, list[EarlyReduceScatter]] = {}  # segment -> one per group
        self._reducer_of: dict[str, EarlyReduceScatter] = {}  # bucket id -> its reducer
        self.comms: Communicators | None = None
        self.sample: Sample = lambda st, *buffers: None
        # Parameters whose memory is the flat buffer of a bucket with sharded parameters:
        # communication buffers while gathered, counted through their shard otherwise.
        self.gathered_ids = {id(p) for b in self.buckets.values() if b.params_sharded for p in b.params}
        # Parameters whose gradients live sharded: hooks reduce them as autograd accumulates them.
        self.sharded_grad_ids = {id(p) for b in self.buckets.values() if b.grads_sharded for p in b.params}

    def _setup_buckets(self) -> None:
        program, rank = self.program, self.rank
        for bucket in program.buckets:
            module = self.modules.get(bucket.segment)
            # A bucket of one shard position (or of a tied parameter) lives on its ranks.
            group = bucket_group(program, bucket)
            if module is None or rank not in group:
                continue
            named = dict(module.named_parameters())
            missing = [n for n in bucket.params if n not in named]
            if missing:
                raise ExecutionError(
                    f"rank {rank}: bucket {bucket.id} names parameters {missing} that segment {bucket.segment}'s "
                    "module does not have",
                    ranks=(rank,),
                )
            if bucket.optimizer_home is Residency.SHARDED and bucket.shards != len(group):
                raise ExecutionError(
                    f"rank {rank}: bucket {bucket.id} has {bucket.shards} shards, segment {bucket.segment} "
                    f"(optimizer state sharded) has {len(group)} replicas",
                    ranks=(rank,),
                )
            self.mirror_of.update((m, bucket.id) for m in bucket.mirrors)
            self.buckets[bucket.id] = BucketState(bucket, [named[n] for n in bucket.params], group.index(rank))
        # Who steps each parameter: the segment of its bucket, else the first segment (in
        # program order) holding it; a tied parameter's holders on one rank share one tensor.
        self.owner: dict[int, str] = {}
        for b in self.buckets.values():
            for p in b.params:
                self.owner.setdefault(id(p), b.bucket.segment)
        order = [s.id for s in program.segments if s.id in self.modules]
        for sid in order:
            for p in self.modules[sid].parameters():
                self.owner.setdefault(id(p), sid)
        holders: dict[int, int] = {}
        for sid in order:
            for p in self.modules[sid].parameters():
                holders[id(p)] = holders.get(id(p), 0) + 1
        self.shared = {pid for pid, n in holders.items() if n > 1}  # written by several segments' passes
        bucketed = {id(p) for b in self.buckets.values() for p in b.params}
        replication = {r.segment: r for r in program.replication}
        for sid, module in self.modules.items():
            rep = replication.get(sid)
            if rep is None or len(rep.devices) < 2:
                continue
            if rank not in rep.devices:
                raise ExecutionError(
                    f"rank {rank}: segment {sid} is replicated over {list(rep.devices)}, not on this rank",
                    ranks=(rank,),
                )
            # Expert-parallel parameters live on one rank each: no bucket, no reduction.
            experts = set(self.experts.get(sid, ()))
            uncovered = [
                n for n, p in module.named_parameters() if p.requires_grad and n not in experts and id(p) not in bucketed
            ]
            if uncovered:
                raise ExecutionError(
                    f"rank {rank}: parameters {uncovered} of replicated segment {sid} are in no bucket",
                    ranks=(rank,),
                )

    # -- setup ---------------------------------------------------------------------------------

    def check(self, ins: Instruction) -> None:
        """``ExecutionError`` unless ``ins`` names a bucket on this rank, a known
        communicator, and an operation that the bucket's residency calls for."""
        where = f"rank {self.rank}, instruction {ins.id} ({ins.kind.value})"
        b = self.bucket(ins)
        if b is None:
            raise ExecutionError(
                f"{where}: {ins.value!r} is not a bucket of a replicated segment on this rank",
                ranks=(self.rank,),
                nodes=(ins.id,),
            )
        if ins.kind is not NodeKind.FREE and ins.communicator not in {c.id for c in self.program.communicators}:
            raise ExecutionError(
                f"{where}: unknown communicator {ins.communicator!r}", ranks=(self.rank,), nodes=(ins.id,)
            )
        applies = {
            # Optimizer state sharded: only a mirrored bucket's gradient shard is all-reduced
            # (over the ranks holding its shard range in every microbatch group).
            NodeKind.ALL_REDUCE: not b.optimizer_sharded or bool(b.bucket.mirrors),
            NodeKind.REDUCE_SCATTER: b.optimizer_sharded,
            NodeKind.ALL_GATHER: b.optimizer_sharded and not b.params_sharded,
            NodeKind.MATERIALIZE: b.params_sharded,
            NodeKind.FREE: b.params_sharded,
        }[ins.kind]
        if not applies:
            bucket = b.bucket
            raise ExecutionError(
                f"{where}: {ins.kind.value} does not apply to {ins.value} (parameters {bucket.params_home}, "
                f"gradients {bucket.grads_home}, optimizer state {bucket.optimizer_home})",
                ranks=(self.rank,),
                nodes=(ins.id,),
            )

    def connect(
        self, comms: Communicators, sample: Sample, sample_now: Callable[[list[torch.Tensor]], None]
    ) -> None:
        """Use ``comms``; ``sample(st, *buffers)`` records memory while a collective's buffers
        are alive, ``sample_now(buffers)`` the same in the current step (from hooks). Sets up
        the early reduce-scatters of the buckets whose gradients live sharded."""
        self.comms = comms
        self.sample = sample
        in_flight = self.program.execution.reduce_scatters_in_flight
        by_group: dict[tuple[str, tuple[int, ...]], list[BucketState]] = {}
        for b in self.buckets.values():
            group = bucket_group(self.program, b.bucket)
            # A bucket that another segment's passes write too (a tied parameter's holders
            # sharing one tensor) is reduced by its REDUCE_SCATTER instructions, after each of
            # those passes: hooks inside one segment's pass cannot tell when it is complete.
            if group in comms.early and b.grads_sharded and not any(id(p) in self.shared for p in b.params):
                by_group.setdefault((b.bucket.segment, group), []).append(b)
        for (segment, group), buckets in by_group.items():
            reducer = EarlyReduceScatter(buckets, comms.early[group], threading.RLock(), sample_now, in_flight)
            self._reducers.setdefault(segment, []).append(reducer)
            self._reducer_of.update((b.bucket.id, reducer) for b in buckets)

    # -- what the rest of the rank asks ----------------------------------------------------------

    def bucket(self, ins: Instruction) -> BucketState | None:
        """The bucket ``ins`` names, or the mirror of it this rank holds (``Bucket.mirrors``)."""
        return self.buckets.get(ins.value) or self.buckets.get(self.mirror_of.get(ins.value, ""))

    def segment_buckets(self, segment: str) -> list[BucketState]:
        return [b for b in self.buckets.values() if b.bucket.segment == segment]

    def optimizer_params(self, segment: str) -> list[nn.Parameter]:
        """What ``segment``'s optimizer steps: when some of its buckets keep optimizer state
        sharded, those buckets' shards (the others' parameters), then the expert parameters
        no bucket covers; else the module's parameters that it owns (``owner``: a tied
        parameter shared with an earlier holder on this rank is that holder's)."""
        buckets = self.segment_buckets(segment)
        if not any(b.optimizer_sharded for b in buckets):
            return [p for p in self.modules[segment].parameters() if p.requires_grad and self.owner[id(p)] == segment]
        params: list[nn.Parameter] = []
        for b in buckets:
            params += [b.shard] if b.optimizer_sharded else [p for p in b.params if p.requires_grad]
        module = self.modules[segment]
        return params + [module.get_parameter(n) for n in self.experts.get(segment, ())]

    def report_grads(self, segment: str, st: StepState) -> None:
        """Copy ``segment``'s gradients into the step's report (``keep_grads``): the gradient
        shard of each bucket whose optimizer state is sharded, the full gradients otherwise.
        Called under the gradient lock, before the optimizer step."""
        buckets = self.segment_buckets(segment)
        module = self.modules[segment]
        if not any(b.optimizer_sharded for b in buckets):
            for qname, p in module.named_parameters():
                if p.grad is not None:
                    st.grads[qname] = p.grad.detach().to("cpu", copy=True)
            return
        for b in buckets:
            if b.optimizer_sharded:
                g = b.shard.grad
                g = torch.zeros_like(b.shard) if g is None else g
                st.grad_shards[b.bucket.id] = (b.replica, g.detach().to("cpu", copy=True))
            else:
                for qname, p in zip(b.bucket.params, b.params, strict=True):
                    if p.grad is not None:
                        st.grads[qname] = p.grad.detach().to("cpu", copy=True)
        for qname in self.experts.get(segment, ()):
            g = module.get_parameter(qname).grad
            if g is not None:
                st.grads[qname] = g.detach().to("cpu", copy=True)

    @contextlib.contextmanager
    def weight_pass(self, segment: str) -> Iterator[None]:
        """Around a weight-gradient pass (``B``/``BW``): the buckets of ``segment`` whose
        gradients live sharded are reduce-scattered as they complete, and whatever is left
        when the pass ends."""
        reducers = self._reducers.get(segment, ())
        for reducer in reducers:
            reducer.begin()
        try:
            yield
        finally:
            for reducer in reducers:
                reducer.finish()

    def shards(self) -> list[nn.Parameter]:
        return [b.shard for b in self.buckets.values() if b.shard is not None]

    def gathered_buffers(self) -> list[torch.Tensor]:
        """The flat buffers of the buckets with sharded parameters (empty unless gathered)."""
        return [b.flat for b in self.buckets.values() if b.params_sharded]

    # -- instructions ------------------------------------------------------------------------------

    def all_reduce(self, ins: Instruction, st: StepState) -> None:
        b = self.bucket(ins)
        comm = self.comms[ins.communicator]
        if b.optimizer_sharded:
            with self.grads_lock:
                if b.shard.grad is None:
                    b.shard.grad = torch.zeros_like(b.shard)
                grad = b.shard.grad
            comm.all_reduce(grad)
            return
        with self.grads_lock:
            flat = b.layout.flatten([p.grad for p in b.params])
            self.sample(st, flat)
        comm.all_reduce(flat)
        with self.grads_lock:
            for p, g in zip(b.params, b.layout.unflatten(flat), strict=True):
                if p.grad is None:
                    p.grad = g.clone()
                else:
                    p.grad.copy_(g)

    def reduce_scatter(self, ins: Instruction, st: StepState) -> None:
        b = self.buckets[ins.value]
        reducer = self._reducer_of.get(b.bucket.id)
        if reducer is not None:
            reducer.wait(b.bucket.id)
            return
        with self.grads_lock:
            flat, shard = b.take_gradients(sample=lambda flat, shard: self.sample(st, flat, shard))
        self.comms[ins.communicator].reduce_scatter(shard, flat)
        accumulate_grad(b.shard, shard)

    def all_gather(self, ins: Instruction, st: StepState) -> None:
        b = self.buckets[ins.value]
        # The shard is a view of the output buffer: gather from a copy of it.
        shard = b.shard.detach().clone()
        self.sample(st, shard)
        self.comms[ins.communicator].all_gather(b.flat, shard)

    def materialize(self, ins: Instruction, st: StepState) -> None:
        b = self.buckets[ins.value]
        b.allocate()
        self.comms[ins.communicator].all_gather(b.flat, b.shard.detach())

    def free(self, ins: Instruction, st: StepState) -> None:
        self.buckets[ins.value].release()

    # -- state between steps -------------------------------------------------------------------------

    def parameter_shards(self) -> dict[str, tuple[int, torch.Tensor]]:
        """``bucket id -> (replica, this replica's parameter shard)`` of the buckets whose
        parameters live sharded (the full parameters do not exist between steps)."""
        return {
            bid: (b.replica, b.shard.detach().to("cpu", copy=True))
            for bid, b in self.buckets.items()
            if b.params_sharded
        }
