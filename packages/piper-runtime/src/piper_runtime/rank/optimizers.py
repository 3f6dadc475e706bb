"""``OPTIMIZER`` instructions: one torch optimizer per stage segment with parameters.

An optimizer steps what ``DataParallel.optimizer_params`` names (the shards of buckets whose
optimizer state is sharded, so that state is sharded too), or else the parameters of the
segment's module that it owns (one optimizer per tensor: holders of a tied parameter that
share it on a rank leave it to the first). With ``keep_grads`` the gradients it is about to
consume are copied into the step's report first; a non-finite one among them is reported in
``StepState.nonfinite`` (``piper_runtime.numerics``). The step holds the rank's gradient lock.

Weight decay goes by parameter (``OptimizerSpec.decays``: by full name and dimensions), so a
bucket shard that mixes parameters that decay and parameters that do not (a weight and its
bias flattened together) is stepped as *pieces*: one ``nn.Parameter`` per run of elements of
one kind, each a view of the shard (updating a piece updates the shard, and through it the
parameters), whose gradient is the same view of the shard's gradient, set just before the
step. A shard of one kind is stepped whole. Every element then gets exactly the update the
single-device optimizer gives it.

``set_lr`` sets every group's learning rate (the driver's schedule, sent with each step);
``gradients`` are the tensors a step consumes (what gradient clipping scales).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

import torch
from torch import nn

from piper_ir import Instruction, Program, SegmentRole
from piper_runtime.backends.base import used_on_this_lane
from piper_runtime.numerics import nonfinite_grad
from piper_runtime.optim import OptimizerSpec
from piper_runtime.rank.buckets import BucketState
from piper_runtime.rank.data_parallel import DataParallel
from piper_runtime.rank.state import StepState

Piece = tuple[nn.Parameter, nn.Parameter, int, int]  # (piece, its shard, start, stop in the shard)


class Optimizers:
    """The optimizers of one rank's segments (module doc)."""

    def __init__(
        self,
        program: Program,
        modules: Mapping[str, nn.Module],
        spec: OptimizerSpec,
        data_parallel: DataParallel,
        grads_lock: threading.RLock,
    ) -> None:
        self.data_parallel = data_parallel
        self.grads_lock = grads_lock
        self.by_segment: dict[str, torch.optim.Optimizer] = {}
        self.pieces: dict[str, list[Piece]] = {}
        self.sources: dict[str, list[nn.Parameter]] = {}  # what each optimizer's gradients live on
        shards = {id(b.shard): b for b in data_parallel.buckets.values() if b.shard is not None}
        self.names = {id(p): q for m in modules.values() for q, p in m.named_parameters()}
        for sid, module in modules.items():
            params = data_parallel.optimizer_params(sid)
            if program.segment_by_id[sid].role is not SegmentRole.STAGE or not params:
                continue
            names = {id(p): n for n, p in module.named_parameters()}
            entries: list[tuple[torch.Tensor, bool]] = []
            pieces: list[Piece] = []
            for p in params:
                bucket = shards.get(id(p))
                if bucket is None:
                    entries.append((p, spec.decays(names[id(p)], p.dim())))
                    continue
                runs = _decay_runs(bucket, spec)
                if len(runs) == 1:
                    entries.append((p, runs[0][2]))
                    continue
                for start, stop, decay in runs:
                    piece = nn.Parameter(p.detach()[start:stop])
                    pieces.append((piece, p, start, stop))
                    entries.append((piece, decay))
            self.by_segment[sid] = spec.build_groups(entries)
            self.pieces[sid] = pieces
            self.sources[sid] = list(params)

    def __call__(self, ins: Instruction, st: StepState) -> None:
        opt = self.by_segment.get(ins.segment)
        if opt is None:
            return
        with self.grads_lock:
            if st.keep_grads:
                self.data_parallel.report_grads(ins.segment, st)
            for piece, shard, start, stop in self.pieces[ins.segment]:
                piece.grad = None if shard.grad is None else shard.grad[start:stop]
            bad = nonfinite_grad((p for group in opt.param_groups for p in group["params"]), self.names)
            if bad is not None:
                st.nonfinite.append(f"segment {ins.segment}, parameter {bad}")
            opt.step()
            # Gradients another lane allocated (a bucket's reduction) are freed here: keep
            # them until this lane's step has read them (GPU backends; nothing on the host).
            used_on_this_lane(*(p.grad for group in opt.param_groups for p in group["params"]))
            opt.zero_grad(set_to_none=True)
            for p in self.sources[ins.segment]:
                p.grad = None

    def set_lr(self, lr: float) -> None:
        """Every group of every optimizer steps with learning rate ``lr`` from now on."""
        for opt in self.by_segment.values():
            for group in opt.param_groups:
                group["lr"] = lr

    def gradients(self) -> list[torch.Tensor]:
        """The gradients the next steps consume (under the gradient lock)."""
        return [p.grad for params in self.sources.values() for p in params if p.grad is not None]

    def state_tensors(self) -> list[torch.Tensor]:
        """Every tensor in the optimizers' state (for memory accounting)."""
        return [
            t
            for opt in self.by_segment.values()
            for per_param in list(opt.state.values())
            for t in list(per_param.values())
            if isinstance(t, torch.Tensor)
        ]


def _decay_runs(bucket: BucketState, spec: OptimizerSpec) -> list[tuple[int, int, bool]]:
    """``(start, stop, decays)`` runs of this replica's shard of ``bucket``, relative to the
    shard; the zero padding joins the run before it (it stays zero either way)."""
    lo, hi = bucket.layout.shard_range(bucket.replica)
    runs: list[tuple[int, int, bool]] = []
    for name, p, at, n in zip(
        bucket.bucket.params, bucket.params, bucket.layout.offsets, bucket.layout.numels, strict=True
    ):
        a, b = max(at, lo), min(at + n, hi)
        if a >= b:
            continue
        decay = spec.decays(name, p.dim())
        if runs and runs[-1][2] == decay and runs[-1][1] == a - lo:
            runs[-1] = (runs[-1][0], b - lo, decay)
        else:
            runs.append((a - lo, b - lo, decay))
    if not runs:  # a shard of padding only
        return [(0, hi - lo, False)]
    runs[-1] = (runs[-1][0], hi - lo, runs[-1][2])
    return runs
