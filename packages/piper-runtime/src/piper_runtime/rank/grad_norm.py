"""``GRAD_NORM`` instructions: the global gradient norm of a step, and clipping by it.

What this rank counts is data of the program (``Program.grad_norm.terms_of(rank)``, derived
by ``piper_memory.add_grad_norm`` so that every gradient element of the model is counted on
exactly one rank): whole parameter gradients, or element ranges of a bucket's gradient
shard. The rank sums their squares (in float64), the instruction's communicator sums that
number over the world, and the square root is the norm ``torch.nn.utils.clip_grad_norm_``
computes on one device. With ``GradNorm.max_norm`` set, every gradient the rank's optimizers
are about to step is multiplied by ``max_norm / (norm + 1e-6)`` when that is below 1, as
torch does. The norm (before clipping) is the step's ``grad_norm``.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Mapping

import torch
from torch import nn

from piper_ir import ExecutionError, Instruction, NormTerm, Program
from piper_runtime.rank.comms import Communicators
from piper_runtime.rank.data_parallel import DataParallel
from piper_runtime.rank.state import StepState

EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s


class GradNorm:
    """This rank's share of the gradient norm (module doc)."""

    def __init__(
        self,
        program: Program,
        rank: int,
        modules: Mapping[str, nn.Module],
        data_parallel: DataParallel,
        gradients: Callable[[], list[torch.Tensor]],
        grads_lock: threading.RLock,
        device: torch.device,
    ) -> None:
        spec = program.grad_norm
        self.max_norm = spec.max_norm if spec is not None else None
        self.gradients = gradients
        self.grads_lock = grads_lock
        self.device = device
        self.comms: Communicators | None = None
        self.pieces = [_resolve(rank, t, modules, data_parallel) for t in (spec.terms_of(rank) if spec else ())]

    def connect(self, comms: Communicators) -> None:
        self.comms = comms

    def __call__(self, ins: Instruction, st: StepState) -> None:
        with self.grads_lock:
            total = torch.zeros(1, dtype=torch.float64, device=self.device)
            for piece in self.pieces:
                for g in piece():
                    total += torch.linalg.vector_norm(g, dtype=torch.float64).square()
        self.comms[ins.communicator].all_reduce(total)
        norm = math.sqrt(float(total.item()))
        st.grad_norm = norm
        if self.max_norm is None:
            return
        coef = self.max_norm / (norm + EPS)
        if coef < 1.0:
            with self.grads_lock:
                for g in self.gradients():
                    g.mul_(coef)


def _resolve(
    rank: int, term: NormTerm, modules: Mapping[str, nn.Module], data_parallel: DataParallel
) -> Callable[[], list[torch.Tensor]]:
    """A function returning the gradient pieces ``term`` names (none while a gradient is unset)."""
    where = f"rank {rank}: the gradient norm counts"
    if term.param is not None:
        module = modules.get(term.segment)
        try:
            param = module.get_parameter(term.param) if module is not None else None
        except AttributeError:
            param = None
        if param is None:
            raise ExecutionError(f"{where} parameter {term.param} of segment {term.segment}, not on this rank", ranks=(rank,))
        return lambda: [] if param.grad is None else [param.grad]
    bucket = data_parallel.buckets.get(term.bucket or "")
    if bucket is None or bucket.shard is None:
        raise ExecutionError(f"{where} a shard of bucket {term.bucket}, which this rank does not shard", ranks=(rank,))
    shard, ranges = bucket.shard, term.ranges
    if any(b > shard.numel() for _, b in ranges):
        raise ExecutionError(f"{where} elements {list(ranges)} of a {shard.numel()}-element shard of {term.bucket}", ranks=(rank,))
    return lambda: [] if shard.grad is None else [shard.grad[a:b] for a, b in ranges]
