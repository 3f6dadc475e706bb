"""Per-rank memory estimates of a compiled ``Program`` (pure IR, no torch).

For each rank: bytes of the parameters of the segments it runs, of their gradients, of the
optimizer state, and the peak bytes of activations held between a forward and its backward.
Activations are counted at segment boundaries only (the ``Segment.outputs`` value metas of
each forward, already split per microbatch): the IR does not describe a segment's interior,
so the figure is a lower bound that is exact in its *shape* across schedules (GPipe holds M
microbatches, 1F1B at most the number of stages).

With data parallelism (``Program.replication``, N replicas of a segment) the model state
follows the ZeRO level: optimizer state is one shard (``Bucket.shard_numel``) from zero 1,
gradients from zero 2, parameters from zero 3. Two transient buffers are counted besides:
``grad_buffer_bytes`` (zero >= 2: the full gradients of one segment, alive during a backward
until its reduce-scatter) and ``materialized_bytes`` (zero 3: one segment's gathered
parameters, since ``plan_memory`` frees a chain before it gathers the next). Both are the
largest such segment on the rank. ``check_budget`` compares the total with a per-rank budget.
"""

from __future__ import annotations

import attrs

from piper_ir import Bucket, MemoryPlanError, NodeKind, Phase, Program, SegmentRole, TensorMeta

# Optimizer state per parameter byte (Adam/AdamW keep two moments).
OPTIMIZER_STATE_FACTOR = {"sgd": 0, "adam": 2, "adamw": 2}


@attrs.frozen
class MemoryEstimate:
    rank: int
    param_bytes: int
    grad_bytes: int
    optimizer_state_bytes: int
    peak_activation_bytes: int
    materialized_bytes: int = 0
    grad_buffer_bytes: int = 0

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

    def describe(self) -> str:
        parts = [
            ("parameters", self.param_bytes),
            ("gradients", self.grad_bytes),
            ("optimizer state", self.optimizer_state_bytes),
            ("gathered parameters", self.materialized_bytes),
            ("unreduced gradients", self.grad_buffer_bytes),
            ("activations", self.peak_activation_bytes),
        ]
        return ", ".join(f"{name} {_mib(b)}" for name, b in parts if b)


def estimate_memory(program: Program, optimizer: str = "adamw") -> dict[int, MemoryEstimate]:
    """Rank -> ``MemoryEstimate`` for ``program`` trained with ``optimizer``
    ("sgd", "adam" or "adamw")."""
    if optimizer not in OPTIMIZER_STATE_FACTOR:
        raise ValueError(f"unknown optimizer {optimizer!r}; expected one of {sorted(OPTIMIZER_STATE_FACTOR)}")
    factor = OPTIMIZER_STATE_FACTOR[optimizer]
    zero = {r.segment: r.zero for r in program.replication}
    buckets: dict[str, list[Bucket]] = {}
    for b in program.buckets:
        buckets.setdefault(b.segment, []).append(b)
    out: dict[int, MemoryEstimate] = {}
    for plan in program.ranks:
        params = grads = state = gathered = unreduced = 0
        for seg_id in plan.segments():
            seg = program.segment_by_id[seg_id]
            full = sum(meta.nbytes() for _, meta in seg.params)
            level = zero.get(seg_id, 0) if seg_id in buckets else 0
            shard = sum(_bytes(b, b.shard_numel) for b in buckets.get(seg_id, ()))
            padded = sum(_bytes(b, b.padded_numel) for b in buckets.get(seg_id, ()))
            params += shard if level >= 3 else full
            if level >= 3:
                gathered = max(gathered, padded)
            if seg.role is not SegmentRole.STAGE:
                continue
            grads += shard if level >= 2 else full
            if level >= 2:
                unreduced = max(unreduced, padded)
            state += factor * (shard if level >= 1 else full)
        out[plan.rank] = MemoryEstimate(
            rank=plan.rank,
            param_bytes=params,
            grad_bytes=grads,
            optimizer_state_bytes=state,
            peak_activation_bytes=_peak_activations(program, plan.rank),
            materialized_bytes=gathered,
            grad_buffer_bytes=unreduced,
        )
    return out


def check_budget(program: Program, budget_bytes: int, optimizer: str = "adamw") -> dict[int, MemoryEstimate]:
    """The estimates of ``program``; ``MemoryPlanError`` naming every rank whose estimate
    exceeds ``budget_bytes``, with its breakdown."""
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int | float) or budget_bytes <= 0:
        raise MemoryPlanError(f"the memory budget must be a positive number of bytes, got {budget_bytes!r}")
    estimates = estimate_memory(program, optimizer)
    over = [e for e in estimates.values() if e.total_bytes > budget_bytes]
    if over:
        lines = [f"rank {e.rank}: {_mib(e.total_bytes)} ({e.describe()})" for e in over]
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


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f} MiB" if nbytes >= 2**16 else f"{int(nbytes)} B"


def _peak_activations(program: Program, rank: int) -> int:
    """Max over the rank's sequential order of the bytes of forwards not yet backwarded."""
    live: dict[tuple[str, int | None], int] = {}
    current = peak = 0
    for ins in program.plan(rank).instructions:
        if ins.kind is not NodeKind.COMPUTE:
            continue
        key = (ins.segment, ins.microbatch)
        if ins.phase is Phase.F:
            seg = program.segment_by_id[ins.segment]
            size = sum(
                program.value_by_name[v].meta.nbytes() for v in seg.outputs if v in program.value_by_name
            )
            live[key] = live.get(key, 0) + size
            current += size
            peak = max(peak, current)
        elif ins.phase in (Phase.B, Phase.BW):  # BI keeps what BW still needs
            current -= live.pop(key, 0)
    return peak
