"""Per-rank memory estimates of a compiled ``Program`` (pure IR, no torch).

``estimate_memory`` replays each rank's sequential instruction order and tracks what a runtime
that carries the plan out holds after every instruction (and inside each collective), in the
categories ``piper_runtime.rank.memory.RankMemory`` measures:

- *parameters*: the parameters of every segment the rank runs (a tied parameter once per
  rank, however many of its holders the rank runs: they share one tensor) (1/degree of each parameter a
  tensor-parallel ``Sharding`` lists); one shard (``Bucket.shard_numel``, padded) per bucket
  whose parameters live sharded (``Bucket.params_home``, ZeRO 3);
- *gradients*: a stage segment's full gradients from its first weight-gradient pass (``B`` or
  ``BW``) until the optimizer step; where a bucket's optimizer state is sharded (ZeRO 1) its
  full gradients are dropped at its reduce-scatter and its gradient shard lives from then
  until the step. Where its gradients live sharded (``Bucket.grads_home``, ZeRO 2/3) the
  runtime reduce-scatters each bucket during the pass as soon as its gradients are complete
  (``piper_runtime.rank.buckets``; last bucket first, at most
  ``Program.execution.reduce_scatters_in_flight`` reductions running, the rest finishing at
  their ``REDUCE_SCATTER``), so the full gradients of one bucket exist at a time. The pass's activations are taken as released when its buckets are
  reduced (exact with one bucket per segment, whose reduction starts as the pass ends; with
  several, the earlier ones start while autograd still holds part of them). ``grad_bytes``
  is the lasting part (full, or one shard from ZeRO-2), ``grad_buffer_bytes`` the peak of
  the full gradients on top of it;
- *optimizer state*: 0x the parameter bytes for ``"sgd"`` (no momentum), 2x for
  ``"adam"``/``"adamw"``; one shard where it lives sharded (``Bucket.optimizer_home``, ZeRO-1 on). Counted as resident all step (the steady
  state: after the first step the state lives between steps);
- *communication*: gathered parameters (ZeRO-3, ``MATERIALIZE`` to ``FREE``; their peak is also
  ``materialized_bytes``), collective buffers (a flattened bucket for ``ALL_REDUCE``, none for the in-place
  ``ALL_REDUCE`` of a mirrored bucket's gradient shard, the
  flattened bucket and the output shard for a reduce-scatter while it runs, a copy of the shard for
  ``ALL_GATHER``), and point-to-point buffers: every sent tensor until the end of the step, a
  receive's buffer from when it is posted (``Program.execution.recv_lookahead`` receives
  ahead) until the compute that reads it;
- *activations*: what a forward keeps until its backward (``B``, or ``BW`` after a split
  backward), per microbatch; for a segment that recomputes its activations
  (``Segment.recompute``) its non-batch inputs until the backward, which then holds the
  recomputed forward's activations while it runs (until ``BW`` after a split backward),
  and, at its start, the gradients of its outputs and those it makes of its inputs too.
  The IR does not describe a segment's interior, so by default this is the segment's
  outputs (``Segment.outputs`` value metas, one replica's shard of one microbatch; a
  context-parallel rank's chunk of the sequence, as the rewrite records it; logits a
  vocabulary-parallel loss reads, which the IR records whole, as one rank's slice, 1/tp), a lower
  bound that is exact in its *shape* across schedules (GPipe holds M microbatches, 1F1B at
  most the number of stages). ``activation_bytes`` (segment id -> bytes one forward keeps on
  this rank) replaces it per segment: ``piper tune`` profiles them on one device, and for
  tensor-, sequence- and context-parallel candidates on one rank of the group as the runtime
  runs it (``piper_train.tuning.profiler.rank_activation_bytes``: TP's column outputs cut and
  the rest whole, SP's between-region code on sequence shards, CP's chunks with the gathered
  keys and values whole, vocabulary-cut logits), since what a sharded rank keeps inside a
  segment is not in the IR (one device's bytes were 1.6-2.4x a TP rank's, and those divided
  by the degree 0.59-0.88x an SP rank's; docs/memory.md).

``peak_bytes`` is the largest simultaneous sum of all five over the order, the figure a
per-rank budget has to hold; ``total_bytes`` (model state plus activations, each at its own
peak, without communication) is kept for summaries. ``check_budget`` compares the larger of
the two with a per-rank budget.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable, Mapping

import attrs

from piper_ir import (
    BUCKET_KINDS,
    Bucket,
    MemoryPlanError,
    NodeKind,
    Phase,
    Program,
    Residency,
    SegmentRole,
    ShardKind,
    TensorMeta,
    grad_name,
)

# Optimizer state per parameter byte (Adam/AdamW keep two moments).
OPTIMIZER_STATE_FACTOR = {"sgd": 0, "adam": 2, "adamw": 2}

# The kinds and phases the replay tests per instruction, bound once: on Python 3.11 reading
# ``NodeKind.SEND`` runs the enum class's member descriptor (0.1 us, five times a module
# global), and the replay walks 392k instructions at 16,384 devices.
COMPUTE, OPTIMIZER, SEND, RECV = NodeKind.COMPUTE, NodeKind.OPTIMIZER, NodeKind.SEND, NodeKind.RECV
FORWARD = Phase.F
INPUT_GRADIENTS = (Phase.B, Phase.BI)  # passes that read their outputs' gradients
WEIGHT_GRADIENTS = (Phase.B, Phase.BW)  # passes that make their parameters' gradients


@attrs.frozen
class MemoryEstimate:
    """One rank's estimate. The first seven fields are per-category peaks (see the module
    docstring); ``communication_bytes`` is the peak of the communication buffers (gathered
    parameters included) and ``peak_bytes`` the peak of everything at one moment."""

    rank: int
    param_bytes: int
    grad_bytes: int
    optimizer_state_bytes: int
    peak_activation_bytes: int
    materialized_bytes: int = 0
    grad_buffer_bytes: int = 0
    communication_bytes: int = 0
    # A function of the fields above and the order; left out of equality so an estimate
    # compares by its categories.
    peak_bytes: int = attrs.field(default=0, eq=False)

    @property
    def model_state_bytes(self) -> int:
        """Parameters, gradients and optimizer state, with the transient ZeRO buffers."""
        return (
            self.param_bytes
            + self.grad_bytes
            + self.optimizer_state_bytes
            + self.materialized_bytes
            + self.grad_buffer_bytes
        )

    @property
    def total_bytes(self) -> int:
        return self.model_state_bytes + self.peak_activation_bytes

    @property
    def required_bytes(self) -> int:
        """What ``check_budget`` compares with the budget."""
        return max(self.total_bytes, self.peak_bytes)

    def categories(self) -> dict[str, int]:
        """The peaks in ``piper_runtime.rank.memory.RankMemory``'s categories (gathered parameters
        are communication there, the full gradients awaiting reduction are gradients)."""
        return {
            "parameters": self.param_bytes,
            "gradients": self.grad_bytes + self.grad_buffer_bytes,
            "optimizer_state": self.optimizer_state_bytes,
            "communication": self.communication_bytes,
            "activations": self.peak_activation_bytes,
            "total": self.peak_bytes,
        }

    def describe(self) -> str:
        parts = [
            ("parameters", self.param_bytes),
            ("gradients", self.grad_bytes),
            ("optimizer state", self.optimizer_state_bytes),
            ("gathered parameters", self.materialized_bytes),
            ("unreduced gradients", self.grad_buffer_bytes),
            ("activations", self.peak_activation_bytes),
            ("communication", self.communication_bytes),
        ]
        text = ", ".join(f"{name} {_mib(b)}" for name, b in parts if b)
        return text + (f"; at most {_mib(self.peak_bytes)} at once" if self.peak_bytes else "")


def estimate_memory(
    program: Program, optimizer: str = "adamw", *, activation_bytes: Mapping[str, int] | None = None
) -> dict[int, MemoryEstimate]:
    """Rank -> ``MemoryEstimate`` for ``program`` trained with ``optimizer`` ("sgd", "adam" or
    "adamw"); ``activation_bytes`` optionally gives, per segment id, the bytes one forward of
    one microbatch (one replica's shard) keeps for its backward."""
    if optimizer not in OPTIMIZER_STATE_FACTOR:
        raise ValueError(f"unknown optimizer {optimizer!r}; expected one of {sorted(OPTIMIZER_STATE_FACTOR)}")
    return {
        plan.rank: _RankReplay(program, plan.rank, OPTIMIZER_STATE_FACTOR[optimizer], activation_bytes).run()
        for plan in program.ranks
    }


def check_budget(
    program: Program,
    budget_bytes: int,
    optimizer: str = "adamw",
    *,
    activation_bytes: Mapping[str, int] | None = None,
) -> dict[int, MemoryEstimate]:
    """The estimates of ``program``; ``MemoryPlanError`` naming every rank whose estimate
    (``MemoryEstimate.required_bytes``) exceeds ``budget_bytes``, with its breakdown."""
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int | float) or budget_bytes <= 0:
        raise MemoryPlanError(f"the memory budget must be a positive number of bytes, got {budget_bytes!r}")
    estimates = estimate_memory(program, optimizer, activation_bytes=activation_bytes)
    over = [e for e in estimates.values() if e.required_bytes > budget_bytes]
    if over:
        lines = [f"rank {e.rank}: {_mib(e.required_bytes)} ({e.describe()})" for e in over]
        raise MemoryPlanError(
            f"the estimated memory of {len(over)} rank(s) exceeds the per-rank budget of {_mib(budget_bytes)}:\n    "
            + "\n    ".join(lines)
            + "\n  try more data-parallel replicas (--dp), a higher ZeRO level (--zero), more microbatches "
            "or a smaller batch",
            ranks=[e.rank for e in over],
        )
    return estimates


def _bytes(bucket: Bucket, numel: int) -> int:
    return TensorMeta((numel,), bucket.dtype).nbytes()


def _homes(buckets: Iterable[Bucket]) -> set[str]:
    """Which of ``params``, ``grads``, ``optimizer`` live sharded in any of ``buckets`` (one
    segment's, alike in the plans ``plan_memory`` makes)."""
    return {
        kind
        for b in buckets
        for kind, home in (("params", b.params_home), ("grads", b.grads_home), ("optimizer", b.optimizer_home))
        if home is Residency.SHARDED
    }


def _aliased(program: Program, segments: set[str]) -> set[tuple[str, str]]:
    """The ``(segment, parameter)`` pairs of ``segments`` (one rank's) that are a tied
    parameter already held by an earlier holder there: the rank keeps one tensor for them."""
    out: set[tuple[str, str]] = set()
    for tie in program.ties:
        present = [h for h in tie.holders if h[0] in segments]
        out.update(present[1:])
    return out


def _vocabulary_sliced(program: Program) -> dict[str, int]:
    """Value -> tensor-parallel degree for the logits a vocabulary-parallel loss reads: a loss
    segment sharded ``tp`` that issues a collective (its cross-entropy's all-reduce) receives
    each rank's slice of the head's output, which the IR records whole (shard_vocab)."""
    batch = {*program.inputs, *program.targets}
    out: dict[str, int] = {}
    for sh in program.sharding:
        seg = program.segment_by_id.get(sh.segment)
        if seg is None or seg.role is not SegmentRole.LOSS or sh.kind is not ShardKind.TP:
            continue
        if sh.collectives and sh.degree > 1:
            out.update((v, sh.degree) for v in seg.inputs if v not in batch)
    return out


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f} MiB" if nbytes >= 2**16 else f"{int(nbytes)} B"


class _Tally(dict):
    """Byte counts by key that keep their sum (``total``) as they change: the replay reads
    every category's sum after each of a rank's instructions, which summing six dicts each
    time made 8% of its cost (392k instructions: 1.21 s, 1.12 s with running totals)."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __setitem__(self, key: object, nbytes: int) -> None:
        self.total += nbytes - self.get(key, 0)
        super().__setitem__(key, nbytes)

    def pop(self, key: object, *default: int) -> int:  # type: ignore[override]
        nbytes = dict.pop(self, key, _MISSING)  # one lookup: most pops find nothing
        if nbytes is _MISSING:
            if default:
                return default[0]
            raise KeyError(key)
        self.total -= nbytes
        return nbytes


_MISSING = object()
_pop, _store = dict.pop, dict.__setitem__  # a _Tally's own, bypassing its running sum


class _RankReplay:
    """Walks one rank's instructions, tracking live bytes per category (see the module
    docstring); ``run`` returns the peaks."""

    def __init__(
        self, program: Program, rank: int, factor: int, activation_bytes: Mapping[str, int] | None
    ) -> None:
        self.program = program
        self.instructions = program.plan(rank).instructions
        self.rank = rank
        buckets: dict[str, list[Bucket]] = {}
        for b in program.buckets:
            if not b.devices or rank in b.devices:  # a shard position's buckets live on its holders
                buckets.setdefault(b.segment, []).append(b)
        self.buckets = buckets
        # Lasting state, and per segment what a weight-gradient pass makes: the full
        # gradients, one entry per bucket (or one for an unreplicated segment).
        self.params = self.state = self.lasting_grads = 0
        self.full: dict[str, dict[str, int]] = {}  # segment -> {bucket or segment: full bytes}
        self.bucket = {b.id: b for b in program.buckets}
        # Tensor parallelism (Program.sharding): a listed parameter is cut ``degree`` ways.
        tp_cut = {(sh.segment, p.name): sh.degree_of(p) for sh in program.sharding for p in sh.params}
        self.early: set[str] = set()  # segments with sharded gradients: reduce-scattered during the backward
        self.inflight = _Tally()  # bucket -> buffers of its running reduce-scatter
        mine = program.plan(rank).segments()
        aliased = _aliased(program, set(mine))
        replicated = {r.segment for r in program.replication}
        for seg_id in mine:
            seg = program.segment_by_id[seg_id]
            homes = _homes(buckets.get(seg_id, ()))
            full = sum(
                meta.nbytes() // tp_cut.get((seg_id, name), 1)
                for name, meta in seg.params
                if (seg_id, name) not in aliased
            )
            shard = sum(_bytes(b, b.shard_numel) for b in buckets.get(seg_id, ()))
            self.params += shard if "params" in homes else full
            if seg.role is not SegmentRole.STAGE or not seg.params:
                continue
            self.state += factor * (shard if "optimizer" in homes else full)
            self.lasting_grads += shard if "grads" in homes else full
            if seg_id in buckets:
                self.full[seg_id] = {b.id: _bytes(b, b.numel) for b in buckets[seg_id]}
                if seg_id not in replicated:  # only a tied parameter's bucket: the rest is whole
                    self.full[seg_id][seg_id] = full - sum(self.full[seg_id].values())
                if "grads" in homes:
                    self.early.add(seg_id)
            else:
                self.full[seg_id] = {seg_id: full}
        self.activation_bytes = dict(activation_bytes or {})
        self.sliced = _vocabulary_sliced(program)
        self.kept: dict[str, int] = {}  # segment -> _kept_bytes (the same for every microbatch)
        self.pass_grads: dict[str, int] = {}  # segment -> _pass_grad_bytes
        self.grads_read: dict[str, tuple[str, ...]] = {}  # segment -> its outputs' gradient names
        self.recv_positions = [k for k, ins in enumerate(self.instructions) if ins.kind is RECV]
        # posted[j]: the bytes of the first j receives; a sample needs a window of them
        self.posted = list(itertools.accumulate(
            (self.instructions[k].meta.nbytes() if self.instructions[k].meta is not None else 0
             for k in self.recv_positions),
            initial=0,
        ))
        self.recv_lookahead = program.execution.recv_lookahead
        # Live things.
        self.grads = _Tally()  # bucket/segment -> full gradient bytes held
        self.grad_shards = _Tally()  # bucket -> gradient shard bytes held
        self.gathered = _Tally()  # bucket -> gathered parameter bytes
        self.acts = _Tally()  # (segment, microbatch) -> activation bytes
        self.sent = 0
        self.received = _Tally()  # (value, microbatch) waiting for its reader -> bytes
        self.peaks = dict.fromkeys(("grads", "full", "comm", "acts", "gathered", "total"), 0)
        self.position = -1  # the instruction being replayed

    def _forward_bytes(self, seg_id: str) -> int:
        """What one forward of ``seg_id`` keeps for its backward (a recomputed one: while
        its backward runs)."""
        if seg_id in self.activation_bytes:
            return int(self.activation_bytes[seg_id])
        seg = self.program.segment_by_id[seg_id]
        return sum(self._value_bytes(v) for v in seg.outputs)

    def _value_bytes(self, name: str) -> int:
        """One rank's bytes of value ``name`` (0 if unknown): its meta's, or one slice of
        vocabulary-cut logits (``_vocabulary_sliced``)."""
        value = self.program.value_by_name.get(name)
        if value is None:
            return 0
        return value.meta.nbytes() // self.sliced.get(name, 1)

    def _kept_bytes(self, seg_id: str) -> int:
        """What a forward leaves held until its backward: its activations, or for a segment
        that recomputes them (``Segment.recompute``) its inputs only (the batch aside)."""
        seg = self.program.segment_by_id[seg_id]
        if not seg.recompute:
            return self._forward_bytes(seg_id)
        batch = {*self.program.inputs, *self.program.targets}
        values = self.program.value_by_name
        return sum(values[v].meta.nbytes() for v in seg.inputs if v in values and v not in batch)

    def _pass_grad_bytes(self, seg_id: str) -> int:
        """The gradients a backward of ``seg_id`` holds: of its outputs, which it reads, and
        of its inputs (those that need one), which it makes."""
        seg = self.program.segment_by_id[seg_id]
        values = self.program.value_by_name
        return sum(self._value_bytes(v) for v in (*seg.outputs, *seg.inputs)
                   if v in values and values[v].meta.requires_grad)

    def _sample(self, position: int, transient: int = 0) -> None:
        grads = self.grads.total + self.grad_shards.total
        gathered = self.gathered.total
        comm = gathered + transient + self.sent + self.received.total + self._posted_bytes(position)
        comm += self.inflight.total
        acts = self.acts.total
        peaks = self.peaks  # comparisons, not max(): this runs after every instruction
        if grads > peaks["grads"]:
            peaks["grads"] = grads
        if grads - self.lasting_grads > peaks["full"]:
            peaks["full"] = grads - self.lasting_grads
        if gathered > peaks["gathered"]:
            peaks["gathered"] = gathered
        if comm > peaks["comm"]:
            peaks["comm"] = comm
        if acts > peaks["acts"]:
            peaks["acts"] = acts
        total = self.params + self.state + grads + comm + acts
        if total > peaks["total"]:
            peaks["total"] = total

    def _posted_bytes(self, position: int) -> int:
        """The bytes of the receives posted but not yet carried out when instruction
        ``position`` is done: the next ``recv_lookahead`` (``Program.execution``) after it."""
        at = bisect.bisect_right(self.recv_positions, position)
        end = min(at + self.recv_lookahead, len(self.recv_positions))
        return self.posted[end] - self.posted[at]

    def run(self) -> MemoryEstimate:
        self._sample(-1)
        # The sample after each instruction is ``_sample(k)`` inline, on local names: it runs
        # once per instruction (392k at 16,384 devices), and its call, its bisect of the receive
        # positions and its dozen attribute lookups were about a third of the replay. ``at``
        # counts the receives at or before instruction k, as ``_posted_bytes`` bisects for.
        recv_positions, posted, lookahead = self.recv_positions, self.posted, self.recv_lookahead
        last = len(recv_positions)
        grads_t, shards_t, gathered_t = self.grads, self.grad_shards, self.gathered
        acts_t, received_t, inflight_t = self.acts, self.received, self.inflight
        peaks = self.peaks
        resident, lasting = self.params + self.state, self.lasting_grads
        sizes: dict[int, int] = {}  # id(meta) -> its bytes: a value's transfers share one meta
        at = 0
        # What the last sample read: a SEND or RECV (two thirds of a pipeline's instructions)
        # changes only the communication buffers, so after one only those and the total are
        # sampled, with the other categories as they were. Their running sums, the bytes
        # sent and the two peaks they move live in local names while a run of them lasts
        # (``received`` updated as ``_Tally.__setitem__`` does, without its call), and are
        # written back before any other instruction, whose handlers read them.
        grads, gathered, acts = grads_t.total + shards_t.total, gathered_t.total, acts_t.total
        sent, received_total, inflight = self.sent, received_t.total, inflight_t.total
        peak_comm, peak_total = peaks["comm"], peaks["total"]
        received_get, store = received_t.get, _store
        instructions = self.instructions
        for k, ins in enumerate(instructions):
            kind = ins.kind
            if kind is SEND or kind is RECV:
                meta = ins.meta
                if meta is None:
                    nbytes = 0
                else:
                    nbytes = sizes.get(id(meta))
                    if nbytes is None:
                        nbytes = sizes[id(meta)] = meta.nbytes()
                if kind is SEND:
                    sent += nbytes
                else:
                    key = (ins.value, ins.microbatch)
                    received_total += nbytes - received_get(key, 0)
                    store(received_t, key, nbytes)
                    at += 1
                end = at + lookahead
                comm = gathered + sent + received_total + posted[end if end < last else last] - posted[at]
                comm += inflight
                if comm > peak_comm:
                    peak_comm = comm
                total = resident + grads + comm + acts
                if total > peak_total:
                    peak_total = total
                continue
            self.position = k
            self.sent, received_t.total = sent, received_total
            peaks["comm"], peaks["total"] = peak_comm, peak_total
            if kind is COMPUTE:
                self._compute(ins)
            elif kind is OPTIMIZER:
                for key in self.full.get(ins.segment, {}):
                    self.grads.pop(key, None)
                    self.grad_shards.pop(key, None)
            elif kind in BUCKET_KINDS:
                self._bucket_op(k, ins)
            sent, received_total, inflight = self.sent, received_t.total, inflight_t.total
            peak_comm, peak_total = peaks["comm"], peaks["total"]
            grads = grads_t.total + shards_t.total
            gathered = gathered_t.total
            end = at + lookahead
            comm = gathered + sent + received_total + posted[end if end < last else last] - posted[at]
            comm += inflight
            acts = acts_t.total
            if grads > peaks["grads"]:
                peaks["grads"] = grads
            if grads - lasting > peaks["full"]:
                peaks["full"] = grads - lasting
            if gathered > peaks["gathered"]:
                peaks["gathered"] = gathered
            if comm > peak_comm:
                peak_comm = comm
            if acts > peaks["acts"]:
                peaks["acts"] = acts
            total = resident + grads + comm + acts
            if total > peak_total:
                peak_total = total
        self.position = len(instructions) - 1
        self.sent, received_t.total = sent, received_total
        peaks["comm"], peaks["total"] = peak_comm, peak_total
        p = self.peaks
        return MemoryEstimate(
            rank=self.rank,
            param_bytes=self.params,
            grad_bytes=self.lasting_grads,
            optimizer_state_bytes=self.state,
            peak_activation_bytes=p["acts"],
            materialized_bytes=p["gathered"],
            grad_buffer_bytes=max(0, p["grads"] - self.lasting_grads),
            communication_bytes=p["comm"],
            peak_bytes=p["total"],
        )

    def _bucket_op(self, k: int, ins) -> None:  # an Instruction
        b = self.bucket.get(ins.value)
        if b is None:
            raise MemoryPlanError(f"rank {self.rank}: {ins.id} names {ins.value!r}, which is not a bucket")
        padded, shard = _bytes(b, b.padded_numel), _bytes(b, b.shard_numel)
        if ins.kind is NodeKind.ALL_REDUCE and b.optimizer_home is Residency.SHARDED:
            # A mirrored bucket's gradient shard (``Bucket.mirrors``; ``value`` may name the
            # mirror this rank holds, of the same layout), summed in place: nothing new held.
            self._sample(k - 1)
        elif ins.kind is NodeKind.ALL_REDUCE:  # the flattened gradients, reduced in place
            self._sample(k - 1, padded)
        elif ins.kind is NodeKind.REDUCE_SCATTER and b.segment in self.early:
            self.inflight.pop(b.id, None)  # started by the backward; now it has finished
            self.grad_shards[b.id] = shard
        elif ins.kind is NodeKind.REDUCE_SCATTER:  # flattened gradients in, one shard out
            self._sample(k - 1, padded + shard)
            self.grads.pop(b.id, None)
            self.grad_shards[b.id] = shard
        elif ins.kind is NodeKind.ALL_GATHER:  # a copy of the updated shard in, the parameters out
            self._sample(k - 1, shard)
        elif ins.kind is NodeKind.MATERIALIZE:
            self.gathered[b.id] = padded
        else:  # FREE
            self.gathered.pop(b.id, None)

    def _compute(self, ins) -> None:  # an Instruction
        seg = self.program.segment_by_id[ins.segment]
        mb = ins.microbatch
        key = (seg.id, mb)
        # The tallies' pops and stores below are ``_Tally.pop``/``__setitem__`` written out,
        # without their calls: a forward and a backward of each microbatch run them.
        if ins.phase is FORWARD:
            received = self.received
            for name in seg.inputs:  # a received input becomes the forward's saved input
                nbytes = _pop(received, (name, mb), None)
                if nbytes is not None:
                    received.total -= nbytes
            kept = self.kept.get(seg.id)
            if kept is None:
                kept = self.kept[seg.id] = self._kept_bytes(seg.id)
            acts = self.acts
            acts.total += kept
            _store(acts, key, acts.get(key, 0) + kept)
            return
        if ins.phase in INPUT_GRADIENTS:
            received = self.received
            grads_read = self.grads_read.get(seg.id)
            if grads_read is None:  # the gradients of its outputs, named once per segment
                grads_read = self.grads_read[seg.id] = tuple(grad_name(name) for name in seg.outputs)
            for name in grads_read:
                nbytes = _pop(received, (name, mb), None)
                if nbytes is not None:
                    received.total -= nbytes
            if seg.recompute:
                # The forward runs again: its activations exist while this pass runs, with
                # the gradients of its outputs it reads and, before it frees them, those it
                # makes of its inputs. (Where the activations were kept, their profiled bytes
                # held more than the measured peak already; a recomputed pass's peak is this
                # moment.)
                made = self.pass_grads.get(seg.id)
                if made is None:
                    made = self.pass_grads[seg.id] = self._pass_grad_bytes(seg.id)
                self.acts[key] = self.acts.get(key, 0) + self._forward_bytes(seg.id) + made
                self._sample(self.position)
                self.acts[key] -= made
        if ins.phase in WEIGHT_GRADIENTS and seg.id in self.early:
            # Taken as freed first: autograd releases a segment's saved activations as its
            # backward goes, and the last bucket completes at the end of the pass.
            self.acts.pop(key, None)
            self._early_reduce_scatter(seg.id)
        elif ins.phase in WEIGHT_GRADIENTS:  # BI keeps what BW still needs
            self.acts.pop(key, None)
            for bucket_or_seg, nbytes in self.full.get(seg.id, {}).items():
                self.grads[bucket_or_seg] = nbytes

    def _early_reduce_scatter(self, seg_id: str) -> None:
        """A weight-gradient pass of a segment whose gradients live sharded (ZeRO 2/3): each
        bucket, last first, is complete, starts its reduce-scatter (sampled with its full
        gradients and every running reduction's buffers) and loses its full gradients; the
        oldest of more than ``reduce_scatters_in_flight`` (``Program.execution``) running
        reductions is waited for (its shard is then the bucket's gradient shard)."""
        in_flight = self.program.execution.reduce_scatters_in_flight
        running: list[Bucket] = []
        for b in reversed(self.buckets[seg_id]):
            nbytes = _bytes(b, b.padded_numel) + _bytes(b, b.shard_numel)
            self.grads[b.id] = _bytes(b, b.numel)
            self._sample(self.position - 1, nbytes)
            self.grads.pop(b.id)
            self.inflight[b.id] = nbytes
            running.append(b)
            while len(running) > in_flight:
                done = running.pop(0)
                self.inflight.pop(done.id)
                self.grad_shards[done.id] = _bytes(done, done.shard_numel)
