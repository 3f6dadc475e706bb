"""One parameter bucket on one rank, and the early reduce-scatter of sharded gradients.

``BucketState`` holds one ``Bucket``'s layout (``piper_memory.store.BucketLayout``) and what
its residency asks for (``Bucket.params_home``/``grads_home``/``optimizer_home``, filled by
``piper_memory.plan_memory``; nothing here knows a ZeRO level):

- optimizer state ``FULL``: nothing more; the optimizer steps the module's parameters;
- optimizer state ``SHARDED``: the parameters become views of one flat full buffer, and the
  replica's shard of it becomes an ``nn.Parameter``, which is what the optimizer steps (so
  its state is sharded) and whose ``.grad`` is the gradient shard. With parameters ``FULL``
  the shard is a view of the buffer (the step updates the parameters in place, until
  ``ALL_GATHER`` brings the other replicas' shards); with parameters ``SHARDED`` it is a copy,
  and the buffer's storage is released (resized to zero bytes) except between a
  ``MATERIALIZE`` (storage back, all-gather into it) and its ``FREE``. Because the module's
  parameters, and any view of them autograd saved, share that one storage, a backward after
  a re-materialization reads the gathered values, and nothing keeps a freed copy alive.

``EarlyReduceScatter`` (gradients ``SHARDED``) reduce-scatters each bucket *during* the
backward that produces its gradients, from parameter hooks, instead of after the whole
pass: a segment's full gradients then never exist all at once, only those of the bucket
being filled plus the flat buffers of at most ``ExecutionOptions.reduce_scatters_in_flight``
reductions still running (the backend runs them while autograd goes on). The plan's
``REDUCE_SCATTER`` instruction then only waits for its bucket's reduction and adds the shard
into the gradient shard.

Ordering. Every member of the group must issue the reductions in one order. Buckets are
issued strictly by descending index (autograd reaches the last parameters first); a bucket
that completes out of turn waits for its predecessors, and ``finish`` (end of the backward)
issues whatever is left, complete or not, in the same order. So every member issues the same
sequence whatever its data-dependent completion order. The reductions run on a communicator
of their own (one per device group), used only by the thread running backwards, so they never
interleave with the plan's collectives on other threads. The gradient shards they add into
are not part of any autograd graph, so the thread that finishes a reduction may add it while
another thread runs a backward.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from piper_ir import Bucket, Program, Residency
from piper_memory.store import BucketLayout, accumulate_grad
from piper_runtime.backends.base import Communicator, Work, used_on_this_lane


def bucket_group(program: Program, bucket: Bucket) -> tuple[int, ...]:
    """The ranks that hold ``bucket`` and reduce it, in replica order: ``Bucket.devices``, or
    the whole group of its segment's ``Replication`` (empty if it has none)."""
    if bucket.devices:
        return bucket.devices
    rep = next((r for r in program.replication if r.segment == bucket.segment), None)
    return rep.devices if rep is not None else ()


class BucketState:
    """One bucket of a segment on this rank: its layout, the module's parameters in bucket
    order and, where its optimizer state is sharded, the flat full buffer they are views of
    and this replica's parameter shard (module doc)."""

    def __init__(self, bucket: Bucket, params: list[nn.Parameter], replica: int) -> None:
        self.bucket = bucket
        self.layout = BucketLayout(bucket, [tuple(p.shape) for p in params])
        self.params = params
        self.replica = replica
        self.flat: torch.Tensor | None = None
        self.shard: nn.Parameter | None = None
        if self.optimizer_sharded:
            with torch.no_grad():
                self.flat = self.layout.flatten([p.detach() for p in params])
                shard = self.layout.shard(self.flat, replica)
                # Parameters full: the shard is a view of them, so the optimizer updates them
                # in place and no second copy exists. Parameters sharded: the full buffer
                # comes and goes, the shard is the parameters' only lasting copy.
                self.shard = nn.Parameter(shard.clone() if self.params_sharded else shard)
                for p, view in zip(params, self.layout.unflatten(self.flat), strict=True):
                    p.data = view
            if self.params_sharded:
                self.release()

    @property
    def optimizer_sharded(self) -> bool:
        return self.bucket.optimizer_home is Residency.SHARDED

    @property
    def grads_sharded(self) -> bool:
        return self.bucket.grads_home is Residency.SHARDED

    @property
    def params_sharded(self) -> bool:
        return self.bucket.params_home is Residency.SHARDED

    @property
    def materialized(self) -> bool:
        return self.flat is not None and self.flat.untyped_storage().nbytes() > 0

    def release(self) -> None:
        """Drop the full parameters' memory (parameters sharded); the views keep their shapes."""
        self.flat.untyped_storage().resize_(0)

    def allocate(self) -> None:
        """Give the flat buffer its memory back (uninitialised) before gathering into it."""
        storage = self.flat.untyped_storage()
        nbytes = self.flat.numel() * self.flat.element_size()
        if storage.nbytes() != nbytes:
            storage.resize_(nbytes)

    def take_gradients(
        self, sample: Callable[[torch.Tensor, torch.Tensor], None] = lambda flat, shard: None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The full gradients flattened (what a reduce-scatter sends) and an empty output
        shard; the parameters' ``.grad`` are dropped. ``sample`` sees the buffers while the
        full gradients still exist too (the peak)."""
        grads = [p.grad for p in self.params]
        flat = self.layout.flatten(grads)
        shard = torch.empty(self.bucket.shard_numel, dtype=flat.dtype, device=flat.device)
        sample(flat, shard)
        # Another lane (the backward's) allocated them; this lane's copy must finish before
        # their memory is reused (on a GPU backend: record_stream; nothing on the host).
        used_on_this_lane(*grads)
        for p in self.params:
            p.grad = None
        return flat, shard


class _Reduction:
    """One running reduce-scatter; whoever claims it first waits for it and accumulates."""

    def __init__(self, bucket: BucketState, work: Work, flat: torch.Tensor, shard: torch.Tensor) -> None:
        self.bucket, self.work, self.flat, self.shard = bucket, work, flat, shard
        self.claimed = False
        self.done = threading.Event()


class EarlyReduceScatter:
    """Reduce-scatters one segment's buckets whose gradients live sharded, from gradient
    hooks, on ``comm`` (module doc); at most ``in_flight`` run before the oldest is waited
    for."""

    def __init__(
        self,
        buckets: list[BucketState],
        comm: Communicator,
        lock: threading.RLock,
        on_issue: Callable[[list[torch.Tensor]], None] = lambda buffers: None,
        in_flight: int = 2,
    ) -> None:
        self.buckets = buckets
        self.comm = comm
        self.in_flight = in_flight
        self.lock = lock
        self.on_issue = on_issue  # sees the live collective buffers at each issue (accounting)
        self.active = False
        self.running: dict[str, _Reduction] = {}
        self._remaining: list[int] = []
        self._next = -1
        for i, b in enumerate(buckets):
            for p in b.params:
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(partial(self._accumulated, i))

    def begin(self) -> None:
        """Called before a weight-gradient pass (``B`` or ``BW``) of the segment."""
        self._remaining = [sum(p.requires_grad for p in b.params) for b in self.buckets]
        self._complete = [n == 0 for n in self._remaining]
        self._next = len(self.buckets) - 1
        self.active = True

    def finish(self) -> None:
        """Called after the pass: issue every bucket not issued yet, in turn."""
        if not self.active:
            return
        while self._next >= 0:
            self._issue(self._next)
            self._next -= 1
        self.active = False

    def wait(self, bucket_id: str) -> None:
        """Return once the reduction of ``bucket_id`` issued by the last pass has been added
        into the gradient shard (it may have been completed already)."""
        with self.lock:
            r = self.running.get(bucket_id)
            if r is None:
                return
            mine = not r.claimed
            r.claimed = True
        if mine:
            self._complete_reduction(r)
        else:
            r.done.wait()

    def _accumulated(self, index: int, _param: torch.Tensor) -> None:
        if not self.active:
            return
        self._remaining[index] -= 1
        if self._remaining[index] == 0:
            self._complete[index] = True
            while self._next >= 0 and self._complete[self._next]:
                self._issue(self._next)
                self._next -= 1

    def _issue(self, index: int) -> None:
        b = self.buckets[index]
        with self.lock:
            running = [t for r in self.running.values() if r.flat is not None for t in (r.flat, r.shard)]
        flat, shard = b.take_gradients(sample=lambda flat, shard: self.on_issue([*running, flat, shard]))
        work = self.comm.start_reduce_scatter(shard, flat)
        with self.lock:
            self.running[b.bucket.id] = _Reduction(b, work, flat, shard)
            unclaimed = [r for r in self.running.values() if not r.claimed]
        for r in unclaimed[: max(0, len(unclaimed) - self.in_flight)]:
            self.wait(r.bucket.bucket.id)

    def _complete_reduction(self, r: _Reduction) -> None:
        try:
            r.work.wait()
            used_on_this_lane(r.shard)  # allocated by the backward's lane, read (or kept) on this one
            accumulate_grad(r.bucket.shard, r.shard)
            r.flat = None  # the full flat gradient is gone once reduced
        finally:
            with self.lock:
                self.running.pop(r.bucket.bucket.id, None)
            r.done.set()
