"""``OPTIMIZER`` instructions: one torch optimizer per stage segment with parameters.

An optimizer steps what ``DataParallel.optimizer_params`` names (the shards of buckets whose
optimizer state is sharded, so that state is sharded too), or else the parameters of the
segment's module that it owns (one optimizer per tensor: holders of a tied parameter that
share it on a rank leave it to the first). With ``keep_grads`` the gradients it is about to consume are copied into
the step's report first. The step holds the rank's gradient lock.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

import torch
from torch import nn

from piper_ir import Instruction, Program, SegmentRole
from piper_runtime.data_parallel import DataParallel
from piper_runtime.optim import OptimizerSpec
from piper_runtime.state import StepState


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
        for sid in modules:
            params = data_parallel.optimizer_params(sid)
            if program.segment_by_id[sid].role is SegmentRole.STAGE and params:
                self.by_segment[sid] = spec.build(params)

    def __call__(self, ins: Instruction, st: StepState) -> None:
        opt = self.by_segment.get(ins.segment)
        if opt is None:
            return
        with self.grads_lock:
            if st.keep_grads:
                self.data_parallel.report_grads(ins.segment, st)
            opt.step()
            opt.zero_grad(set_to_none=True)

    def state_tensors(self) -> list[torch.Tensor]:
        """Every tensor in the optimizers' state (for memory accounting)."""
        return [
            t
            for opt in self.by_segment.values()
            for per_param in list(opt.state.values())
            for t in list(per_param.values())
            if isinstance(t, torch.Tensor)
        ]
