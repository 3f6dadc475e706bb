"""The front door: one call from (model, example batch, loss, strategy) to a running trainer.

``Trainer`` composes the packages: capture (piper-directives) -> strategy -> tensor-parallel
rewrite of sharded segments' code (``shard_modules``) -> memory planning
(piper-memory: ZeRO reductions, gathers and frees; the gradient norm when clipping) ->
compile and verify (piper-scheduler) -> execute on a runtime (piper-runtime: Ray actors,
threads of this process, or the ranks ``torchrun``/``srun`` launched; ``runtime=``). Everything in
between is a ``piper_ir`` value, available as ``trainer.graph`` and ``trainer.program``.

The training-loop basics: the driver owns the learning-rate schedule (``TrainState.lr``) and
sends each step's learning rate with the step; gradient clipping is a ``GRAD_NORM`` node of
the program (``piper_memory.add_grad_norm``); weight decay is the ``OptimizerSpec``'s.
``evaluate`` runs a second, forward-only program (``piper_scheduler.forward_only`` of the
same graph, compiled on first use) on the same workers.

Checkpoints (``save_checkpoint``/``load_checkpoint``, docs/checkpoints.md): the ranks write
what they hold as safetensors files with a JSON index, keyed by single-device parameter
names, the driver adds the ``TrainState`` (JSON and tensors); a checkpoint loads under any
strategy, and loading one runs no code from it.
``restart`` replaces the workers (after a failure) by new ones holding the initial model.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from piper_directives import (
    ContextLayout,
    SizedStrategy,
    Strategy,
    Tensors,
    as_tensors,
    build_schedule,
    capture,
    context_degree,
    context_modules,
    context_parallel,
    device_count,
    parallelize,
    shard_modules,
)
from piper_ir import DirectiveError, Graph, Program, to_json
from piper_memory import add_grad_norm, check_budget, plan_memory
from piper_runtime import (
    BatchCut,
    OptimizerSpec,
    PendingStep,
    RunOptions,
    Signature,
    StepRequest,
    StepResult,
    TrainingRuntime,
    cut_batch,
    describe_signature,
    full_batch_shape,
    prepare_runtime,
    program_signature,
    start_runtime,
)
from piper_runtime.checkpoint import read_objects
from piper_scheduler import compile_program, forward_only
from piper_train import bounds, stopping
from piper_train.checkpoints import (
    UNTRACED,
    PendingCheckpoint,
    begin_atomically,
    check_compatible,
    read_checked,
    resolve,
    write_atomically,
)
from piper_train.flops import Throughput, step_flops
from piper_train.hardware import Hardware
from piper_train.schedule import LearningRate, LRSchedule
from piper_train.state import TrainState

if TYPE_CHECKING:
    from piper_directives import CapturedModel


def untraced_parameters(model: torch.nn.Module, traced: Mapping[str, object]) -> dict[str, torch.Tensor]:
    """The parameters of ``model`` that capture did not find in forward (a module defined
    but not called in training, a head used only in evaluation), by name, copied: no step
    gives them a gradient, so, as on one device, no optimizer changes them. ``traced``: the
    captured parameters' names; a parameter shared with one of them (a tie) is traced."""
    every = dict(model.named_parameters(remove_duplicate=False))
    traced_ids = {id(every[name]) for name in traced if name in every}
    return {name: p.detach().clone() for name, p in model.named_parameters() if id(p) not in traced_ids}


def pipeline_stages(graph: Graph, tag: str = "PP") -> int:
    """How many distinct ``tag`` regions the captured model has."""
    indices = {s.tags.get(tag) for s in graph.stage_segments()} - {None}
    if not indices:
        raise DirectiveError(f"the model has no annotate({tag!r}) region")
    return len(indices)


class Trainer:
    """Trains ``model`` with ``strategy`` on the runtime ``options.cluster.runtime`` names (Ray by default).

    ``strategy`` is a ``Strategy`` (for example ``piper_directives.one_f_one_b(2, 4)``) or a
    callable taking the number of annotated stages and returning one. The model's parameters
    are copied to the workers; ``parameters()`` returns the trained values.

    ``memory_budget_bytes``: when given, compile fails with ``MemoryPlanError`` (before any
    worker starts) if a rank's estimated memory (``piper_memory.estimate_memory``) exceeds it;
    it is per GPU, so with ``ranks_per_gpu`` N each rank may use 1/N of it.
    ``options`` (``piper_runtime.RunOptions``) says how the ranks run: ``execution`` (threads
    per stream, gradient fusion, core binding), ``faults`` (the hung-rank bound ``timeout_s``,
    ``step_timeout_s``, what a NaN does: ``on_nan``), ``cluster`` (the ``runtime``: ``"ray"``,
    ``"local"`` for every rank a thread of this process, ``"torchrun"`` for a launched job, or
    one a package adds by entry point; a Ray ``address``, ``backend``, ``placement``,
    ``ranks_per_gpu``, ``reuse_workers``) and the ``seed`` every forward's random numbers
    derive from, per (region, microbatch, step, replica), so every strategy draws the same
    masks. Flat ``settings`` (``runtime="local"``, ``timeout_s=5``, ...) set single fields of it
    (``RunOptions.build``); an unknown name is a ``TypeError``.
    ``precision`` (``"bf16"``): compute in that dtype on fp32 master weights, gradients and
    optimizer state (``piper_semantics.precision``). ``captured`` is the ``CapturedModel``.
    ``regions`` names the model's regions by module path (``"embed | layers.* | norm, head"``,
    piper_directives.regions) for a model that does not call ``annotate``; without either,
    each entry of the model's largest ``ModuleList`` is a region. ``capture_method``: ``"fx"``,
    ``"export"`` or ``"auto"`` (fx, and torch.export where fx cannot trace the model).

    ``lr_schedule``: the learning rate of each step (``optimizer.lr`` is the peak; default
    constant). ``clip_grad_norm``: clip the gradients to this global 2-norm before every
    update, as ``torch.nn.utils.clip_grad_norm_`` on the single-device model;
    ``measure_grad_norm``: compute the norm (``StepResult.grad_norm``) without clipping.
    ``state`` holds the loop's state (step, schedule, data position: ``TrainState``).

    Batches may have other shapes than the example (another sequence length or batch size,
    an epoch's partial last batch): the first batch whose pieces (microbatch x data-parallel
    shards) have new shapes compiles a program for them (the model captured again on such
    pieces, the same strategy applied; ``variants``, ``variant_seconds``, ``plans``) that the
    runtime keeps for every later batch of those shapes; a piece's loss is weighted by its share
    of the batch's samples (``piper_runtime.batch``). ``evaluate`` does the same with the
    forward-only programs of those shapes (``eval_variants``).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        example_inputs: Tensors,
        example_targets: Tensors,
        loss_fn: Callable[..., torch.Tensor],
        strategy: Strategy | Callable[[int], Strategy],
        *,
        optimizer: OptimizerSpec | None = None,
        options: RunOptions | None = None,
        memory_budget_bytes: int | None = None,
        log: Callable[[str], None] | None = None,
        precision: str | None = None,
        lr_schedule: LRSchedule | None = None,
        clip_grad_norm: float | None = None,
        measure_grad_norm: bool = False,
        regions: str | Sequence[str] | None = None,
        capture_method: str = "auto",
        **settings: Any,
    ) -> None:
        say = log or (lambda _: None)
        started = time.perf_counter()
        if not (isinstance(strategy, Strategy) or callable(strategy)):
            raise TypeError(
                f"strategy must be a Strategy or a function of the model's region count returning one, got "
                f"{type(strategy).__name__} {strategy!r}; for a library schedule by name use "
                "Trainer.with_schedule(..., schedule=, pp=, microbatches=)"
            )
        if optimizer is not None and not isinstance(optimizer, OptimizerSpec):
            raise TypeError(f"optimizer must be a piper_runtime.OptimizerSpec (OptimizerSpec('adamw', 1e-3)), got "
                            f"{type(optimizer).__name__} {optimizer!r}")
        # Refused here, by name, before anything is captured or started: a NaN timeout would
        # never come (a NaN learning rate: ``OptimizerSpec`` refuses it itself).
        for name in ("timeout_s", "step_timeout_s"):
            if settings.get(name) is not None:
                bounds.check(name, settings[name], minimum=0, strict=True, maximum=bounds.MAX_TIMEOUT_S)
        try:
            self.run_options = run_options = RunOptions.build(options, **settings)
        except TypeError as exc:
            raise TypeError(f"Trainer: {exc}") from None
        seed = run_options.seed
        ranks_per_gpu = run_options.cluster.ranks_per_gpu
        for name, value in (("clip_grad_norm", clip_grad_norm), ("memory_budget_bytes", memory_budget_bytes)):
            if value is not None:
                bounds.check(name, value, minimum=0, strict=True)
        self.seed = seed
        # What the runtime can start before the program exists (Ray's embedded cluster) starts
        # now, while the model is captured and the plans compiled.
        devices = device_count(strategy)
        if devices is not None:
            prepare_runtime(run_options, devices)
        captured = capture(model, example_inputs, example_targets, loss_fn, precision=precision, regions=regions,
                           method=capture_method)
        self.capture_seconds = time.perf_counter() - started
        self.captured = captured
        # A batch of other shapes is captured again, with the same arguments (``_add_variant``).
        self._recapture = functools.partial(
            capture, model, loss_fn=loss_fn, precision=precision, regions=regions, method=capture_method
        )
        if not isinstance(strategy, Strategy):
            strategy = strategy(pipeline_stages(captured.graph))
        self.strategy = strategy
        # Tensor-parallel segments get their code rewritten (column/row-parallel Linears).
        self._grad_norm = (clip_grad_norm, clip_grad_norm is not None or measure_grad_norm)
        self.graph, modules = self._plan(captured)
        self.program: Program = compile_program(self.graph)
        # Context parallelism: batches laid out so each rank's piece is its chunk of the sequences.
        self.context = ContextLayout.of(self.program)
        # Programs for batches of other shapes, by their pieces' shapes (``_add_variant``),
        # and the seconds each took to capture and compile.
        self.variants: dict[Signature, Program] = {}
        self.variant_seconds: list[float] = []
        self._variant_graphs: dict[Signature, Graph] = {}
        self.eval_variants: dict[Signature, Program] = {}  # their forward-only programs (``evaluate``)
        self.eval_program: Program | None = None  # compiled by the first ``evaluate``
        self.program_digest = hashlib.sha256(to_json(self.program).encode()).hexdigest()
        optimizer = optimizer or OptimizerSpec()
        self.optimizer = optimizer
        self.state = TrainState(LearningRate(optimizer.lr, lr_schedule))
        # Per rank: a program compiled later for a batch of other shapes is held to it too.
        self._budget = None if memory_budget_bytes is None else memory_budget_bytes // max(1, ranks_per_gpu)
        if self._budget is not None:
            check_budget(self.program, self._budget, optimizer.name)
        self.compile_seconds = time.perf_counter() - started
        self.batch_size = captured.batch_size
        self._example = (model, as_tensors(example_inputs), as_tensors(example_targets), loss_fn)
        self.precision = precision
        self.state_dict_keys = sorted(model.state_dict())
        self.param_shapes = {
            name: tuple(meta.shape) for seg in captured.graph.segments for name, meta in seg.params
        }
        self.untraced = untraced_parameters(model, self.param_shapes)
        if self.untraced:
            say(f"{len(self.untraced)} parameter(s) not used by forward, so not trained (kept as given, saved "
                f"and exported with the rest): {', '.join(list(self.untraced)[:5])}"
                + (f" and {len(self.untraced) - 5} more" if len(self.untraced) > 5 else ""))
        if captured.regions is not None:
            say(f"regions by module path{' (default: one per layer)' if regions is None else ''}: "
                f"{captured.regions.describe()}")
        say(
            f"captured {len(self.graph.stage_segments())} regions with {captured.method} in "
            f"{self.capture_seconds:.2f} s, compiled and verified "
            f"{self.program.world_size} rank plans in {self.compile_seconds - self.capture_seconds:.2f} s; "
            f"starting {self.program.world_size} ranks (runtime {run_options.cluster.runtime!r})"
        )
        self._modules = modules
        self._say = say
        # The model file and its neighbours travel by value to the workers.
        self._start = functools.partial(
            start_runtime, self.program, modules, optimizer, run_options, log=say, by_value=captured.user_modules
        )
        self.runtime: TrainingRuntime = self._start()
        try:
            stopping.raise_if_interrupted()  # a Ctrl-C while the workers started, should Ray have dropped it
        except KeyboardInterrupt:
            self.runtime.shutdown()
            raise

    @classmethod
    def with_schedule(
        cls,
        model: torch.nn.Module,
        example_inputs: Tensors,
        example_targets: Tensors,
        loss_fn: Callable[..., torch.Tensor],
        *,
        schedule: str,
        pp: int,
        microbatches: int,
        dp: int = 1,
        zero: int = 0,
        tp: int = 1,
        ep: int = 1,
        cp: int = 1,
        sp: bool = False,
        **kwargs: object,
    ) -> Trainer:
        """A trainer running a named schedule from the library over ``pp`` pipeline ranks,
        replicated ``dp`` times with ZeRO level ``zero``, each stage tensor-parallel over
        ``tp`` or expert-parallel over ``ep`` devices (``pp * dp * tp * ep`` devices; the
        layout is ``piper_directives.parallelize``'s), with as many regions as the model has;
        ``cp``: each device then widened to ``cp`` adjacent ones that cut every sequence
        (``piper_directives.context_parallel``); ``sp``: sequence parallelism between the
        tensor-parallel regions (``tensor_parallel``'s)."""

        def strategy(stages: int) -> Strategy:
            built = parallelize(build_schedule(schedule, pp, microbatches, stages=stages), dp=dp, zero=zero, tp=tp,
                                ep=ep, sp=sp)
            return context_parallel(built, cp)

        sized = SizedStrategy(strategy, devices=pp * dp * tp * ep * cp)
        return cls(model, example_inputs, example_targets, loss_fn, sized, **kwargs)  # type: ignore[arg-type]

    def step(
        self,
        inputs: Tensors,
        targets: Tensors,
        *,
        keep_grads: bool = False,
        profile: bool = False,
        memory: bool = False,
    ) -> StepResult:
        """One training step on a full batch at the schedule's learning rate; returns the
        per-microbatch losses, the learning rate, the gradient norm where the program
        computes one (and, when asked, the gradients, per-instruction timings and each
        rank's peak memory). ``submit(...).result()``."""
        return self.submit(inputs, targets, keep_grads=keep_grads, profile=profile, memory=memory).result()

    def throughput(self, hardware: Hardware | None = None) -> Throughput | None:
        """The figures that turn a step's time into TFLOP/s per device and MFU against
        ``hardware`` (piper_train.flops): the example batch's model FLOPs, counted on the meta
        device; with ``hardware`` also on a real copy when the meta device cannot run the
        model, without it None then."""
        model, inputs, targets, loss_fn = self._example
        flops = step_flops(model, inputs, targets, loss_fn, real=hardware is not None)
        if flops is None:
            return None
        size = batch_tokens(inputs) or self.batch_size
        dtype = self.precision or _DTYPES.get(next((p.dtype for p in model.parameters()), torch.float32), "fp32")
        return Throughput.of(flops, size, self.program.world_size, hardware, dtype)

    def submit(
        self,
        inputs: Tensors,
        targets: Tensors,
        *,
        keep_grads: bool = False,
        profile: bool = False,
        memory: bool = False,
    ) -> PendingStep:
        """Send one training step to the workers and return at once (``Runtime.submit``):
        the next batch can be handed over while this step computes; ``result()`` waits. The
        step counts (learning rate, ``state``) as soon as it is submitted."""
        (pending,) = self.submit_steps([(inputs, targets)], keep_grads=keep_grads, profile=[profile], memory=[memory])
        return pending

    def submit_steps(
        self,
        batches: Sequence[tuple[Tensors, Tensors]],
        *,
        keep_grads: bool = False,
        profile: Sequence[bool] | None = None,
        memory: Sequence[bool] | None = None,
    ) -> list[PendingStep]:
        """Consecutive training steps, one per ``(inputs, targets)`` batch, sent in one call
        per rank (``Runtime.submit_steps``: it saves a small model's per-step call overhead;
        the results arrive together). Each step runs at the schedule's learning rate for it
        and counts as ``submit``'s does; ``profile`` and ``memory`` are per step."""
        batches = [(as_tensors(inputs), as_tensors(targets)) for inputs, targets in batches]
        if self.context is not None:
            batches = [self.context.arrange(inputs, targets) for inputs, targets in batches]
        profile = list(profile) if profile is not None else [False] * len(batches)
        memory = list(memory) if memory is not None else [False] * len(batches)
        if not len(profile) == len(memory) == len(batches):
            raise ValueError(f"{len(batches)} batches but {len(profile)} profile and {len(memory)} memory flags")
        sizes = [self._prepare(inputs, targets) for inputs, targets in batches]
        state = self.state
        before = (state.step, state.samples, state.tokens, state.lr.state_dict())
        requests = []
        try:
            for (inputs, targets), prof, mem, samples in zip(batches, profile, memory, sizes, strict=True):
                requests.append(StepRequest(inputs, targets, keep_grads, prof, state.lr.current, mem))
                state.advance(samples, batch_tokens(inputs))
            return self.runtime.submit_steps(requests)
        except BaseException:  # nothing was sent: the steps do not count
            state.step, state.samples, state.tokens = before[:3]
            state.lr.load_state_dict(before[3])
            raise

    def _plan(self, captured: CapturedModel) -> tuple[Graph, dict[str, torch.nn.Module]]:
        """The strategy applied to a captured model, tensor-parallel code rewritten
        (``shard_modules``), memory planned and the gradient norm added where asked for:
        the graph ``compile_program`` compiles, and the segment modules."""
        applied = self.strategy.apply(captured.graph)
        rewrite = context_modules if context_degree(applied) > 1 else shard_modules
        graph, modules = rewrite(applied, captured.modules)
        planned = plan_memory(graph)
        clip, norm = self._grad_norm
        return (add_grad_norm(planned, clip) if norm else planned), modules

    @property
    def plans(self) -> int:
        """How many programs the runtime holds: the example batch's and one per other shape of a
        batch's pieces seen so far (``_add_variant``)."""
        return 1 + len(self.variants)

    def _prepare(self, inputs: tuple[torch.Tensor, ...], targets: tuple[torch.Tensor, ...]) -> int:
        """Check a training batch's shapes and compile what they need: a batch of other shapes
        than the example's (another sequence length, another size, an epoch's last partial
        batch, whose microbatches and data-parallel shards may differ by a sample) trains on
        programs compiled for its pieces' shapes on first sight (``_add_variant``). Returns the
        batch's samples."""
        program = self.program
        cut = cut_batch(program, inputs, targets)
        own = program_signature(program)
        for m, row in enumerate(cut.signatures):
            for j, signature in enumerate(row):
                if signature != own and signature not in self.variants:
                    self._add_variant(cut, m, j, inputs, targets)
        return cut.total // (self.context.degree if self.context is not None else 1)

    def _add_variant(
        self, cut: BatchCut, m: int, j: int, inputs: tuple[torch.Tensor, ...], targets: tuple[torch.Tensor, ...]
    ) -> None:
        """Compile the program for the shapes of piece ``(m, j)`` of a batch and hand it to the
        runtime: the model captured again on an example batch of such pieces (piece ``(m, j)``
        repeated, microbatches x replicas times), the same strategy applied, planned and
        compiled; the runtime checks that only the shapes differ and gives each rank the
        shapes of its transfers, once (``Runtime.add_variant``). Modules, parameters and
        optimizer state stay as they are; every later batch with such pieces reuses it."""
        program = self.program
        add = getattr(self.runtime, "add_variant", None)
        signature = cut.signatures[m][j]
        shapes = describe_signature(program, signature)
        if add is None:
            raise ValueError(f"a batch whose pieces have shapes {shapes}, but the program was compiled for "
                             f"{describe_signature(program, program_signature(program))} and runtime "
                             f"{self.run_options.cluster.runtime!r} cannot run other shapes (no add_variant)")
        drain = getattr(self.runtime, "drain", None)
        if drain is not None:
            drain()  # no forward may run in this process while the model is traced (``Runtime.drain``)
        started = time.perf_counter()
        copies = program.microbatches * program.replicas
        examples = []
        for name, tensor in zip((*program.inputs, *program.targets), (*inputs, *targets), strict=True):
            meta = program.value_by_name[name].meta
            piece = cut.piece(tensor, meta, m, j)
            examples.append(piece if meta.batch_dim is None else torch.cat([piece] * copies, dim=meta.batch_dim))
        n_in = len(program.inputs)
        try:
            graph, _ = self._plan(self._recapture(tuple(examples[:n_in]), tuple(examples[n_in:])))
        except Exception as exc:  # the model's own error on these shapes (a feature size it cannot take)
            raise ValueError(
                f"a batch whose pieces have shapes {shapes} (the program was compiled for "
                f"{describe_signature(program, program_signature(program))}): capturing the model on such pieces "
                f"failed: {type(exc).__name__}: {_first_line(exc)}"
            ) from exc
        variant = compile_program(graph)
        if self._budget is not None:  # a longer sequence may not fit where the example's did
            check_budget(variant, self._budget, self.optimizer.name)
        add(variant)
        self.variants[signature] = variant
        self._variant_graphs[signature] = graph
        self.variant_seconds.append(time.perf_counter() - started)
        self._say(f"compiled a program for batch pieces of shapes {shapes} in {self.variant_seconds[-1]:.2f} s "
                  f"({self.plans} programs)")

    def evaluate(self, inputs: Tensors, targets: Tensors) -> float:
        """The loss of one batch, forward only (no gradient, no update, the modules in eval
        mode): the mean of its microbatches' losses, as ``step`` reports it. The first call
        compiles the forward-only program and loads it on the workers; a batch of other
        shapes, the forward-only program of its pieces' shapes (``_add_variant``'s graph)."""
        inputs, targets = as_tensors(inputs), as_tensors(targets)
        if self.context is not None:
            inputs, targets = self.context.arrange(inputs, targets)
        if self.eval_program is None:
            self.eval_program = compile_program(forward_only(self.graph))
            self.runtime.load_forward(self.eval_program)
        if not hasattr(self.runtime, "add_variant"):
            self._check_batch_size(inputs, targets)
        cut = cut_batch(self.eval_program, inputs, targets)
        own = program_signature(self.eval_program)
        for m, row in enumerate(cut.signatures):
            for j, signature in enumerate(row):
                if signature == own or signature in self.eval_variants:
                    continue
                if signature not in self.variants:
                    self._add_variant(cut, m, j, inputs, targets)
                variant = compile_program(forward_only(self._variant_graphs[signature]))
                self.runtime.add_variant(variant, forward=True)  # type: ignore[attr-defined]
                self.eval_variants[signature] = variant
        return self.runtime.evaluate(inputs, targets).loss

    def _check_batch_size(self, inputs: tuple[torch.Tensor, ...], targets: tuple[torch.Tensor, ...]) -> None:
        """A clear error for a batch whose size differs from the example's: the program's
        shapes (and every transfer's buffer) are fixed at compile time."""
        program = self.program
        for name, tensor in zip((*program.inputs, *program.targets), (*inputs, *targets), strict=False):
            meta = program.value_by_name[name].meta
            if meta.batch_dim is None or not isinstance(tensor, torch.Tensor) or tensor.dim() <= meta.batch_dim:
                continue
            want = full_batch_shape(meta, program.microbatches, program.replicas)[meta.batch_dim]
            if tensor.shape[meta.batch_dim] != want:
                raise ValueError(
                    f"{name}: a batch of {tensor.shape[meta.batch_dim]} samples, but the program was compiled for "
                    f"batches of {want} (the example batch's size); this runtime runs the example's shapes only "
                    "(no add_variant)"
                )

    def parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter of the model by name: the trained ones from the workers, and those
        forward never uses (``untraced``) as they were given or loaded."""
        return {**self.runtime.parameters(), **{name: t.clone() for name, t in self.untraced.items()}}

    def _all_shapes(self) -> dict[str, tuple[int, ...]]:
        return {**self.param_shapes, **{name: tuple(t.shape) for name, t in self.untraced.items()}}

    def save_checkpoint(self, path: str | os.PathLike[str]) -> Path:
        """Write a checkpoint of the model, optimizer and ``state`` to the directory ``path``
        (which must not exist), atomically: into a temporary sibling, renamed when complete."""
        path = Path(path)
        state = {"train_state": self.state.state_dict(), UNTRACED: dict(self.untraced)}
        return write_atomically(path, lambda tmp: self.runtime.save_checkpoint(str(tmp), state), self._manifest(),
                                writer=self.writer, coordinator=self.coordinator)

    def begin_checkpoint(self, path: str | os.PathLike[str]) -> PendingCheckpoint:
        """``save_checkpoint`` that returns once the ranks have copied what they hold (the
        steps wait that long): they write their files while the next steps run, and the
        returned ``PendingCheckpoint`` completes it (``finish``: the metadata, the manifest,
        the rename). One checkpoint is written at a time: the next waits for this one."""
        path = Path(path)
        started = time.perf_counter()
        state = {"train_state": self.state.state_dict(), UNTRACED: dict(self.untraced)}
        manifest = self._manifest()
        tmp = begin_atomically(path, self.writer)
        try:
            writing = self.runtime.save_checkpoint(str(tmp), state, wait=False)
        except BaseException:
            if self.coordinator:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        assert writing is not None
        return PendingCheckpoint(path, tmp, manifest, writing, time.perf_counter() - started, self.coordinator)

    @property
    def coordinator(self) -> bool:
        """Whether this process writes what the run writes once (a checkpoint's manifest and
        rename, metrics, reports): under torchrun rank 0's alone, where every process runs
        this trainer (``Runtime.coordinator``); always elsewhere."""
        return bool(getattr(self.runtime, "coordinator", True))

    @property
    def writer(self) -> str | None:
        """The name every process of a launched job gives a checkpoint's temporary directory
        (``Runtime.writer``); ``None`` where one process drives every rank."""
        return getattr(self.runtime, "writer", None)

    def _manifest(self) -> dict[str, Any]:
        """What a checkpoint's ``piper.json`` says of this run, now."""
        return {
            "step": self.state.step,
            "optimizer": self.optimizer.name,
            "parameters": {name: list(shape) for name, shape in self._all_shapes().items()},
            # Parameters forward never uses: the driver's, in the objects (``untraced_parameters``).
            "untraced": sorted(self.untraced),
            "world_size": self.program.world_size,
            "microbatches": self.program.microbatches,
            "replicas": self.program.replicas,
            "program": self.program_digest,
            # What the model's own state_dict holds (a captured segment keeps non-persistent
            # buffers too), and tied parameters, stored once under the tie's name: for ``export``.
            "state_dict": self.state_dict_keys,
            # ``export`` restores a tie under each of its names.
            "ties": {q: tie.name for tie in self.program.ties for _, q in tie.holders if q != tie.name},
        }

    def load_checkpoint(self, path: str | os.PathLike[str]) -> Path:
        """Continue from the checkpoint ``path`` (or the latest complete one under it), saved
        under any strategy: the ranks read their parameters and optimizer state, ``state``
        its step, schedule and data position (set ``state.data`` first, as ``fit`` does).
        Returns the checkpoint read; ``CheckpointError`` names what does not fit."""
        source = resolve(path)
        manifest = read_checked(source)
        check_compatible(source, manifest, self._all_shapes(), self.optimizer.name)
        objects = read_objects(str(source), ["train_state", *([UNTRACED] if manifest.get("untraced") else [])])
        self.state.load_state_dict(objects["train_state"])
        saved = objects.get(UNTRACED) or {}
        self.untraced = {name: saved.get(name, t) for name, t in self.untraced.items()}
        # The ranks' own generators (unseeded dropout) mean something only to the same program.
        self.runtime.load_checkpoint(str(source), self.state.step, rng=manifest.get("program") == self.program_digest)
        return source

    def restart(self) -> None:
        """Replace the workers (after a failure, which has torn them down already) by new
        ones holding the model as it was given; ``load_checkpoint`` then brings them forward."""
        self.runtime.shutdown()
        self.runtime = self._start()
        stopping.raise_if_interrupted()
        for variant in self.variants.values():
            self.runtime.add_variant(variant)  # type: ignore[attr-defined]
        if self.eval_program is not None:
            self.runtime.load_forward(self.eval_program)
            for variant in self.eval_variants.values():
                self.runtime.add_variant(variant, forward=True)  # type: ignore[attr-defined]

    def worker_pids(self) -> list[int]:
        """Each rank's worker process id (rank order)."""
        return self.runtime.worker_pids()

    def close(self) -> None:
        self.runtime.shutdown()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _first_line(exc: BaseException, limit: int = 300) -> str:
    """The first line of what ``exc`` says, at most ``limit`` characters (torch's tracing
    errors run to pages)."""
    text = (str(exc).strip().splitlines() or [""])[0]
    return text if len(text) <= limit else text[: limit - 3] + "..."


def batch_tokens(inputs: Sequence[torch.Tensor]) -> int:
    """Tokens in a batch whose first input holds integer token ids (else 0)."""
    first = inputs[0] if inputs else None
    if first is None or first.is_floating_point() or first.is_complex() or first.dtype is torch.bool:
        return 0
    return first.numel()


# A model's parameter dtype as hardware files spell it (piper_train.hardware.DTYPES).
_DTYPES = {torch.float64: "fp64", torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
