"""Measuring a model for ``piper tune``: per-region times on the runtime, activation sizes,
the executor's own costs and the link, cached on disk.

- **Compute** (``measure``): the model runs on the runtime with one pipeline stage
  (``1f1b`` over one rank, or ``zb1p``, whose order splits each backward into BI and BW),
  widened to K ranks for a tensor- or expert-parallel variant, with as many microbatches as
  give the per-rank microbatch size asked for; a few warm-up steps, then ``profile=True``
  steps whose per-instruction timings (``StepResult.timings``) give the mean time of each
  (segment, phase). The same runs give the gap between one compute instruction and the next
  (``overhead``), the time before the first and after the last (``startup``, ``tail``), and
  what the driver adds per step (``dispatch``), and for a sharded variant the share of the
  compute spent waiting inside its collectives; as in ``benchmarks/bench_simulate_vs_runtime.py``,
  means rather than medians, since a step takes what its instructions really took.
- **Activations** (``activation_bytes``): each captured segment's forward on the example
  batch in this process, counting what the runtime holds for its backward as
  ``piper_train.profile`` does (the storages autograd saves, the forward's inputs and
  outputs; not parameters or the batch), per sample. Until 2026-12-02 the inputs were left
  out, and estimates of recomputing candidates fell below the measured peak. For a sharded
  variant (``tpK``, ``tpKsp``, ``cpK``; ``rank_activation_bytes``) the same count is taken on
  one rank of the variant: the model rewritten as the runtime runs it (``shard_modules`` or
  ``context_modules``), rank 0's piece of the weights, its collectives bound to a stand-in
  that gives every result its true per-rank shape (``ShapeComm``: an all-gather tiles, a
  reduce-scatter keeps the first piece, an all-reduce leaves its tensor), on rank 0's chunk of
  the batch. What a rank keeps under TP (column outputs cut, the rest whole), SP (the code
  between the regions on sequence shards), CP (each sequence cut, the gathered keys and
  values whole) and a vocabulary-parallel head (logits cut) is then what it really keeps,
  with no rule per kind to get wrong: one device's bytes were 1.6-2.4x a TP rank's, and one
  device's divided by the degree 0.59-0.88x an SP rank's (benchmarks/sp_activation_memory.py).
- **Link** (``ping_pong``): two processes send tensors of growing size back and forth
  through the CPU backend's point-to-point channel, as two ranks on this host would (shared
  memory, or gloo with ``PIPER_SHM_DISABLE=1``); latency is the smallest one-way time,
  bandwidth the slope.

The cache holds one JSON file per model, keyed by the captured graph's structure and shapes
(not its code), the backend and its transport, torch's version and the machine's core count; measurements
are added to it as the search needs them, so a second run measures nothing.
"""

from __future__ import annotations

import copy
import hashlib
import inspect
import json
import os
import socket
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import attrs
import torch

from piper_directives import (
    CapturedModel,
    build_schedule,
    context_degree,
    context_modules,
    context_parallel,
    parallelize,
    shard_modules,
)
from piper_ir import Graph, NodeKind
from piper_runtime import InstructionTiming, OptimizerSpec, shm_enabled, worker_env
from piper_runtime.backends import Communicator
from piper_train.models import ModelSpec
from piper_train.profile import forward_kept_bytes
from piper_train.trainer import Trainer
from piper_train.tuning.costs import Profile
from piper_train.tuning.space import variant_degrees

DEFAULT_CACHE = Path(os.environ.get("PIPER_CACHE_DIR", Path.home() / ".cache" / "piper")) / "tune"
Log = Callable[[str], None]


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


#: What a cached profile holds: one of another format is measured again (2, 2026-12-02: the
#: activation bytes count the forward's inputs; 3, 2026-12-05: per-variant activation bytes).
PROFILE_FORMAT = 3


def profile_key(name: str, captured: CapturedModel, backend: str) -> str:
    """The cache key: the model's name, its graph's structure and shapes (segments, their
    parameters and values; not the code), the backend (and on the CPU, whether messages go
    through shared memory), torch and the core count."""
    g = captured.graph
    transport = "shm" if backend == "cpu" and shm_enabled() else "gloo"
    shape = [PROFILE_FORMAT, name, backend, transport, torch.__version__, usable_cores(), list(g.inputs),
             list(g.targets)]
    shape += [[s.id, s.role.value, sorted(s.tags.as_dict().items()) if hasattr(s.tags, "as_dict") else str(s.tags),
               list(s.inputs), list(s.outputs), [(n, str(m)) for n, m in s.params]] for s in g.segments]
    shape += [[v.name, str(v.meta)] for v in g.values]
    digest = hashlib.sha256(json.dumps(shape, default=str).encode()).hexdigest()[:16]
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in name)[-40:]
    return f"{safe}-{digest}"


def activation_bytes(captured: CapturedModel, inputs: Iterable[torch.Tensor], targets: Iterable[torch.Tensor]
                     ) -> dict[str, float]:
    """Per segment, the bytes one forward keeps for its backward, per sample of the batch
    (module doc)."""
    graph = captured.graph
    values = {**dict(zip(graph.inputs, inputs, strict=False)), **dict(zip(graph.targets, targets, strict=False))}
    kept = forward_kept_bytes(graph.segments, captured.modules, values)
    return {seg: nbytes / captured.batch_size for seg, nbytes in kept.items()}


class ShapeComm:
    """A stand-in communicator for one rank of a group of ``degree``: each collective gives
    its result the shape the real one would (an all-reduce leaves its tensor, an all-gather
    tiles this rank's piece, a reduce-scatter keeps the first piece), so a rewritten segment
    runs on one process with every activation of a rank's size (the values are not a
    rank's: only sizes are read)."""

    def __init__(self, degree: int) -> None:
        self.degree = degree

    def all_reduce(self, tensor: torch.Tensor) -> None:
        pass

    def all_gather(self, out: torch.Tensor, tensor: torch.Tensor) -> None:
        out.copy_(torch.cat([tensor] * (out.shape[0] // max(tensor.shape[0], 1))))

    def reduce_scatter(self, out: torch.Tensor, tensor: torch.Tensor) -> None:
        out.copy_(tensor[: out.shape[0]])


def one_stage(variant: str, microbatches: int, regions: int):
    """The profiling runs' strategy: ``regions`` regions on one pipeline rank, widened to the
    variant's group."""
    tp, ep, cp, sp = variant_degrees(variant)
    return context_parallel(parallelize(build_schedule("1f1b", 1, microbatches, stages=regions), tp=tp, ep=ep,
                                        sp=sp), cp)


def rank_activation_bytes(captured: CapturedModel, variant: str, inputs: Iterable[torch.Tensor],
                          targets: Iterable[torch.Tensor]) -> dict[str, float]:
    """Per segment, the bytes one forward keeps for its backward on rank 0 of ``variant``'s
    group, per sample of the batch (module doc); ``activation_bytes`` for ``"none"``."""
    if variant == "none":
        return activation_bytes(captured, inputs, targets)
    regions = len(captured.graph.stage_segments())
    applied = one_stage(variant, 1, regions).apply(captured.graph)
    rewrite = context_modules if context_degree(applied) > 1 else shard_modules
    graph, modules = rewrite(applied, captured.modules)
    modules = {k: copy.deepcopy(m) for k, m in modules.items()}
    _rank_zero(graph, modules)
    values = {name: _piece(t, graph, name) for name, t in (*zip(graph.inputs, inputs, strict=False),
                                                           *zip(graph.targets, targets, strict=False))}
    kept = forward_kept_bytes(graph.segments, modules, values)
    return {seg: nbytes / captured.batch_size for seg, nbytes in kept.items()}


def _rank_zero(graph: Graph, modules: dict[str, torch.nn.Module]) -> None:
    """Cut each sharded segment's parameters to rank 0's piece and bind its collectives to
    ``ShapeComm``s (as ``piper_runtime.rank.sharding`` does with real communicators)."""
    from piper_memory.store import shard_tensor

    for sh in graph.sharding:
        module = modules.get(sh.segment)
        if module is None:
            continue
        cut: set[int] = set()
        with torch.no_grad():
            for spec in sh.params:
                p = module.get_parameter(spec.name)
                if id(p) not in cut:
                    cut.add(id(p))
                    p.data = shard_tensor(p.data, spec, sh.degree_of(spec), 0)
        for m in module.modules():
            bind = getattr(m, "bind_communicator", None)
            if callable(bind):
                extra = {"position": 0} if "position" in inspect.signature(bind).parameters else {}
                bind(ShapeComm(getattr(m, "degree", sh.degree)), **extra)


def _piece(t: torch.Tensor, graph: Graph, name: str) -> torch.Tensor:
    """Rank 0's piece of a batch tensor: its leading entries along every dimension the
    rewritten graph's meta makes shorter (a context-parallel rank's chunk of the sequence)."""
    meta = graph.value_by_name[name].meta
    out = t
    for dim, size in enumerate(meta.shape[1:], 1):  # the batch stays whole: one microbatch of all of it
        if dim < out.dim() and size < out.shape[dim]:
            out = out.narrow(dim, 0, size)
    return out.contiguous()


@attrs.frozen
class RunStats:
    """What one profiling run measured besides compute."""

    gap: float
    startup: float
    tail: float
    dispatch: float
    collective_share: float = 0.0  # of the compute instructions' time, inside TP/EP collectives


def measure(
    spec: ModelSpec,
    variant: str,
    local: int,
    split: bool,
    *,
    regions: int | None = None,
    steps: int = 3,
    warmup: int = 2,
    optimizer: OptimizerSpec | None = None,
    backend: str | None = None,
    address: str | None = None,
) -> tuple[dict[str, dict[str, float]], RunStats]:
    """Seconds per (segment, phase) for ``variant`` at ``local`` samples per rank and
    microbatch, and the run's other costs (module doc)."""
    tp, ep, cp, sp = variant_degrees(variant)
    batch = _batch_size(spec)
    microbatches = batch // (local * ep)  # an expert-parallel group cuts the batch; tp and cp ranks see all of it
    schedule = "zb1p" if split else "1f1b"
    strategy = context_parallel(parallelize(build_schedule(schedule, 1, microbatches, stages=regions or spec.stages),
                                            tp=tp, ep=ep, sp=sp), cp)
    driver, results = [], []
    # Unfused: the loss's backward would otherwise carry its stage's (piper_runtime.rank.compute),
    # and each region's time is what the search needs.
    with Trainer(spec.model, spec.example_inputs, spec.example_targets, spec.loss_fn, strategy,
                 regions=spec.regions, capture_method=spec.capture,
                 optimizer=optimizer or OptimizerSpec(), backend=backend, address=address,
                 reuse_workers=True, fuse_loss_backward=False) as trainer:
        by_id = {(plan.rank, ins.id): ins for plan in trainer.program.ranks for ins in plan.instructions}
        for step in range(warmup + steps):
            started = time.perf_counter()
            result = trainer.step(spec.example_inputs, spec.example_targets, profile=step >= warmup)
            if step >= warmup:
                driver.append(time.perf_counter() - started)
                results.append(result)
    compute: dict[tuple[str, str], list[float]] = defaultdict(list)
    gaps, starts, tails = [], [], []
    for result in results:
        per_rank = defaultdict(list)
        for t in result.timings:
            ins = by_id[(t.rank, t.instruction)]
            if ins.kind in (NodeKind.COMPUTE, NodeKind.OPTIMIZER) and ins.phase is not None:
                per_rank[t.rank].append(t)
                compute[(ins.segment, ins.phase.value)].append(t.end - t.start)
        for rank, timings in per_rank.items():
            timings.sort(key=lambda t: t.start)
            starts.append(timings[0].start)
            between, tail = gaps_and_tail(timings, result.worker_seconds[rank])
            gaps += between
            tails.append(tail)
    times: dict[str, dict[str, float]] = defaultdict(dict)
    for (seg, phase), ds in compute.items():
        times[seg][phase] = statistics.fmean(ds)
    worker = statistics.median(max(r.worker_seconds) for r in results)
    busy = sum(sum(ds) for ds in compute.values())
    waiting = sum(sum(r.collective_seconds) for r in results)
    stats = RunStats(statistics.fmean(gaps) if gaps else 0.0, statistics.median(starts), statistics.median(tails),
                     max(0.0, statistics.median(driver) - worker), min(1.0, waiting / busy) if busy else 0.0)
    return dict(times), stats


def gaps_and_tail(timings: Sequence[InstructionTiming], worker_seconds: float) -> tuple[list[float], float]:
    """One rank's idle gaps between instructions timed in order of start, and its time after
    the last end. An instruction may enclose the next ones (a ``B`` is timed until its weight
    products are in, after the sends of its window: ``piper_runtime.rank.input_grads_first``), so
    a gap starts at the latest end so far, not at the previous instruction's."""
    gaps: list[float] = []
    reach = timings[0].end if timings else 0.0
    for t in timings[1:]:
        gaps.append(max(0.0, t.start - reach))
        reach = max(reach, t.end)
    return gaps, max(0.0, worker_seconds - reach)


def _batch_size(spec: ModelSpec) -> int:
    return int(spec.example_inputs[0].shape[0])


# -- the link: a ping-pong through the CPU backend's transport ----------------------------

_SIZES = (4, 16 * 1024, 256 * 1024, 2 * 1024 * 1024)


def round_trip(link: Communicator, rank: int, message: torch.Tensor, into: torch.Tensor) -> None:
    """One round trip between ranks 0 and 1 of ``link``: rank 0 sends
    ``message`` and receives the answer into ``into``; rank 1 answers."""
    peer = 1 - rank
    if rank == 0:
        link.send(message, peer).wait()
        link.recv(into, peer).wait()
    else:
        link.recv(into, peer).wait()
        link.send(message, peer).wait()


class _PingPong:
    """One end of the ping-pong: a Ray actor in a process of its own."""

    def run(self, rank: int, port: int, reps: int, timeout_s: float = 60.0) -> dict[int, float]:
        """One-way seconds per message size, through the messages the runtime's ranks send:
        the CPU backend's point-to-point channel between two ranks on one host (shared
        memory, or gloo where that is off), its store listening on loopback only."""
        from piper_runtime.backends import CpuBackend

        backend = CpuBackend()
        backend.connect(rank, 2, "127.0.0.1", port, timeout_s)
        try:
            link = backend.communicator([0, 1], [(0, 1), (1, 0)])
            one_way = {}
            for size in _SIZES:
                t = torch.zeros(size // 4)
                times = []
                for _ in range(reps + 2):  # the first two warm the channel up
                    link.all_reduce(torch.zeros(1))  # start together
                    started = time.perf_counter()
                    round_trip(link, rank, t, t)
                    times.append((time.perf_counter() - started) / 2)
                one_way[size] = statistics.median(times[2:])
        finally:
            backend.shutdown()
        return one_way


def ping_pong(reps: int = 10, timeout_s: float = 120.0) -> tuple[float, float]:
    """(latency in s, bandwidth in bytes/s) between two ranks on this host, each a Ray actor
    with the environment the runtime's ranks get (Ray must be initialised)."""
    import ray

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    actor = ray.remote(_PingPong).options(num_cpus=0.01, runtime_env={"env_vars": worker_env()})
    ends = [actor.remote() for _ in range(2)]
    try:
        one_way = ray.get([e.run.remote(r, port, reps) for r, e in enumerate(ends)], timeout=timeout_s)[0]
    finally:
        for e in ends:
            ray.kill(e)
    return link_costs(one_way)


def link_costs(one_way: dict[int, float]) -> tuple[float, float]:
    """(latency, bandwidth) from one-way seconds per message size: the smallest time, and
    the slope between the smallest and the largest message."""
    small, large = min(one_way), max(one_way)
    latency = min(one_way.values())
    slope = max(one_way[large] - one_way[small], 1e-12) / (large - small)
    return latency, 1.0 / slope


# -- the cache and the whole profile -------------------------------------------------------


class Profiler:
    """Fills a ``Profile`` for one model as the search needs it, from and into the cache
    (module doc). ``need(variant, local, split)`` measures what is missing; ``profile`` is
    the current value; ``measured`` counts the runs this process made."""

    def __init__(
        self,
        name: str,
        spec: ModelSpec,
        captured: CapturedModel,
        *,
        backend: str = "cpu",
        address: str | None = None,
        optimizer: OptimizerSpec | None = None,
        cache_dir: Path | None = DEFAULT_CACHE,
        comm: tuple[float, float] | None = None,
        steps: int = 3,
        warmup: int = 2,
        log: Log | None = None,
    ) -> None:
        self.spec, self.captured = spec, captured
        self.backend, self.address, self.optimizer = backend, address, optimizer
        self.steps, self.warmup = steps, warmup
        self.log = log or (lambda _: None)
        self.measured = 0
        key = profile_key(name, captured, backend)
        self.path = cache_dir / f"{key}.json" if cache_dir is not None else None
        profile = read_cached(self.path, self.log) if self.path is not None else None
        if profile is None:
            cores = usable_cores() if backend == "cpu" and address is None else None
            profile = Profile(key, captured.batch_size, len(captured.graph.stage_segments()),
                              activation_bytes=activation_bytes(captured, spec.example_inputs, spec.example_targets),
                              cores=cores)
        if comm is not None:
            profile = profile.with_comm(*comm)
        elif profile.latency == 0.0 and profile.bandwidth == float("inf"):
            self.log("profile: measuring the link (a ping-pong between two ranks on this host)")
            profile = profile.with_comm(*ping_pong())
            self._save(profile)
        self.profile = profile

    def need_activations(self, variant: str) -> None:
        """Measure what one rank of ``variant`` keeps (``rank_activation_bytes``) unless known."""
        if variant == "none" or variant in self.profile.rank_activation_bytes:
            return
        self.log(f"profile: activations of one {variant} rank")
        measured = rank_activation_bytes(self.captured, variant, self.spec.example_inputs, self.spec.example_targets)
        self.profile = attrs.evolve(self.profile, rank_activation_bytes={**self.profile.rank_activation_bytes,
                                                                         variant: measured})
        self._save(self.profile)

    def need(self, variant: str, local: int, split: bool) -> None:
        if self.profile.has(variant, local, split):
            return
        self.log(f"profile: {variant} at {local} samples per microbatch{' (split backward)' if split else ''}")
        times, stats = measure(self.spec, variant, local, split, regions=self.profile.regions, steps=self.steps, warmup=self.warmup,
                               optimizer=self.optimizer, backend=self.backend, address=self.address)
        self.measured += 1
        table = {v: dict(sizes) for v, sizes in self.profile.compute.items()}
        entry = dict(table.setdefault(variant, {}).get(local, {}))
        for seg, phases in times.items():
            entry[seg] = {**entry.get(seg, {}), **phases}
        table[variant][local] = entry
        profile = attrs.evolve(self.profile, compute=table)
        if variant != "none" and not split:
            profile = attrs.evolve(profile, collective_share={**profile.collective_share,
                                                               variant: stats.collective_share})
        if variant == "none" and not split and local == min(table["none"]):
            # the run with the most instructions per step sets the executor's own costs
            profile = attrs.evolve(profile, overhead=stats.gap, comm_overhead=stats.gap, startup=stats.startup,
                                   tail=stats.tail, dispatch=stats.dispatch)
        self.profile = profile
        self._save(profile)

    def _save(self, profile: Profile) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(profile.to_json())
        tmp.replace(self.path)


def read_cached(path: Path, log: Callable[[str], None]) -> Profile | None:
    """The profile cached at ``path``; ``None`` when there is none, or when it cannot be read
    whole (damaged, of another format, nested absurdly deep): measured again, never fatal."""
    if not path.exists():
        return None
    try:
        profile = Profile.from_json(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, TypeError, KeyError, AttributeError, RecursionError):  # any damage
        log(f"profile: ignoring unreadable cache {path}")
        return None
    log(f"profile: read {path}")
    return profile
