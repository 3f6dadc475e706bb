"""What one step keeps between instructions, and when a value may be dropped.

``StepState`` is created at the start of a step and dropped at its end; every part of the
executor reads and writes the step through it (values by ``(name, microbatch)``, saved
forwards, posted receives, unfinished sends, reported losses and gradients). The stream
threads share it: what several threads touch is changed under ``StepState.lock``.

``ReadCounts`` says, per instruction, which values it is the reader of, so a value is
dropped once every local instruction that reads it has run (in whatever order the lanes
run them).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Mapping
from typing import Any

import torch

from piper_ir import Instruction, NodeKind, Phase, Program, grad_name
from piper_runtime.rank.accumulation import WeightProducts

Key = tuple[str, int]  # (value name, microbatch)


class StepState:
    """Everything one step keeps between instructions (dropped when the step ends)."""

    def __init__(
        self, batch: Mapping[str, tuple[torch.Tensor, ...]], keep_grads: bool, step: int = 0, accounted: bool = True,
        shapes: Mapping[int, Mapping[str, tuple[int, ...]]] | None = None,
        divisors: tuple[float, ...] | None = None,
    ) -> None:
        self.batch = batch  # batch value name -> its microbatch chunks
        # A batch of other shapes than the program's (``RankLayout``): per microbatch, the
        # shapes its transfers have by instruction id (where they differ from the plan's),
        # and what each microbatch's loss is divided by (``None``: microbatches x replicas).
        self.shapes = shapes or {}
        self.divisors = divisors
        self.step = step  # the step's number, from 0 (what random numbers are drawn for)
        self.accounted = accounted  # memory accounting on: forwards track what autograd saves
        self.values: dict[Key, torch.Tensor] = {}  # activations and gradients, local or received
        # (segment, microbatch) -> a forward's inputs and outputs until its backward (outputs
        # None: the segment is recomputed, only the inputs are kept)
        self.saved: dict[Key, tuple[list[torch.Tensor], tuple[torch.Tensor, ...] | None]] = {}
        # (segment, microbatch) -> (outputs, their gradients) between a BI and its BW; the
        # outputs keep the retained autograd graph alive until BW releases it.
        self.pending_bw: dict[Key, tuple[list[torch.Tensor], list[torch.Tensor] | None]] = {}
        # weight products a backward left until its input gradient is sent (``input_grads_first``)
        self.weight_products = WeightProducts()
        self.losses: dict[int, float] = {}
        self.nonfinite: list[str] = []  # gradients found NaN/Inf before an optimizer step
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
        self.grad_norm: float | None = None  # set by the GRAD_NORM instruction
        self.lock = threading.RLock()  # shared by the stream threads
        self.reads_left: dict[Key, int] = {}  # value -> instructions still to read it

    def shape(self, ins: Instruction) -> tuple[int, ...]:
        """The shape a transfer of this step has: the plan's, or its microbatch's table's."""
        assert ins.meta is not None
        table = self.shapes.get(ins.microbatch) if ins.microbatch is not None else None
        return tuple(ins.meta.shape) if table is None else table.get(ins.id, tuple(ins.meta.shape))

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


class ReadCounts:
    """Which ``(value, microbatch)`` entries each instruction of a plan reads (module doc)."""

    def __init__(self, program: Program, instructions: tuple[Instruction, ...]) -> None:
        self.reads = _reads_of(program, instructions)
        self.counts: dict[Key, int] = {}
        for keys in self.reads.values():
            for key in keys:
                self.counts[key] = self.counts.get(key, 0) + 1

    def start(self, st: StepState) -> None:
        """Give a new step its counts."""
        st.reads_left = dict(self.counts)

    def release(self, k: int, st: StepState) -> None:
        """Forget the values instruction ``k`` was the last to read."""
        keys = self.reads.get(k)
        if not keys:  # most instructions read nothing: no lock to take
            return
        with st.lock:
            for key in keys:
                left = st.reads_left[key] - 1
                st.reads_left[key] = left
                if left == 0:
                    st.values.pop(key, None)
                    st.received.discard(key)


def _reads_of(program: Program, instructions: tuple[Instruction, ...]) -> dict[int, list[Key]]:
    """Instruction index -> the (value, microbatch) entries it reads."""
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
