"""``COMPUTE`` instructions: a segment's forward and its backward passes, with autograd.

Each segment runs as its own autograd graph: a segment's floating inputs that need
gradients are detached leaves, so its backward stops at its boundary and yields
``grad:<input>`` values that the plan sends or hands to the producing segment.

A split backward runs in two instructions: ``BI`` computes only the gradients of the
segment's inputs (``torch.autograd.grad`` with the autograd graph retained) and ``BW`` then
runs the backward towards the segment's parameters on that retained graph, accumulating into
their ``.grad`` and releasing the graph. No custom autograd function is needed in the model.

Every forward draws its random numbers for (segment, microbatch, step, replica)
(``piper_runtime.rank.randomness``) and, with ``Program.precision``, a stage segment computes on
cast copies of its parameters (``piper_runtime.rank.precision``). A segment marked
``Segment.recompute`` runs its forward without autograd and keeps only its inputs; its
``B``/``BI`` first runs the forward again with autograd under the same key and casts, so the
outputs, and the gradients, are the same as without recomputation.

The loss of one shard of a microbatch is scaled by ``1 / (microbatches * replicas)`` for
backward here, exactly once (a batch cut into unequal pieces: by the piece's share of the
batch's samples, ``StepState.divisors``). Backward passes hold the rank's gradient lock (autograd writes
``.grad`` without the GIL, so no other thread may read or replace one meanwhile); the passes
that write parameter gradients (``B``, ``BW``) run inside ``weight_pass(segment)``, where the
buckets whose gradients live sharded are reduce-scattered as they complete. What autograd
saves for a backward is tracked by weak reference (``StepState.autograd_saved``), for the
memory accounting only, in accounted steps only (``StepState.accounted``): it never keeps a
tensor alive.

A loss whose backward is followed directly by the backward of the stage segment that feeds
it (the last stage in 1F1B, GPipe and most schedules: ``fused_losses``) runs as one autograd
graph with that stage: the loss's forward takes the stage's outputs as they are instead of
detached leaves, and its backward runs through the stage too, in one engine call. The stage's
``B`` then has nothing left to do. The gradients are the same tensors computed by the same
kernels in the same order, so the result is bit for bit the same; what is saved is one
autograd engine call, a detached boundary and one gradient tensor per microbatch. On the
``mlp`` model's last stage the two backwards took 289 us per microbatch apart and 196 us
fused (a profiled run; ``benchmarks/bench_fusion.py --fusion loss`` times whole steps both ways).
``profile=True`` shows the stage's work inside the loss's ``B``.

A ``B`` inside a window of ``piper_runtime.rank.input_grads_first`` (``defer``) leaves the weight
products of its fused layers (``piper_runtime.rank.accumulation``) in the step's
``WeightProducts``; ``settle`` adds them into ``.grad`` once the window's sends are posted.

``forward_only`` (a plan without backward passes: an evaluation step) runs forwards without
autograd and keeps nothing for a backward; casts apply as in training, and the worker has
put the modules in eval mode (dropout draws no masks).

With ``compile`` (``ExecutionOptions.compile``, ``--compile``) a training step runs each segment
as compiled functions instead of under autograd (``piper_runtime.rank.compiled``): ``F`` keeps
its inputs and the residuals its backward reads (``StepState.saved``), ``B`` adds the weight
gradients it returns into ``.grad`` (inside ``weight_pass``), ``BI`` hands ``BW`` what it reads
(``StepState.pending_bw``), a recomputed segment runs the compiled ``F`` again under the same
key. Loss and stage backwards are not fused then. A stage's last ``B`` of the step that sends
an input gradient runs as its ``BI``, and its ``BW`` when the window's sends are posted
(``input_grads_first``, as eager defers its weight products). A
compiled backward returns the gradients of ``fused_weights`` that it computes as one matrix
product as that product's operands (``WeightProduct``), added into ``.grad`` with one
``addmm_``, the others whole. Evaluation steps run eagerly.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from functools import partial

import torch
from torch import nn

from piper_ir import Instruction, NodeKind, Phase, Program, Segment, SegmentRole, grad_name
from piper_memory.store import accumulate_grad
from piper_runtime.rank.accumulation import deferring, fused_weights, has_fused_layers
from piper_runtime.rank.compiled import CompiledSegment, CompileError, CompileStats, WeightProduct, signature
from piper_runtime.rank.precision import cast_forward, dtype_of
from piper_runtime.rank.randomness import SeededForwards
from piper_runtime.rank.state import StepState

COMPUTE_PHASES = frozenset({Phase.F, Phase.B, Phase.BI, Phase.BW})


def fused_losses(program: Program, instructions: Sequence[Instruction]) -> dict[tuple[str, int], str]:
    """(loss segment, microbatch) -> the stage segment whose backward runs inside the loss's
    (module doc). A pair qualifies where the loss's ``B`` is followed directly, in the rank's
    plan and on the same stream, by the stage's ``B`` for the same microbatch (so no other
    gradient accumulates in between, and the order of accumulation stays the plan's), neither
    in an overlapped slot; the stage's ``B`` waits for no event (under ZeRO-2/3 it waits for
    the previous microbatch's reduce-scatter of its buckets, which must not be overtaken);
    the loss has no parameters and neither is recomputed; every input
    of the loss that takes a gradient is an output of that stage, and every output of the
    stage goes to that loss only."""
    producer = {name: seg.id for seg in program.segments for name in seg.outputs}
    consumers: dict[str, set[str]] = {}
    for seg in program.segments:
        for name in seg.inputs:
            consumers.setdefault(name, set()).add(seg.id)
    pairs: dict[tuple[str, int], str] = {}
    for a, b in zip(instructions, instructions[1:], strict=False):
        if not (
            a.kind is NodeKind.COMPUTE and b.kind is NodeKind.COMPUTE and a.phase is Phase.B and b.phase is Phase.B
            and a.microbatch == b.microbatch and a.stream == b.stream and a.overlap is None and b.overlap is None
            and not b.waits
        ):
            continue
        loss, stage = program.segment_by_id[a.segment], program.segment_by_id[b.segment]
        if loss.role is not SegmentRole.LOSS or stage.role is not SegmentRole.STAGE:
            continue
        if loss.params or loss.recompute or stage.recompute:
            continue
        differentiable = [n for n in loss.inputs if program.value_by_name[n].meta.requires_grad]
        if not differentiable or any(producer.get(n) != stage.id for n in differentiable):
            continue
        if any(consumers.get(n, set()) != {loss.id} for n in stage.outputs):
            continue
        pairs[(loss.id, a.microbatch)] = stage.id
    return pairs


class SegmentCompute:
    """Runs the ``COMPUTE`` instructions of one rank (module doc)."""

    def __init__(
        self,
        program: Program,
        modules: Mapping[str, nn.Module],
        grads_lock: threading.RLock,
        weight_pass: Callable[[str], AbstractContextManager[None]],
        forward_only: bool = False,
        *,
        seed: int | None = None,
        replica: int = 0,
        device: torch.device | None = None,
        sample: Callable[[list[torch.Tensor]], None] = lambda buffers: None,
        instructions: Sequence[Instruction] = (),
        compile: str | None = None,
        fused_weights: Sequence[torch.Tensor] = (),
    ) -> None:
        self.program = program
        self.modules = modules
        self.grads_lock = grads_lock
        self.weight_pass = weight_pass
        self.forward_only = forward_only
        self.seed = seed
        self.seeding = None if seed is None else SeededForwards(seed, replica, device)
        self.replica = replica
        self.device = device
        self.sample = sample  # records memory now (a recomputed forward's activations live inside a pass)
        self.compute = dtype_of(program.precision.compute) if program.precision is not None else None
        # The rank's plan (``instructions``) says which loss backwards take their stage's along.
        self.fused = {} if forward_only or compile else fused_losses(program, instructions)
        self.fused_stages = {(stage, mb) for (_, mb), stage in self.fused.items()}
        self.deferred: frozenset[str] = frozenset()  # ids of the B instructions that defer (``defer``)
        self._fused_weights: list[torch.Tensor] | None = None  # the rank's fused layers' (on first deferral)
        self.compile = None if forward_only else compile  # a backend of ``compiled.BACKENDS`` (module doc)
        collective = [sh.segment for sh in program.sharding if sh.collectives and sh.segment in modules]
        if self.compile and collective:
            raise CompileError(f"segment {collective[0]} runs collectives inside its forward (tensor, expert or "
                               "context parallelism), which compiling cannot trace: run it without --compile")
        self.compile_stats = CompileStats()
        self.fused_weights = fused_weights  # compiled backwards add these inside their products (``compiled``)
        self._compiled: dict[tuple[str, object], CompiledSegment] = {}  # (segment, signature) -> its functions
        self._compiling = threading.Lock()  # the rank's stream threads compile a segment once
        self._split: dict[tuple[str, int], CompiledSegment] = {}  # (segment, microbatch) between BI and BW

    # -- input gradients first (``piper_runtime.rank.input_grads_first``) ----------------------------

    def defers(self, ins: Instruction) -> bool:
        """Whether ``ins``'s backward pass runs through layers whose weight products can wait;
        compiled, whether it is a stage segment's with weights to train (its ``BI`` runs in the
        pass, its ``BW`` when the window settles)."""
        if self.forward_only:
            return False
        if self.compile:
            return (self.program.segment_by_id[ins.segment].role is SegmentRole.STAGE
                    and any(p.requires_grad for p in self.modules[ins.segment].parameters()))
        seg = self.fused.get((ins.segment, ins.microbatch), ins.segment)
        return has_fused_layers(self.modules[seg])

    def passes_with(self, first: Instruction, other: Instruction) -> bool:
        """Whether ``first``'s backward pass is ``other``'s too (a fused loss and its stage)."""
        return other.microbatch == first.microbatch and self.fused.get((first.segment, first.microbatch)) == other.segment

    def defer(self, instructions: Sequence[Instruction], windows: Mapping[int, tuple[int, ...]]) -> None:
        """Let the ``B``s of ``windows`` (``deferral_windows``) leave their weight products."""
        self.deferred = frozenset(instructions[k].id for passes in windows.values() for k in passes)

    def settle(self, st: StepState) -> None:
        """Add the weight products a window's backward left into ``.grad``."""
        if st.weight_products:
            with self.grads_lock:
                st.weight_products.settle()

    def _seeded(self, segment: str, mb: int, step: int, training: bool) -> AbstractContextManager[None]:
        """The forward's random numbers drawn for (segment, microbatch, step, replica), unless
        ``seed`` is ``None`` (the process's generators as they are) or it draws none
        (``SeededForwards``: then no lock, so the ranks of one process compute side by side)."""
        return nullcontext() if self.seeding is None else self.seeding.forward(segment, mb, step, training)

    def _run(self, seg: Segment, mb: int, step: int, args: list[torch.Tensor]) -> object:
        """The segment's module on ``args``, its random numbers drawn for (segment,
        microbatch, step, replica) (unless ``seed`` is ``None``: the process's generators as
        they are) and, with a precision, stage segments in the compute dtype."""
        module = self.modules[seg.id]
        with self._seeded(seg.id, mb, step, module.training):
            if self.compute is not None and seg.role is SegmentRole.STAGE:
                return cast_forward(module, args, self.compute)
            return module(*args)

    def __call__(self, ins: Instruction, st: StepState) -> None:
        if ins.phase is Phase.F:
            self.forward(ins, st)
            return
        run = {Phase.B: self.backward, Phase.BI: self.backward_input, Phase.BW: self.backward_weight}[ins.phase]
        if self.compile:
            run = {Phase.B: self._compiled_backward, Phase.BI: self._compiled_backward,
                   Phase.BW: self._compiled_weight}[ins.phase]
        with self.grads_lock:
            run(ins, st)

    def forward(self, ins: Instruction, st: StepState) -> None:
        if self.forward_only:
            self.evaluate(ins, st)
            return
        if self.compile:
            self._compiled_forward(ins, st)
            return
        seg = self.program.segment_by_id[ins.segment]
        mb = ins.microbatch
        attached = self._attached_outputs(seg, mb, st)
        args = []
        for name in seg.inputs:
            if name in attached:
                args.append(attached[name])
                continue
            t = st.get(name, mb)
            if t.is_floating_point() and self.program.value_by_name[name].meta.requires_grad:
                t = t.detach().requires_grad_(True)
            args.append(t)
        if seg.recompute and seg.role is SegmentRole.STAGE:
            # Only the inputs outlive the forward; the backward runs it again (``_recompute``).
            with torch.no_grad():
                out = self._run(seg, mb, st.step, args)
            st.autograd_saved[(seg.id, mb)] = []
        else:
            out = self._tracked(seg, mb, st, args)
        if seg.role is SegmentRole.LOSS:
            if not isinstance(out, torch.Tensor) or out.numel() != 1:
                raise TypeError(f"the loss module must return a scalar tensor, got {_describe(out)}")
            st.losses[mb] = float(out.detach())
            outs: tuple[torch.Tensor, ...] = (out / self._divisor(mb, st),)
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
        st.saved[(seg.id, mb)] = (args, None if seg.recompute and seg.role is SegmentRole.STAGE else outs)

    def _divisor(self, mb: int, st: StepState) -> float:
        """What the loss of microbatch ``mb`` is divided by for backward, exactly once: the
        microbatches times the data-parallel replicas (M * N); for a batch cut into unequal
        pieces, the batch's samples over the piece's (``batch.loss_divisors``)."""
        return self.program.microbatches * self.program.replicas if st.divisors is None else st.divisors[mb]

    def _attached_outputs(self, seg: Segment, mb: int, st: StepState) -> dict[str, torch.Tensor]:
        """For a fused loss (module doc): its stage's outputs as the stage's forward made
        them, by name; empty where the pair is not fused, or where an output is not the
        result of a differentiable operation (then the loss takes detached leaves, as
        unfused, and the stage's ``B`` runs on its own)."""
        stage = self.fused.get((seg.id, mb))
        saved = None if stage is None else st.saved.get((stage, mb))
        if saved is None or saved[1] is None:
            return {}
        outputs = dict(zip(self.program.segment_by_id[stage].outputs, saved[1], strict=True))
        if any(t.grad_fn is None for t in outputs.values()):
            return {}
        return outputs

    def _tracked(self, seg: Segment, mb: int, st: StepState, args: list[torch.Tensor]) -> object:
        """``_run`` with autograd on, what it saves for backward tracked for the accounting in
        an accounted step (``StepState.accounted``; otherwise autograd keeps what it saves
        without a Python call per tensor)."""
        if not st.accounted:
            with torch.enable_grad():
                return self._run(seg, mb, st.step, args)
        saved: list[weakref.ref] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            # A detached alias (not ``t`` itself: saving an op's own output would make a
            # reference cycle through its grad_fn); it shares the storage being counted.
            d = t.detach()
            saved.append(weakref.ref(d))  # autograd holds ``d``; a weak reference never extends it
            return d

        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = self._run(seg, mb, st.step, args)
        st.autograd_saved[(seg.id, mb)] = saved
        return out

    def _recompute(self, seg: Segment, mb: int, st: StepState, args: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """The forward of a recomputed segment again, with autograd, drawing the same random
        numbers (same key) in the same dtypes: its outputs equal the first forward's."""
        out = self._tracked(seg, mb, st, args)
        outs = (out,) if isinstance(out, torch.Tensor) else tuple(out)
        if st.accounted:
            st.saved[(seg.id, mb)] = (args, outs)  # held while the pass runs: the accounting sees them
            self.sample([])
            del st.saved[(seg.id, mb)]
        return outs

    def evaluate(self, ins: Instruction, st: StepState) -> None:
        """F without autograd: outputs (and the loss) only."""
        seg = self.program.segment_by_id[ins.segment]
        mb = ins.microbatch
        with torch.no_grad():
            out = self._run(seg, mb, st.step, [st.get(name, mb) for name in seg.inputs])
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
        if outs is None:  # a recomputed segment kept only its inputs
            outs = self._recompute(seg, mb, st, args)
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
        if (seg.id, mb) in self.fused_stages and (seg.id, mb) not in st.saved:
            return  # the loss's B ran this pass already (module doc)
        stage = self.fused.get((seg.id, mb))
        if stage is not None and any(a.grad_fn is not None for a in st.saved.get((seg.id, mb), ((), None))[0]):
            self._fused_backward(ins, self.program.segment_by_id[stage], mb, st)
            return
        args, tensors, grads = self._backward_roots(ins, st)
        if tensors:
            with self.weight_pass(seg.id), self._deferring(ins, st):
                torch.autograd.backward(tensors, grads)
        st.autograd_saved.pop((seg.id, mb), None)
        for name, a in zip(seg.inputs, args, strict=True):
            if a.requires_grad:
                g = a.grad if a.grad is not None else torch.zeros_like(a)
                st.add_grad(grad_name(name), mb, g)

    def _deferring(self, ins: Instruction, st: StepState) -> AbstractContextManager[None]:
        """Around ``ins``'s pass: its fused layers' weight products wait in the step's
        ``WeightProducts`` if ``ins`` is in a window; an accounted step counts them."""
        if ins.id not in self.deferred:
            return nullcontext()
        if self._fused_weights is None:
            self._fused_weights = fused_weights(self.modules)
        return _deferred_pass(st, self._fused_weights, self.sample if st.accounted else None)

    def _fused_backward(self, ins: Instruction, stage: Segment, mb: int, st: StepState) -> None:
        """The loss's B and its stage's in one pass: from the scaled loss through the stage,
        whose inputs' gradients are handed on as the stage's own B would."""
        _, outs = st.saved.pop((ins.segment, mb))
        stage_args, _ = st.saved.pop((stage.id, mb))
        with self.weight_pass(stage.id), self._deferring(ins, st):
            torch.autograd.backward(list(outs))
        st.autograd_saved.pop((ins.segment, mb), None)
        st.autograd_saved.pop((stage.id, mb), None)
        for name, a in zip(stage.inputs, stage_args, strict=True):
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

    # -- compiled segments (module doc; ``piper_runtime.rank.compiled``) -----------------------------

    def _functions(self, seg: Segment, args: list[torch.Tensor]) -> CompiledSegment:
        """``seg``'s compiled functions for inputs like ``args``: compiled on first use, kept
        for the run (one entry per input signature: a program per piece shape compiles once
        per shape, not per microbatch)."""
        grads = [a.is_floating_point() and self.program.value_by_name[n].meta.requires_grad
                 for n, a in zip(seg.inputs, args, strict=True)]
        key = (seg.id, signature(args, grads))
        found = self._compiled.get(key)
        if found is not None:
            return found
        with self._compiling:
            found = self._compiled.get(key)
            if found is None:
                cast = self.compute if seg.role is SegmentRole.STAGE else None
                found = CompiledSegment(seg.id, self.modules[seg.id], args, grads, self.compile or "inductor",
                                        self.compile_stats, cast, self.fused_weights)
                self._compiled[key] = found
        return found

    def _compiled_run(self, functions: CompiledSegment, seg: Segment, mb: int, step: int,
                      args: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The compiled F, drawing its random numbers for (segment, microbatch, step, replica)."""
        with self._seeded(seg.id, mb, step, self.modules[seg.id].training):
            return functions.forward(args)

    def _compiled_forward(self, ins: Instruction, st: StepState) -> None:
        seg = self.program.segment_by_id[ins.segment]
        mb = ins.microbatch
        args = [st.get(name, mb) for name in seg.inputs]
        functions = self._functions(seg, args)
        outs, residuals = self._compiled_run(functions, seg, mb, st.step, args)
        if seg.role is SegmentRole.LOSS:
            if len(outs) != 1 or outs[0].numel() != 1:
                raise TypeError(f"the loss module must return a scalar tensor, got {len(outs)} tensors")
            st.losses[mb] = float(outs[0])
            for name in seg.outputs:
                st.values[(name, mb)] = outs[0].clone()
        else:
            if len(outs) != len(seg.outputs):
                raise TypeError(f"segment {seg.id} must return {len(seg.outputs)} tensors {list(seg.outputs)}, "
                                f"got {len(outs)}")
            for name, o in zip(seg.outputs, outs, strict=True):
                st.values[(name, mb)] = o
        # A recomputed segment keeps its inputs only; the others their residuals too.
        st.saved[(seg.id, mb)] = (args, None if seg.recompute and seg.role is SegmentRole.STAGE else tuple(residuals))

    def _compiled_backward(self, ins: Instruction, st: StepState) -> None:
        """B (input and weight gradients) or BI (input gradients; what BW reads is kept)."""
        seg = self.program.segment_by_id[ins.segment]
        mb = ins.microbatch
        try:
            args, residuals = st.saved.pop((seg.id, mb))
        except KeyError:
            raise RuntimeError(f"backward of {seg.id} microbatch {mb} before its forward") from None
        functions = self._functions(seg, args)
        if residuals is None:  # recomputed: the same forward again, same key, same random numbers
            _, again = self._compiled_run(functions, seg, mb, st.step, args)
            residuals = tuple(again)
        if seg.role is SegmentRole.LOSS:
            grads: list[torch.Tensor | None] = [
                torch.ones(v.shape, dtype=v.dtype, device=v.device) / self._divisor(mb, st)
                for v in functions.tangent_vals
            ]
        else:
            grads = [st.values.get((grad_name(name), mb))
                     for name, takes in zip(seg.outputs, functions.takes_grad, strict=True) if takes]
            if grads and all(g is None for g in grads):
                raise RuntimeError(f"no gradient is available for any output of {seg.id} {list(seg.outputs)}")
        tangents = functions.tangents(grads)
        wanted = [(name, a) for name, a in zip(seg.inputs, args, strict=True)
                  if a.is_floating_point() and self.program.value_by_name[name].meta.requires_grad]
        if ins.phase is Phase.BI:
            input_grads, pending = functions.backward_input(list(residuals), tangents)
            st.pending_bw[(seg.id, mb)] = (pending, None)
            self._split[(seg.id, mb)] = functions
        elif ins.id in self.deferred:  # the input gradients now, the weights' when the window settles
            input_grads, pending = functions.backward_input(list(residuals), tangents)
            st.weight_products.later.append(partial(self._compiled_weights_of, functions, pending, seg.id))
        else:
            input_grads, weight_grads = functions.backward(list(residuals), tangents)
            with self.weight_pass(seg.id):
                _accumulate(functions.params, weight_grads)
        for (name, a), g in zip(wanted, input_grads, strict=True):
            st.add_grad(grad_name(name), mb, g if g is not None else torch.zeros_like(a))

    def _compiled_weights_of(self, functions: CompiledSegment, pending: list[torch.Tensor], segment: str) -> None:
        """A deferred compiled ``B``'s weight pass (``settle``): its ``BW``, added into ``.grad``."""
        weight_grads = functions.backward_weight(pending)
        with self.weight_pass(segment):
            _accumulate(functions.params, weight_grads)

    def _compiled_weight(self, ins: Instruction, st: StepState) -> None:
        """BW: the weight gradients from what BI kept, added into ``.grad``."""
        key = (ins.segment, ins.microbatch)
        try:
            pending, _ = st.pending_bw.pop(key)
            functions = self._split.pop(key)
        except KeyError:
            raise RuntimeError(
                f"weight backward of {ins.segment} microbatch {ins.microbatch} before its input backward"
            ) from None
        weight_grads = functions.backward_weight(pending)
        with self.weight_pass(ins.segment):
            _accumulate(functions.params, weight_grads)


def _accumulate(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | WeightProduct | None]) -> None:
    """Add a compiled backward's weight gradients into ``.grad`` as autograd would: a new
    ``.grad`` has its parameter's layout (a compiled kernel may return a transposed view); a
    ``WeightProduct`` is computed into it."""
    for p, g in zip(params, grads, strict=True):
        if g is None:
            continue
        if isinstance(g, WeightProduct):
            g.add_into(p)
            continue
        if p.grad is None and g.stride() != p.stride():
            g = torch.empty_like(p).copy_(g)
        accumulate_grad(p, g)


@contextmanager
def _deferred_pass(st: StepState, weights: Sequence[torch.Tensor],
                   sample: Callable[[list[torch.Tensor]], None] | None) -> Iterator[None]:
    """``deferring`` the rank's fused ``weights``' products into the step's weight products
    for one pass, then (accounted steps) a memory sample that counts what they hold."""
    with deferring(st.weight_products, weights):
        yield
    if sample is not None and st.weight_products:
        sample(st.weight_products.tensors())


def _describe(out: object) -> str:
    if isinstance(out, torch.Tensor):
        return f"a tensor of shape {tuple(out.shape)}"
    return type(out).__name__
