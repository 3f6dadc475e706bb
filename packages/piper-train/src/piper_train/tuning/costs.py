"""What the profiler measured (``Profile``) and the cost model it gives each candidate.

A ``Profile`` is plain data, written to and read from JSON (the on-disk cache):

- ``compute[variant][local batch][segment][phase]``: seconds of one instruction of that
  segment and phase (F, B, BI, BW, OPT), measured on the runtime with each region run as
  the variant says (``none``, ``tpK``: tensor-parallel over K ranks, ``tpKsp``: with sequence
  parallelism, ``epK``: expert-parallel, ``cpK``: context-parallel), collectives included
  for a microbatch of that many samples per rank;
- ``activation_bytes``: per segment, what one forward keeps for its backward, per sample;
  ``rank_activation_bytes[variant]`` the same on one rank of a sharded variant (``tpK``,
  ``tpKsp``, ``cpK``: TP's cut column outputs, SP's sequence shards, CP's chunks, a
  vocabulary-cut head's logits), measured as that rank runs it;
- per-instruction costs of the executor (``overhead`` per compute instruction,
  ``comm_overhead`` per message), ``startup`` and ``tail`` of a rank's step, ``dispatch``
  (the driver's per-step cost on top of the slowest rank);
- the communication model, ``latency`` (s) and ``bandwidth`` (bytes/s), measured with a
  ping-pong on the backend or given;
- ``collective_share[variant]``: the share of a tensor- or expert-parallel segment's time
  spent inside its collectives (``StepResult.collective_seconds``), waiting on the other
  ranks rather than computing;
- ``cores``: how many ranks can compute at once on this machine (ranks beyond it share
  cores: the CPU backend on a small machine), ``None`` when every rank has a device.

``cost_model(profile, candidate)`` is the ``piper_scheduler.CostModel`` a candidate's program
is simulated with. Imports no torch.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping

import attrs

from piper_scheduler import CostModel
from piper_train.tuning.space import Candidate

Table = dict[str, dict[int, dict[str, dict[str, float]]]]  # variant -> local batch -> segment -> phase -> s


@attrs.frozen
class Profile:
    """Measured costs of one model on one backend (module doc)."""

    key: str
    batch: int
    regions: int
    compute: Table = attrs.field(factory=dict)
    activation_bytes: dict[str, float] = attrs.field(factory=dict)  # per sample
    rank_activation_bytes: dict[str, dict[str, float]] = attrs.field(factory=dict)  # variant -> per sample
    collective_share: dict[str, float] = attrs.field(factory=dict)  # variant -> share of compute in collectives
    overhead: float = 0.0
    comm_overhead: float = 0.0
    startup: float = 0.0
    tail: float = 0.0
    dispatch: float = 0.0
    latency: float = 0.0
    bandwidth: float = math.inf
    cores: int | None = None

    def has(self, variant: str, local: int, split: bool) -> bool:
        """Whether ``variant`` at ``local`` samples is measured (with BI/BW when ``split``)."""
        phases = self.compute.get(variant, {}).get(local)
        if not phases:
            return False
        first = next(iter(v for k, v in phases.items() if k != "loss"), {})
        return ("BI" in first) if split else ("B" in first)

    def times(self, variant: str, local: int) -> dict[str, dict[str, float]]:
        return self.compute[variant][local]

    def region_weights(self) -> list[float]:
        """Forward + backward seconds of each region (the loss counted with the last), at the
        largest unsharded microbatch measured: what balancing stages weighs."""
        table = self.compute.get("none", {})
        if not table:
            return [1.0] * self.regions
        times = table[max(table)]
        weights = [times.get(f"s{k}", {}).get("F", 0.0) + times.get(f"s{k}", {}).get("B", 0.0)
                   for k in range(self.regions)]
        loss = times.get("loss", {})
        weights[-1] += loss.get("F", 0.0) + loss.get("B", 0.0)
        return weights

    def cpu_share(self, variant: str) -> float:
        """The share of a compute instruction's time that occupies a core (the rest is
        waiting inside tensor- or expert-parallel collectives)."""
        return 1.0 - self.collective_share.get(variant, 0.0)

    def with_comm(self, latency: float, bandwidth: float) -> Profile:
        return attrs.evolve(self, latency=latency, bandwidth=bandwidth)

    def to_json(self) -> str:
        doc = attrs.asdict(self)
        doc["bandwidth"] = None if math.isinf(self.bandwidth) else self.bandwidth
        return json.dumps(doc, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Profile:
        doc = json.loads(text)
        doc["bandwidth"] = math.inf if doc.get("bandwidth") is None else doc["bandwidth"]
        # JSON keys are strings; local batch sizes are ints
        doc["compute"] = {v: {int(b): t for b, t in sizes.items()} for v, sizes in doc.get("compute", {}).items()}
        return cls(**doc)


def segment_activation_bytes(profile: Profile, candidate: Candidate) -> dict[str, int]:
    """Per segment, the bytes one forward of one microbatch keeps on one rank (what
    ``piper_memory.estimate_memory`` takes as ``activation_bytes``): a rank of the
    candidate's variant where that was measured, else one device's (for a sharded variant an
    upper bound: TP ranks keep 1.6-2.4x less)."""
    local = candidate.local_batch(profile.batch)
    per_sample = profile.rank_activation_bytes.get(candidate.variant, profile.activation_bytes)
    return {seg: int(b * local) for seg, b in per_sample.items()}


def cost_model(profile: Profile, candidate: Candidate) -> CostModel:
    """The simulator's costs for ``candidate``: each segment's measured times at the
    candidate's variant and per-rank microbatch size, and the profile's executor and link
    costs. ``KeyError`` when that variant and size were not measured."""
    times = profile.times(candidate.variant, candidate.local_batch(profile.batch))
    overrides: Mapping[str, Mapping[str, float]] = times
    return CostModel(F=0.0, B=0.0, BI=0.0, BW=0.0, OPT=0.0, overrides=overrides, latency=profile.latency,
                     bandwidth=profile.bandwidth, overhead=profile.overhead, comm_overhead=profile.comm_overhead,
                     startup=profile.startup)
