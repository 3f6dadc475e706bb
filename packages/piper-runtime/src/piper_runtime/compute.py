"""``COMPUTE`` instructions: a segment's forward and its backward passes, with autograd.

Each segment runs as its own autograd graph: a segment's floating inputs that need
gradients are detached leaves, so its backward stops at its boundary and yields
``grad:<input>`` values that the plan sends or hands to the producing segment.

A split backward runs in two instructions: ``BI`` computes only the gradients of the
segment's inputs (``torch.autograd.grad`` with the autograd graph retained) and ``BW`` then
runs the backward towards the segment's parameters on that retained graph, accumulating into
their ``.grad`` and releasing the graph. No custom autograd function is needed in the model.

The loss of one shard of a microbatch is scaled by ``1 / (microbatches * replicas)`` for
backward here, exactly once. Backward passes hold the rank's gradient lock (autograd writes
``.grad`` without the GIL, so no other thread may read or replace one meanwhile); the passes
that write parameter gradients (``B``, ``BW``) run inside ``weight_pass(segment)``, where the
buckets whose gradients live sharded are reduce-scattered as they complete. What autograd
saves for a backward is tracked by weak reference (``StepState.autograd_saved``), for the
memory accounting only, in accounted steps only (``StepState.accounted``): it never keeps a
tensor alive.

``forward_only`` (a plan without backward passes: an evaluation step) runs forwards without
autograd and keeps nothing for a backward.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager

import torch
from torch import nn

from piper_ir import Instruction, Phase, Program, SegmentRole, grad_name
from piper_runtime.state import StepState

COMPUTE_PHASES = frozenset({Phase.F, Phase.B, Phase.BI, Phase.BW})


class SegmentCompute:
    """Runs the ``COMPUTE`` instructions of one rank (module doc)."""

    def __init__(
        self,
        program: Program,
        modules: Mapping[str, nn.Module],
        grads_lock: threading.RLock,
        weight_pass: Callable[[str], AbstractContextManager[None]],
        forward_only: bool = False,
    ) -> None:
        self.program = program
        self.modules = modules
        self.grads_lock = grads_lock
        self.weight_pass = weight_pass
        self.forward_only = forward_only

    def __call__(self, ins: Instruction, st: StepState) -> None:
        if ins.phase is Phase.F:
            self.forward(ins, st)
            return
        run = {Phase.B: self.backward, Phase.BI: self.backward_input, Phase.BW: self.backward_weight}[ins.phase]
        with self.grads_lock:
            run(ins, st)

    def forward(self, ins: Instruction, st: StepState) -> None:
        if self.forward_only:
            self.evaluate(ins, st)
            return
        seg = self.program.segment_by_id[ins.segment]
        mb = ins.microbatch
        args = []
        for name in seg.inputs:
            t = st.get(name, mb)
            if t.is_floating_point() and self.program.value_by_name[name].meta.requires_grad:
                t = t.detach().requires_grad_(True)
            args.append(t)
        if st.accounted:
            saved: list[weakref.ref] = []

            def pack(t: torch.Tensor) -> torch.Tensor:
                # A detached alias (not ``t`` itself: saving an op's own output would make a
                # reference cycle through its grad_fn); it shares the storage being counted.
                d = t.detach()
                saved.append(weakref.ref(d))  # autograd holds ``d``; a weak reference never extends it
                return d

            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = self.modules[seg.id](*args)
            st.autograd_saved[(seg.id, mb)] = saved
        else:  # no accounting: autograd keeps what it saves without a Python call per tensor
            with torch.enable_grad():
                out = self.modules[seg.id](*args)
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

    def evaluate(self, ins: Instruction, st: StepState) -> None:
        """F without autograd: outputs (and the loss) only."""
        seg = self.program.segment_by_id[ins.segment]
        mb = ins.microbatch
        with torch.no_grad():
            out = self.modules[seg.id](*(st.get(name, mb) for name in seg.inputs))
        if seg.role is SegmentRole.LOSS:
            if not isinstance(out, torch.Tensor) or out.numel() != 1:
                raise TypeError(f"the loss module must return a scalar tensor, got {_describe(out)}")
            st.losses[mb] = float(out)
            for name in seg.outputs:
                st.values[(name, mb)] = out.clone()
            return
        outs = (out,) if isinstance(out, torch.Tensor) else tuple(out)
        if len(outs) != len(seg.outputs):
            raise TypeError(f"segment {seg.id} must return {len(seg.outputs)} tensors {list(seg.outputs)}, got {_describe(out)}")
        for name, o in zip(seg.outputs, outs, strict=True):
            st.values[(name, mb)] = o

    def _backward_roots(
        self, ins: Instruction, st: StepState
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

    def backward(self, ins: Instruction, st: StepState) -> None:
        """B: input and parameter gradients in one pass."""
        seg = self.program.segment_by_id[ins.segment]
        mb = ins.microbatch
        args, tensors, grads = self._backward_roots(ins, st)
        if tensors:
            with self.weight_pass(seg.id):
                torch.autograd.backward(tensors, grads)
        st.autograd_saved.pop((seg.id, mb), None)
        for name, a in zip(seg.inputs, args, strict=True):
            if a.requires_grad:
                g = a.grad if a.grad is not None else torch.zeros_like(a)
                st.add_grad(grad_name(name), mb, g)

    def backward_input(self, ins: Instruction, st: StepState) -> None:
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

    def backward_weight(self, ins: Instruction, st: StepState) -> None:
        """BW: the parameter gradients from the graph BI retained, accumulated into ``.grad``;
        the graph (and the activations it saved) is released afterwards."""
        key = (ins.segment, ins.microbatch)
        try:
            tensors, grads = st.pending_bw.pop(key)
        except KeyError:
            raise RuntimeError(
                f"weight backward of {ins.segment} microbatch {ins.microbatch} before its input backward"
            ) from None
        params = [p for p in self.modules[ins.segment].parameters() if p.requires_grad]
        if tensors and params:
            # ``inputs=params`` restricts the pass to what the weight gradients need; without
            # retain_graph the saved tensors are freed as the pass goes.
            with self.weight_pass(ins.segment):
                torch.autograd.backward(tensors, grads, inputs=params)
        st.autograd_saved.pop(key, None)


def _describe(out: object) -> str:
    if isinstance(out, torch.Tensor):
        return f"a tensor of shape {tuple(out.shape)}"
    return type(out).__name__
