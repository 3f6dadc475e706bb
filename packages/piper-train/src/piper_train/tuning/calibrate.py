"""Measure the machine at hand into a hardware file: ``piper tune --calibrate`` (docs/planning.md).

The analytic planner (``tuning.planner``) prices a step from four figures of a device; this
module measures each of them on the device torch computes on here (the CPU, or the first GPU
when CUDA is available) and writes them as a hardware file (``piper_train.hardware``'s schema:
data only), so ``piper tune --hardware FILE`` predicts this machine's runs:

- ``peak_tflops[dtype]``: the best matrix-product throughput over square products of
  ``peak_size``; ``flop_efficiency``: what the products of the model's sizes reach of it: each
  shape's forward, input-gradient and weight-gradient products, each with tensors of its own,
  run one after another as a step runs them (so caches hold what a step's would), their FLOPs
  over their time;
- ``memory_tb_per_s``: the bytes a decoder layer's memory-bound operators (``ELEMENTWISE``: add,
  multiply, SiLU, softmax, an RMS norm) move over their summed time, on tensors of the model's
  activation size (in cache or not, as the run has them), ``memory_efficiency`` 1 (the figure
  is what the kernels reached);
- ``op_overhead_us``: what one operator costs beyond its work (a chain of one-element
  multiplies, forward and backward: dispatch, autograd's bookkeeping, and on a GPU the
  launch), which a small model's many small operators pay;
- with a model (``Calibration.model``, ``hf:CONFIG``): ``flop_efficiency`` and
  ``op_overhead_us`` **fitted to the model's training step** (``fit_step``): on the CPU,
  Piper's own step (``Trainer`` on ``devices`` data-parallel ranks of ``runtime``, the model
  loaded and captured as ``piper train`` does) at one sequence and at ``sequences`` per rank;
  the two figures are those under which the planner's price of that strategy
  (``Planner.price``) gives both times back, so what a step pays beyond its products (its other
  operators, Python and autograd per operator, the runtime, the gradient reduction and the
  optimizer on the cores that compute) is in the figures the planner prices every strategy
  with; then the links' latency to the same step on tensor-parallel ranks and
  ``scatter_gather_factor`` to it with ZeRO-1 (what its reduce-scatter and all-gather take
  inside a step over the ring's time). On a GPU the captured segments' forward and backward
  are timed on this thread and fitted to the planner's compute alone (``Planner.model_seconds``);
- the link (CPU only): ``intra_node_gb_per_s`` and ``intra_node_latency_us`` fitted to ring
  all-reduces of a small and a large tensor between ``devices`` ranks over the ``local``
  runtime's gloo groups (threads of this process, loopback: what ``--runtime local``'s ranks
  use), ``inter_node_*`` the same (one host), ``devices_per_node`` = ``devices``,
  ``link_efficiency`` 1, and ``comm_overlap`` 0 where the ranks are as many as the host's CPUs
  (gloo's collectives then take the cores that compute: nothing hides them). On a GPU the
  link is not measured (one process, one device): its fields come from ``base`` (a shipped
  part's file) or are left out.

On the CPU every measurement runs on ``devices`` ranks at once (threads of this process, one
torch thread each; the model's step on the runtime's own ranks): a device's figures are what
one rank gets while the others work.
Each figure is the median of at least ``repeats`` timed calls over at least ``seconds`` after a
warm-up (long enough that a busy machine's scheduler gives the ranks their share, as it does a
run's steps); ``source`` records how,
when and under what load average it was measured. The machine's load moves every figure: a
file measured on a busy machine predicts runs on an equally busy one.
"""

from __future__ import annotations

import datetime
import itertools
import math
import os
import platform
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import attrs
import torch

from piper_runtime import TORCH_THREADS
from piper_train.hardware import Hardware

if TYPE_CHECKING:
    from piper_train.tuning.census import Census

_WORLDS = itertools.count(1)  # keys of the local backend's in-process stores (``_link``)
ELEMENTS = 1 << 20  # elements of the elementwise operator's tensors without a model (4 MiB in fp32)
#: The memory-bound operators of a decoder layer, each with the tensors of the size measured it
#: reads and writes: what ``memory_tb_per_s`` is measured over (a CPU computes SiLU's and
#: softmax's exponentials slower than it moves their bytes; an add alone would be too fast).
ELEMENTWISE: tuple[tuple[Callable[[torch.Tensor, torch.Tensor], object], int], ...] = (
    (torch.add, 3), (torch.mul, 3), (lambda a, _: torch.nn.functional.silu(a), 2),
    (lambda a, _: torch.softmax(a, -1), 2), (lambda a, _: torch.rsqrt(a.pow(2).mean(-1, keepdim=True)) * a, 5),  # pow 2, mean 1, mul 2
)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}
#: The runtimes whose ranks the model's step is timed as: ``local`` threads of this process (one
#: interpreter: the ranks' Python work takes turns), ``ray`` processes (one interpreter each).
RUNTIMES = ("local", "ray")


@attrs.frozen
class Calibration:
    """What to measure: ``devices`` ranks at once (CPU), in ``dtype``; the model's matrix
    products as (m, k, n) and its activation's elements (default: square products of
    ``peak_size`` and tensors of ``elementwise_elements``); all-reduces of one float per rank
    and of ``link_large`` bytes; at least ``repeats`` timed calls and ``seconds`` of calling per figure
    (on a shared machine a kernel timed briefly after a sleep gets a core to itself, while a
    step that runs on takes its share)."""

    devices: int = 1
    dtype: str = "fp32"
    matmuls: tuple[tuple[int, int, int], ...] = ()
    elementwise_elements: int = ELEMENTS
    peak_size: int = 1024
    link_large: int = 8 << 20
    repeats: int = 5
    seconds: float = 0.5  # a sixth of ``step_seconds``'s default (``timed_for``)
    model: str | None = None  # hf:CONFIG whose own step is timed (``step_sizes``), or None
    seq_len: int = 32
    sequences: int = 1  # the microbatch (sequences) the step is fitted at
    step_seconds: float = 3.0  # at least this long timing the model's step at each size (the CPU)
    runtime: str = "local"  # how the planned run's ranks run: threads of one process, or processes (ray)

    def __attrs_post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"--precision {self.dtype}: calibration measures {', '.join(DTYPES)}")
        if self.devices < 1 or self.repeats < 1 or self.sequences < 1 or self.seq_len < 1:
            raise ValueError("calibration needs --devices >= 1, --batch-size >= 1, --seq-len >= 1 and repeats >= 1")
        if self.runtime not in RUNTIMES:
            raise ValueError(f"--runtime {self.runtime}: calibration measures ranks as {' or '.join(RUNTIMES)} runs them")

    @staticmethod
    def timed_for(step_seconds: float) -> dict[str, float]:
        """``step_seconds`` and ``seconds`` for a calibration that times the model's step at
        least ``step_seconds`` (``--calibrate-seconds``), every other figure in the defaults'
        proportion (a sixth)."""
        defaults = attrs.fields(Calibration)
        return {"step_seconds": step_seconds, "seconds": step_seconds * defaults.seconds.default
                / defaults.step_seconds.default}

    @property
    def step_sizes(self) -> tuple[int, int]:
        """The two microbatches (sequences) the model's step is timed at: one sequence and
        ``sequences`` (1 and 2 when that is 1): two points fix a per-operator cost and a
        FLOP rate (``fit_step``)."""
        return (1, max(2, self.sequences))


@attrs.frozen
class Measured:
    """The figures measured (module doc), in SI units; ``link`` is None when not measured."""

    device: str
    ranks: int  # measured at once
    dtype: str
    peak_flops: float
    model_flops: float  # FLOP/s of the model's products
    bandwidth: float  # bytes/s of the memory-bound operators (ELEMENTWISE)
    op_overhead: float  # seconds
    link_bandwidth: float | None
    link_latency: float | None
    load: float | None
    seconds: float
    memory_bytes: int | None = None  # the device's (a GPU's), or this host's shared by the ranks
    # the model's step, (sequences per rank, seconds), at ``Calibration.step_sizes``: Piper's whole
    # training step on ``step_ranks`` data-parallel ranks (the CPU), or, where ``step_ranks`` is
    # None (a GPU), the captured segments' forward and backward on this thread
    steps: tuple[tuple[int, float], ...] = ()
    step_ranks: int | None = None
    # the same step on ``step_ranks`` tensor-parallel ranks, (sequences, seconds), where measured
    tp_step: tuple[int, float] | None = None
    # the data-parallel step with ZeRO-1 (reduce-scatter, then the shards' all-gather), where measured
    zero_step: tuple[int, float] | None = None

    @property
    def flop_efficiency(self) -> float:
        return min(1.0, self.model_flops / self.peak_flops)


def model_matmuls(config: object, tokens: int) -> tuple[tuple[int, int, int], ...]:
    """A decoder layer's and the head's matrix products (m, k, n) for ``tokens`` tokens, from a
    transformers config's sizes (``hidden_size``, ``intermediate_size``, heads, ``vocab_size``;
    ``census.hf_config``): the projections of attention and the MLP, and the LM head."""
    hidden = int(config.hidden_size)  # type: ignore[attr-defined]
    heads = int(getattr(config, "num_attention_heads", None) or 1)
    head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
    kv = int(getattr(config, "num_key_value_heads", None) or heads) * head_dim
    inner = int(getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * hidden)
    vocab = int(getattr(config, "vocab_size", None) or hidden)
    return ((tokens, hidden, heads * head_dim), (tokens, hidden, kv), (tokens, hidden, kv),
            (tokens, heads * head_dim, hidden), (tokens, hidden, inner), (tokens, hidden, inner),
            (tokens, inner, hidden), (tokens, hidden, vocab))


def _on_ranks(devices: int, body: Callable[[int], float], cuda: bool = False) -> float:
    """``body(rank)`` on ``devices`` threads started together, one torch thread each, as the
    local runtime's ranks compute (and as OpenMP should on a busy machine: its threads'
    barriers spin while the cores run other work); the median of what they return. On a GPU:
    on this thread."""
    if cuda:
        return body(0)
    out: list[float] = [0.0] * devices
    errors: list[BaseException] = []
    barrier = threading.Barrier(devices)

    def run(rank: int) -> None:
        try:
            torch.set_num_threads(TORCH_THREADS)
            barrier.wait()
            out[rank] = body(rank)
        except BaseException as err:  # re-raised on the caller's thread
            errors.append(err)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(r,), name=f"calibrate-{r}") for r in range(devices)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return statistics.median(out)


def _timed(fn: Callable[[], object], repeats: int, sync: Callable[[], None], seconds: float = 0.0) -> float:
    """Median seconds of ``fn`` over at least ``repeats`` calls and ``seconds`` of calling,
    after one warm-up."""
    fn()
    sync()
    times: list[float] = []
    began = time.perf_counter()
    while len(times) < repeats or time.perf_counter() - began < seconds:
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(cal: Calibration) -> Measured:
    """Measure ``cal`` on this machine (module doc)."""
    started = time.perf_counter()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    devices = 1 if cuda else cal.devices
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    dtype = DTYPES[cal.dtype]

    def matmul_seconds(shapes: Sequence[tuple[int, int, int]]) -> Callable[[int], float]:
        def body(_: int) -> float:
            total = 0.0
            for m, k, n in shapes:
                a = torch.randn(m, k, device=device).to(dtype)
                b = torch.randn(k, n, device=device).to(dtype)
                total += _timed(lambda a=a, b=b: torch.mm(a, b), cal.repeats, sync, cal.seconds / len(shapes))
            return total
        return body

    def sweep_seconds(shapes: Sequence[tuple[int, int, int]]) -> Callable[[int], float]:
        # every product of a layer's step, each with tensors of its own, one after another as a step
        # runs them: what stays in cache between them is what a step keeps
        def body(_: int) -> float:
            sets = [(torch.randn(m, k, device=device).to(dtype), torch.randn(n, k, device=device).to(dtype),
                     torch.randn(m, n, device=device).to(dtype)) for m, k, n in shapes]

            def step() -> None:
                for x, w, g in sets:
                    torch.mm(x, w.t())  # forward: x W^T
                    torch.mm(g, w)  # input gradient
                    torch.mm(g.t(), x)  # weight gradient

            return _timed(step, cal.repeats, sync, cal.seconds)
        return body

    square = ((cal.peak_size,) * 3,)
    peak = 2 * cal.peak_size**3 / _on_ranks(devices, matmul_seconds(square), cuda)
    shapes = cal.matmuls or square
    model = 3 * sum(2 * m * k * n for m, k, n in shapes) / _on_ranks(devices, sweep_seconds(shapes), cuda)
    peak = max(peak, model)  # the best product seen is the peak

    def elementwise_seconds(elements: int) -> Callable[[int], float]:
        def body(_: int) -> float:
            a = torch.randn(elements // 64, 64, device=device).to(dtype)
            b = torch.randn(elements // 64, 64, device=device).to(dtype)
            return sum(_timed(lambda op=op: op(a, b), cal.repeats, sync, cal.seconds / len(ELEMENTWISE))
                       for op, _ in ELEMENTWISE)
        return body

    itemsize = torch.empty((), dtype=dtype).element_size()
    def tiny_seconds(_: int) -> float:
        # 100 one-element multiplies and their backward (100 more operators), back to back as in a
        # training step: the dispatch, autograd's bookkeeping and, on a GPU, the queued launches
        x = torch.ones(1, device=device, dtype=dtype, requires_grad=True)

        def chain() -> None:
            y = x
            for _ in range(100):
                y = y * 1.0
            y.backward()

        return _timed(chain, cal.repeats, sync, cal.seconds) / 200

    tiny = _on_ranks(devices, tiny_seconds, cuda)
    elements = cal.elementwise_elements // 64 * 64
    moved = sum(tensors for _, tensors in ELEMENTWISE) * elements * itemsize
    bandwidth = moved / _on_ranks(devices, elementwise_seconds(elements), cuda)  # their dispatch included
    link_bw = link_lat = None
    if not cuda and devices > 1:
        link_bw, link_lat = _link(cal)
    steps: tuple[tuple[int, float], ...] = ()
    tp_step = zero_step = None
    if cal.model and cuda:
        steps = _segment_steps(cal)
    elif cal.model:
        steps, tp_step, zero_step = _runtime_steps(cal, devices)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return Measured(torch.cuda.get_device_name(0) if cuda else (platform.processor() or platform.machine()),
                    devices, cal.dtype, peak, model, bandwidth, tiny, link_bw, link_lat, load,
                    time.perf_counter() - started, _memory(cuda, devices), steps,
                    None if cuda or not cal.model else devices, tp_step, zero_step)


Step = tuple[int, float]  # (sequences per rank, seconds) of one measured step


def _runtime_steps(cal: Calibration, devices: int) -> tuple[tuple[Step, ...], Step | None, Step | None]:
    """Piper's whole training step of the model on ``devices`` data-parallel ranks (1F1B, one
    microbatch, ZeRO 0, AdamW) as ``cal.runtime`` runs them, at each of ``cal.step_sizes``
    sequences per rank, and with 2 ranks or more, at the larger size, the same step with
    ZeRO-1 (its reduce-scatter and all-gather: ``fit_step``'s ``sharded``) and (where the
    model's heads divide among them) on ``devices`` tensor-parallel ranks: the median of at
    least ``repeats`` timed steps and ``step_seconds`` each after two untimed ones. On the
    ``local`` runtime the trainers are up at once and take turns step by step, so a drift in
    the machine's speed moves all alike (the fit rests on their differences); on ``ray`` (a
    rank's bundle holds a CPU: the embedded cluster has room for one trainer) one after the
    other. What a rank pays beyond its products (its other operators, Python and autograd per
    operator, the runtime's instructions, the collectives and the optimizer on the cores that
    compute) is in the times (module doc)."""
    import contextlib

    from piper_directives import build_schedule
    from piper_ir import PiperError
    from piper_runtime import OptimizerSpec
    from piper_train.trainer import Trainer
    from piper_train.workload import load_workload

    def trainer(sequences: int, kind: str = "dp") -> tuple[Trainer, list]:  # the caller closes it
        tp = kind == "tp"
        workload = load_workload(str(cal.model), stages=1, batch_size=sequences * (1 if tp else devices))
        if cal.dtype not in ("fp32", "bf16"):
            workload.model.to(DTYPES[cal.dtype])
        degrees = {"tp": devices} if tp else {"dp": devices, "zero": 1 if kind == "zero" else 0}
        strategy = build_schedule("1f1b", 1, 1, stages=workload.stages, **degrees)
        made = Trainer(workload.model, workload.example_inputs, workload.example_targets, workload.loss_fn, strategy,
                       optimizer=OptimizerSpec("adamw", 3e-3), runtime=cal.runtime, regions=workload.regions,
                       capture_method=workload.capture, precision="bf16" if cal.dtype == "bf16" else None)
        return made, [workload.batches(k) for k in range(4)]

    def timed(pairs: list[tuple[Trainer, list]]) -> list[float]:
        for t, batches in pairs:
            for batch in batches[:2]:  # untimed: the first steps pay set-up
                t.step(*batch)
        times: list[list[float]] = [[] for _ in pairs]
        began = time.perf_counter()
        while len(times[0]) < cal.repeats or time.perf_counter() - began < cal.step_seconds * len(pairs):
            for k, (t, batches) in enumerate(pairs):
                start = time.perf_counter()
                t.step(*batches[len(times[k]) % len(batches)])
                times[k].append(time.perf_counter() - start)
        return [statistics.median(t) for t in times]

    sizes = cal.step_sizes
    runs: list[tuple[int, str]] = [(b, "dp") for b in sizes]
    if devices > 1:
        runs += [(sizes[-1], "zero"), (sizes[-1], "tp")]
    seconds: dict[tuple[int, str], float] = {}
    with contextlib.ExitStack() as stack:
        pairs: list[tuple[Trainer, list]] = []
        kept: list[tuple[int, str]] = []
        for run in runs:
            try:
                made, batches = trainer(*run)
            except (PiperError, ValueError):  # a model whose heads do not divide: no tensor-parallel step
                if run[1] == "tp":
                    continue
                raise
            if cal.runtime == "local":  # up at once, in turns
                stack.enter_context(made)
                pairs.append((made, batches))
                kept.append(run)
            else:
                with made:
                    seconds[run] = timed([(made, batches)])[0]
        seconds.update(zip(kept, timed(pairs), strict=True) if pairs else ())
    tp, zero = ((sizes[-1], seconds[(sizes[-1], k)]) if (sizes[-1], k) in seconds else None for k in ("tp", "zero"))
    return tuple((b, seconds[(b, "dp")]) for b in sizes), tp, zero


def _segment_steps(cal: Calibration) -> tuple[tuple[int, float], ...]:
    """The captured segments' forward, loss and backward at each of ``cal.step_sizes`` on this
    thread (a GPU: Piper's runtime on one is not measured here)."""
    times = _step_times(cal.model, cal.seq_len, cal.step_sizes, cal.dtype, cal.repeats, cal.seconds)
    return tuple(zip(cal.step_sizes, times, strict=True))


def _step_times(spec: str | None, seq_len: int, sizes: Sequence[int], dtype: str, repeats: int,
                seconds: float) -> list[float]:
    """The model of ``spec`` built and captured as ``piper train`` builds and captures it (``piper_train.hf``, ``piper_directives.capture``: a rank runs the captured
    segments, not the model's Python), then the median seconds of the segments' forward, the
    loss and the backward on a microbatch of each of ``sizes`` sequences, the sizes taking
    turns (a drift in the machine's load moves both alike), over at least ``repeats`` calls
    and ``seconds`` each."""
    from piper_directives import capture
    from piper_ir import SegmentRole
    from piper_train.hf import build_hf, causal_lm_loss, logits_only

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    model, config = build_hf(str(spec))
    model = logits_only(model).train()
    if dtype not in ("fp32", "bf16"):  # bf16: fp32 master weights, computed in bf16 (--precision bf16)
        model = model.to(DTYPES[dtype])
    batches = [torch.randint(0, int(config.vocab_size), (b, seq_len + 1)) for b in sizes]
    example = batches[-1]  # capture needs 2 sequences or more: the larger size has them
    captured = capture(model, (example[:, :-1],), (example[:, 1:],), causal_lm_loss,
                       precision="bf16" if dtype == "bf16" else None)
    graph, modules = captured.graph, {k: m.to(device) for k, m in captured.modules.items()}
    model.to(device)
    batches = [b.to(device) for b in batches]

    def step(tokens: torch.Tensor) -> None:
        model.zero_grad(set_to_none=True)
        values = dict(zip(graph.inputs, (tokens[:, :-1],), strict=True))
        values.update(zip(graph.targets, (tokens[:, 1:],), strict=True))
        for segment in graph.segments:  # in the order captured: the model's regions, then the loss
            out = modules[segment.id](*(values[v] for v in segment.inputs))
            if segment.role == SegmentRole.LOSS:
                out.backward()
            else:
                values.update(zip(segment.outputs, out, strict=True))

    for tokens in batches:  # warm-up
        step(tokens)
    sync()
    times: list[list[float]] = [[] for _ in sizes]
    began = time.perf_counter()
    while len(times[0]) < repeats or time.perf_counter() - began < seconds * len(sizes):
        for k, tokens in enumerate(batches):
            start = time.perf_counter()
            step(tokens)
            sync()
            times[k].append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


@attrs.frozen
class StepFit:
    """The figures fitted to the model's measured step (``fit_step``): ``flop_efficiency`` and
    ``op_overhead`` (seconds per operator of the census) under which the planner's compute of
    a one-rank, one-microbatch step (``Planner.model_seconds``) is each measured time;
    ``operators`` the census's operators in that step; ``exact`` False where no figures
    reproduce both (then the larger microbatch's time is reproduced); ``peak_flops`` the peak
    the efficiency is a share of (FLOP/s)."""

    flop_efficiency: float
    op_overhead: float
    operators: int
    steps: tuple[tuple[int, float], ...]
    exact: bool = True
    peak_flops: float | None = None  # the peak, raised to the step's rate where that ran faster
    link_latency: float | None = None  # seconds a collective costs inside a step (``tensor_parallel``)
    tensor_parallel: tuple[int, float] | None = None  # the tensor-parallel step it was fitted to
    scatter_gather_factor: float | None = None  # a reduce-scatter's and all-gather's time over the ring's
    sharded: tuple[int, float] | None = None  # the ZeRO-1 step it was fitted to


def fit_step(census: Census, hardware: Hardware, steps: Sequence[tuple[int, float]], dtype: str,
             ranks: int | None = None, tensor_parallel: tuple[int, float] | None = None,
             sharded: tuple[int, float] | None = None) -> StepFit:
    """``flop_efficiency`` and ``op_overhead_us`` of ``hardware`` (its memory bandwidth and
    links as they are) under which the planner prices the step measured at each
    ``(sequences, seconds)`` of ``steps`` (two sizes) as measured: with ``ranks``, its whole
    step (``Planner.price``) of the strategy ``_runtime_steps`` ran (1F1B, one microbatch of
    ``sequences`` per rank, ``ranks`` data-parallel ranks, ZeRO 0); without, its compute of a
    one-rank, one-microbatch step (``Planner.model_seconds``: the captured segments alone).
    With ``tensor_parallel`` (``(sequences, seconds)`` of the same step on ``ranks``
    tensor-parallel ranks), also the links' latency under which the planner prices that
    step as measured: what a collective costs inside a step (the ranks meeting at each of a
    layer's all-reduces), not only on an idle link. With ``sharded`` (the data-parallel step
    with ZeRO-1), then the ``scatter_gather_factor`` under which the planner prices that step
    as measured: what its reduce-scatter and the all-gather after the optimizer take over the
    ring's halves of the all-reduce ZeRO 0's step was priced with (at least 1: a ZeRO-1 step
    that ran no slower than the ring allows leaves the ring's time).

    The planner's compute is ``roofline(e, b) + n x overhead``, ``n`` the census's operators
    (the same at every microbatch size), so the difference of the two times fixes the FLOP
    efficiency ``e`` (the roofline's growth falls as ``e`` rises: bisection) and the larger
    one the overhead (the whole step's other parts, the optimizer and exposed traffic, do
    not grow with the microbatch; where the overhead hides more of the gradient reduction,
    or the latency moves the gradient reduction, the figures are solved in turn until they
    settle). Where the step ran its products faster than the peak measured (a machine whose
    load moved between the two), the peak is raised to the step's rate and ``e`` is 1. Where
    the difference is below what the memory-bound operators alone take, or the overhead
    would be negative, the overhead is 0 and the larger size alone is reproduced (``exact``
    False); where no latency reproduces the tensor-parallel step, the file's stays."""
    from piper_train.tuning.planner import Planner, Setting
    from piper_train.tuning.space import Candidate

    (b1, t1), (b2, t2) = sorted(steps)[0], sorted(steps)[-1]
    if b1 == b2:
        raise ValueError("fit_step needs the step at two microbatch sizes")
    links = {k: getattr(hardware, k) or 1.0 for k in ("intra_node_gb_per_s", "inter_node_gb_per_s")}

    def priced(e: float, overhead: float, b: int, latency: float | None = None, tp: bool = False,
               factor: float | None = None) -> float:
        """The planner's price with these figures (e > 1: a rate above the file's peak); with
        ``factor``, of the ZeRO-1 step under that ``scatter_gather_factor``."""
        lat = {} if latency is None else {"intra_node_latency_us": latency * 1e6, "inter_node_latency_us": latency * 1e6}
        hw = attrs.evolve(hardware, flop_efficiency=e, op_overhead_us=overhead * 1e6, **links, **lat,
                          scatter_gather_factor=factor)
        if ranks is None:
            return Planner(Setting(census, hw, 1, b, dtype=dtype, budget_bytes=1)).model_seconds(b)
        setting = Setting(census, hw, ranks, b * (1 if tp else ranks), dtype=dtype, budget_bytes=1 << 62)
        return Planner(setting).price(Candidate("1f1b", 1, 1, tp=ranks) if tp else
                                      Candidate("1f1b", 1, 1, dp=ranks, zero=0 if factor is None else 1)).step_seconds

    def solve(f: Callable[[float], float], target: float) -> float:
        """The ``e`` with ``f(e) = target``, ``f`` falling (bisection on a log scale), within
        ``(1e-9, 1e9)``, to 13 digits (each ``f`` prices a step: no more halvings than that needs)."""
        lo = hi = 1.0
        while f(hi) > target and hi < 1e9:
            hi *= 2
        while f(lo) < target and lo > 1e-9:
            lo /= 2
        for _ in range(200):
            if hi <= lo * (1 + 1e-13):
                break
            mid = (lo * hi) ** 0.5
            lo, hi = (mid, hi) if f(mid) > target else (lo, mid)
        return (lo * hi) ** 0.5

    def rising(f: Callable[[float], float], target: float) -> float:
        """The ``x > 0`` with ``f(x) = target``, ``f`` rising (``solve`` on ``1 / x``)."""
        return 1.0 / solve(lambda inv: f(1.0 / inv), target)

    operators = sum(len(part.ops.get(p, ())) * k for part, k in ((census.layer, census.layers), (census.embed, 1),
                                                                 (census.head, 1)) for p in ("F", "BI", "BW"))
    tp_ok = (tensor_parallel is not None and ranks is not None and ranks > 1
             and math.isfinite(priced(1.0, 0.0, tensor_parallel[0], tp=True)))
    b3, t3 = tensor_parallel if tensor_parallel is not None else (0, 0.0)
    overhead, latency = 0.0, None
    for _ in range(1 if ranks is None else 8):
        e = solve(lambda x, o=overhead, lat=latency: priced(x, o, b2, lat) - priced(x, o, b1, lat), t2 - t1)
        bare = priced(e, 0.0, b2, latency)
        # The overhead: exactly (t2 - bare) / n where the step is linear in it (the compute
        # alone); where it also hides traffic, the figure whose step is t2 (rising in it).
        overhead = (t2 - bare) / operators
        if ranks is not None and overhead > 0:
            overhead = rising(lambda o, e=e, lat=latency: priced(e, o, b2, lat), t2)
        if tp_ok and overhead >= 0:
            if priced(e, overhead, b3, 1e-9, tp=True) < t3:  # else no latency gives it back: the file's stays
                latency = rising(lambda lat, e=e, o=overhead, b=b3: priced(e, o, b, lat, tp=True), t3)
    exact = (overhead >= 0 and abs(priced(e, overhead, b2, latency) - t2) <= 1e-6 * t2
             and abs(priced(e, overhead, b1, latency) - t1) <= 1e-6 * t2)
    if not exact:
        e, overhead, latency = solve(lambda x: priced(x, 0.0, b2), t2), 0.0, None
    factor = None
    if exact and sharded is not None and ranks is not None and ranks > 1:
        b4, t4 = sharded
        if priced(e, overhead, b4, latency, factor=1.0) < t4:  # else the ring's time stays
            factor = rising(lambda f, b=b4: priced(e, overhead, b, latency, factor=f), t4)
    peak = hardware.peak(dtype) * 1e12 * max(e, 1.0)  # type: ignore[operator]
    return StepFit(min(e, 1.0), overhead, operators, ((b1, t1), (b2, t2)), exact, peak, latency,
                   tensor_parallel if latency is not None else None, factor,
                   sharded if factor is not None else None)


def _memory(cuda: bool, devices: int) -> int | None:
    """The first GPU's memory, or this host's physical memory divided among ``devices`` ranks."""
    if cuda:
        return int(torch.cuda.get_device_properties(0).total_memory)
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // devices
    except (ValueError, OSError, AttributeError):
        return None


def _link(cal: Calibration) -> tuple[float, float]:
    """Bandwidth (bytes/s) and latency (s) of the local runtime's links, fitted to ring
    all-reduces of one float per rank and of ``link_large`` bytes among ``devices`` threads:
    ``2(k-1)(latency + n/k/bandwidth)`` (``piper_scheduler.analytic.Link``)."""
    from piper_runtime.backends import backend_factory

    k = cal.devices
    world = -next(_WORLDS)  # the local runtime keys its runs' stores 1, 2, ...: a negative key is ours alone

    def body(rank: int) -> tuple[float, float]:
        backend = backend_factory("local")()
        backend.connect(rank, k, "", world, 60.0)
        try:
            comm = backend.communicator(range(k))
            small = torch.zeros(k)  # one float per rank
            large = torch.zeros(max(cal.link_large // 4, k))
            return (_timed(lambda: comm.all_reduce(small), cal.repeats, lambda: None),
                    _timed(lambda: comm.all_reduce(large), cal.repeats, lambda: None))
        finally:
            backend.shutdown()

    times: list[tuple[float, float]] = [(0.0, 0.0)] * k

    def store(rank: int) -> float:
        times[rank] = body(rank)
        return 0.0

    _on_ranks(k, store)
    return fit_link(statistics.median(t[0] for t in times), statistics.median(t[1] for t in times),
                    max(cal.link_large // 4, k) * 4, k)


def fit_link(small_s: float, large_s: float, large_bytes: int, ranks: int) -> tuple[float, float]:
    """The (bandwidth bytes/s, latency s) under which ``Link.all_reduce`` takes ``small_s`` for
    a message too small to count and ``large_s`` for ``large_bytes``, on ``ranks`` ranks: the
    ring's ``2(k-1)`` steps each pay the latency and ``n/k`` bytes."""
    steps = 2 * (ranks - 1)
    latency = small_s / steps
    per_step = max(large_s / steps - latency, 1e-12)
    return (large_bytes / ranks) / per_step, latency


def hardware_file(m: Measured, cal: Calibration, base: Hardware | None = None, name: str = "calibrated",
                  fit: StepFit | None = None) -> dict:
    """The hardware file (a JSON object: ``piper_train.hardware``'s schema) of ``m``; fields
    not measured (a GPU's links) come from ``base`` where it has them, peaks excepted. With
    ``fit`` (the model's step, ``fit_step``), its ``flop_efficiency`` and per-operator cost
    replace those of the products and the one-element chain."""
    out: dict[str, object] = {}
    if base is not None:
        out.update({k: v for k, v in attrs.asdict(base).items() if v not in (None, "")})
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    load = "unknown" if m.load is None else f"{m.load:.1f}"
    what = f"{m.device}, {m.ranks} rank(s) at once"
    out.update({
        "name": name,
        "description": f"measured: {what}",
        # the measured dtype only: the efficiencies measured in it would misprice the base's others
        "peak_tflops": {m.dtype: m.peak_flops / 1e12},
        "memory_tb_per_s": m.bandwidth / 1e12,
        "flop_efficiency": m.flop_efficiency,
        "memory_efficiency": 1.0,
        "op_overhead_us": m.op_overhead * 1e6,
        **({"memory_gib": m.memory_bytes / 2**30} if m.memory_bytes else {}),
        "source": (f"piper tune --calibrate, {when}, load average {load} on {os.cpu_count()} CPUs; {m.dtype}; each "
                   f"figure the median of {cal.repeats} or more calls over {cal.seconds:g} s or more: matrix "
                   f"products ({len(cal.matmuls) or 1} shapes, forward and both gradients), add, multiply, SiLU, "
                   f"softmax and an RMS norm on {cal.elementwise_elements} elements, one-element multiplies and "
                   "their backward for the per-operator cost"
                   + (f", ring all-reduces of one float per rank and of {cal.link_large} bytes over the local "
                      f"runtime's gloo groups among {cal.devices} threads" if m.link_bandwidth else
                      "; links not measured")
                   + (_fit_source(fit, cal, m) if fit is not None else "")),
    })
    if fit is not None:
        out["flop_efficiency"] = fit.flop_efficiency
        if fit.peak_flops is not None:
            out["peak_tflops"] = {m.dtype: fit.peak_flops / 1e12}
        out.pop("op_overhead_us", None)  # 0 is the default (a file's figures are positive)
        if fit.op_overhead > 0:
            out["op_overhead_us"] = fit.op_overhead * 1e6
    if m.link_bandwidth is not None and m.link_latency is not None:
        # The latency a collective pays inside a step where the tensor-parallel step fitted one
        latency = fit.link_latency if fit is not None and fit.link_latency is not None else m.link_latency
        gb, us = m.link_bandwidth / 1e9, latency * 1e6
        out.update({"devices_per_node": cal.devices, "intra_node_gb_per_s": gb, "inter_node_gb_per_s": gb,
                    "intra_node_latency_us": us, "inter_node_latency_us": us, "link_efficiency": 1.0})
        if cal.devices >= (os.cpu_count() or 1):  # gloo's collectives take the cores the ranks compute on
            out["comm_overlap"] = 0.0
    if fit is not None and fit.scatter_gather_factor is not None:
        out["scatter_gather_factor"] = fit.scatter_gather_factor
    return out


def _fit_source(fit: StepFit, cal: Calibration, m: Measured) -> str:
    steps = ", ".join(f"{b} sequence(s) {t * 1e3:.1f} ms" for b, t in fit.steps)
    ranks = "processes (--runtime ray)" if cal.runtime == "ray" else "threads of one process (--runtime local)"
    what = (f"Piper's training step of {cal.model} (1F1B, one microbatch, AdamW) on {m.step_ranks} data-parallel "
            f"ranks as {ranks}, per rank" if m.step_ranks else f"{cal.model}'s captured forward and backward")
    latency = ("" if fit.link_latency is None or fit.tensor_parallel is None else
               f"; the links' latency fitted to the same step on {m.step_ranks} tensor-parallel ranks, "
               f"{fit.tensor_parallel[0]} sequence(s) {fit.tensor_parallel[1] * 1e3:.1f} ms (idle ring all-reduces: "
               f"{(m.link_latency or 0) * 1e6:.0f} us)")
    if fit.scatter_gather_factor is not None and fit.sharded is not None:
        latency += (f"; scatter_gather_factor fitted to the same step with ZeRO-1 on {m.step_ranks} data-parallel "
                    f"ranks, {fit.sharded[0]} sequence(s) {fit.sharded[1] * 1e3:.1f} ms")
    return (f"; flop_efficiency and op_overhead_us fitted to {what} of {cal.seq_len}-token sequences: {steps}, "
            f"{fit.operators} operators" + ("" if fit.exact else " (not reproducible in range: the larger size fitted)")
            + latency)


__all__ = ["RUNTIMES", "Calibration", "Measured", "StepFit", "fit_link", "fit_step", "hardware_file", "measure",
           "model_matmuls"]
