"""Costs from shapes and device specifications instead of measurements: plan for hardware
that is not here (docs/planning.md).

Three closed forms, each small enough to evaluate for every candidate of a search over
thousands of devices:

- ``Roofline``: an operator that does ``f`` FLOPs and moves ``b`` bytes takes
  ``max(f / (peak * flop_efficiency), b / (bandwidth * memory_efficiency)) + overhead`` on
  one device (``overhead``: its dispatch, paid in series on a CPU; 0 unless measured);
  a phase takes the sum over its operators.
- ``Link``: a message of ``n`` bytes takes ``latency + n / bandwidth``; ring collectives over
  ``k`` ranks take ``2(k-1)`` (all-reduce) or ``k-1`` (all-gather, reduce-scatter) such steps
  of ``n/k`` bytes each (NCCL's ring algorithm, the bandwidth-optimal one); a backend whose
  reduce-scatter and all-gather are not the ring's halves of its all-reduce (gloo on a CPU:
  1.7-2.7x them, measured) scales those two by ``scatter_gather_factor``.
- ``pipeline_step``: one replica's step under a library schedule, from one pipeline rank's
  per-microbatch forward, input-backward and weight-backward times and the time of one
  stage-boundary transfer: the busy time ``M(F+B)`` plus the schedule's bubble, in the
  forms docs/schedules.md derives and the simulator reproduces on the compiled schedules
  (``packages/piper-train/tests/test_planning.py`` holds each against ``simulate``).

Imports nothing but the standard library and attrs.
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs

#: Pipeline stages per rank of each schedule (virtual stages: interleaved 1F1B, DualPipeV).
CHUNKS = {"gpipe": 1, "1f1b": 1, "zb1p": 1, "dualpipe": 1, "interleaved_1f1b": 2, "dualpipev": 2}


@attrs.frozen
class Roofline:
    """One device: dense peak FLOP/s in the dtype computed in, memory bandwidth (bytes/s) and
    the shares of each a real kernel reaches; ``overhead`` seconds per operator beyond its work."""

    peak_flops: float
    memory_bandwidth: float
    flop_efficiency: float = 1.0
    memory_efficiency: float = 1.0
    overhead: float = 0.0

    def seconds(self, ops: Iterable[tuple[float, float]]) -> float:
        """Time of operators given as (FLOPs, bytes moved), one after another."""
        flops_rate = self.peak_flops * self.flop_efficiency
        bytes_rate = self.memory_bandwidth * self.memory_efficiency
        return sum(max(f / flops_rate, b / bytes_rate) + self.overhead for f, b in ops)


@attrs.frozen
class Link:
    """A link's per-direction bandwidth (bytes/s) and per-message latency (s);
    ``scatter_gather_factor``: what a reduce-scatter or all-gather takes over the ring's time
    (1: NCCL's ring; module doc)."""

    bandwidth: float
    latency: float = 0.0
    scatter_gather_factor: float = 1.0

    def p2p(self, nbytes: float) -> float:
        return self.latency + nbytes / self.bandwidth if nbytes else 0.0

    def all_reduce(self, nbytes: float, ranks: int) -> float:
        """Ring all-reduce of ``nbytes`` per rank: a reduce-scatter then an all-gather."""
        return 2 * self._ring_half(nbytes, ranks)

    def all_gather(self, nbytes: float, ranks: int) -> float:
        """All-gather whose full tensor is ``nbytes``."""
        return self.scatter_gather_factor * self._ring_half(nbytes, ranks)

    def reduce_scatter(self, nbytes: float, ranks: int) -> float:
        """Reduce-scatter of ``nbytes`` per rank (each keeps ``nbytes / ranks``)."""
        return self.scatter_gather_factor * self._ring_half(nbytes, ranks)

    def _ring_half(self, nbytes: float, ranks: int) -> float:
        """The ring's ``k-1`` steps of ``n/k`` bytes: its all-gather or reduce-scatter."""
        if ranks <= 1 or not nbytes:
            return 0.0
        return (ranks - 1) * (self.latency + nbytes / ranks / self.bandwidth)


@attrs.frozen
class Topology:
    """Devices in nodes: ``per_node`` devices joined by ``intra`` (NVLink, Infinity Fabric),
    nodes joined by ``inter`` (InfiniBand, RoCE: per device, one NIC each)."""

    per_node: int
    intra: Link
    inter: Link

    def link(self, ranks: int, stride: int = 1) -> Link:
        """The link a group of ``ranks`` devices ``stride`` apart communicates over: the
        node's when the group fits in one node, else the network (a ring across nodes runs at
        its slowest hop)."""
        return self.intra if ranks * stride <= self.per_node else self.inter


def pipeline_step(schedule: str, pp: int, microbatches: int, f: float, bi: float, bw: float,
                  hop: float = 0.0) -> tuple[float, float]:
    """One replica's step time and its bubble (the idle share of the slowest rank) under
    ``schedule`` on ``pp`` ranks and ``microbatches`` microbatches, where one rank's work on
    one microbatch costs ``f`` (forward), ``bi`` and ``bw`` (the halves of its backward; a
    schedule that does not split the backward runs them back to back) and one transfer
    between neighbouring ranks ``hop`` (module doc). Stages are taken as equal (the slowest
    rank's costs: the planner passes them); the loss is part of the last rank's work.

    The bubbles, with free communication: GPipe and 1F1B ``(pp-1)(F+B)``; interleaved 1F1B
    ``(pp-1)(F+B)/2``; ZB-H1 ``(pp-1)(F+BI-BW)``; DualPipe ``(pp/2-1)(F+BI-BW)`` and DualPipeV
    ``(pp-1)(F+BI-BW)/2`` (DeepSeek-V3's ``(PP/2-1)(F&B+B-3W)`` with ``F&B = F+B``, written
    per rank). Each equals the simulated compiled schedule exactly, except DualPipe(V) when
    ``BI > F`` and ``BW < F`` at once, where another path is longer and the simulated step is
    up to 2% longer (the tests' cases). ``hop`` adds the first forward's and last backward's
    way through the ranks, ``2(pp-1) hop``: other transfers overlap compute."""
    m, b = microbatches, bi + bw
    busy = m * (f + b)
    if pp == 1:
        return busy, 0.0
    if schedule in ("gpipe", "1f1b"):
        idle = (pp - 1) * (f + b)
    elif schedule == "interleaved_1f1b":
        idle = (pp - 1) * (f + b) / CHUNKS[schedule]
    elif schedule == "zb1p":
        idle = (pp - 1) * max(f + bi - bw, 0.0)
    elif schedule == "dualpipe":
        idle = (pp / 2 - 1) * max(f + bi - bw, 0.0)
    elif schedule == "dualpipev":  # 2pp stages of half a rank's work each
        idle = (pp - 1) * max(f + bi - bw, 0.0) / CHUNKS[schedule]
    else:
        raise ValueError(f"pipeline_step: unknown schedule {schedule!r}; expected one of {', '.join(CHUNKS)}")
    idle += 2 * (pp - 1) * hop  # the first forward's and the last backward's way through the ranks
    step = busy + idle
    return step, idle / step if step > 0 else 0.0

