"""``OPTIMIZER`` instructions: one torch optimizer per stage segment with parameters.

An optimizer steps what ``DataParallel.optimizer_params`` names (the shards of buckets whose
optimizer state is sharded, so that state is sharded too), or else every parameter of the
segment's module. With ``keep_grads`` the gradients it is about to consume are copied into
the step's report first; a non-finite one among them is reported in ``StepState.nonfinite``
(``piper_runtime.numerics``). The step holds the rank's gradient lock.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

import torch
from torch import nn

from piper_ir import Instruction, Program, SegmentRole
from piper_runtime.backends.base import used_on_this_lane
from piper_runtime.data_parallel import DataParallel
from piper_runtime.numerics import nonfinite_grad
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
        self.names = {id(p): q for m in modules.values() for q, p in m.named_parameters()}
        for sid, module in modules.items():
            params = data_parallel.optimizer_params(sid)
            if params is None:
                params = [p for p in module.parameters() if p.requires_grad]
            if program.segment_by_id[sid].role is SegmentRole.STAGE and params:
                self.by_segment[sid] = spec.build(params)

    def __call__(self, ins: Instruction, st: StepState) -> None:
        opt = self.by_segment.get(ins.segment)
        if opt is None:
            return
        with self.grads_lock:
            if st.keep_grads:
                self.data_parallel.report_grads(ins.segment, st)
            bad = nonfinite_grad((p for group in opt.param_groups for p in group["params"]), self.names)
            if bad is not None:
                st.nonfinite.append(f"segment {ins.segment}, parameter {bad}")
            opt.step()
            # Gradients another lane allocated (a bucket's reduction) are freed here: keep
            # them until this lane's step has read them (GPU backends; nothing on the host).
            used_on_this_lane(*(p.grad for group in opt.param_groups for p in group["params"]))
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
