"""Where each rank runs: a Ray placement group with a documented policy.

Policy. One bundle per rank (``cpus_per_rank`` CPUs, and ``gpus_per_rank`` GPUs with a GPU
backend), reserved together before any actor starts:

- ``pack`` (the default): Ray's ``PACK``, as few nodes as possible, so most traffic stays
  inside a node (NVLink, shared memory, loopback);
- ``spread``: Ray's ``SPREAD``, as many nodes as possible (more host memory and network
  bandwidth per rank; also how to exercise cross-node paths on purpose).

Whichever nodes the bundles land on, ranks are then *assigned* to bundles so that the ranks
that talk most share a node where the bundles allow (``affinity_units``, ``assign_ranks``):
each tensor- or expert-parallel group is one unit (collectives inside every compute, the
most latency-bound traffic) kept whole on one node if any node has room for it; units are
laid out as pipeline chains (a unit follows the unit it exchanges the most point-to-point
messages with), so pipeline neighbours are adjacent and fill one node before the next;
data-parallel replicas, which talk once per step, end up on different nodes first.

Bad input is refused before anything is reserved (``check_resources``: fewer CPUs or GPUs in
the cluster than the ranks need), and a reservation that Ray cannot satisfy within the
timeout (resources held by others, no node with a big enough share) is released and
reported with what the cluster has available: both ``ClusterError``, never a hang.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from piper_ir import ClusterError, NodeKind, Program, ShardKind
from piper_runtime.rendezvous import LOOPBACK

POLICIES = ("pack", "spread")
# Giving a reservation back takes milliseconds; past this the cluster is going away (``release``).
RELEASE_TIMEOUT_S = 3.0


def affinity_units(program: Program) -> list[tuple[int, ...]]:
    """The program's ranks as units that should share a node, in the order they should fill
    nodes (module doc)."""
    n = program.world_size
    parent = list(range(n))

    def find(r: int) -> int:
        while parent[r] != r:
            parent[r] = parent[parent[r]]
            r = parent[r]
        return r

    shard_traffic = {str(k) for k in ShardKind}
    for comm in program.communicators:
        if str(comm.traffic) in shard_traffic:
            for r in comm.ranks[1:]:
                parent[find(r)] = find(comm.ranks[0])
    members: dict[int, list[int]] = {}
    for r in range(n):
        members.setdefault(find(r), []).append(r)
    units = sorted(tuple(m) for m in members.values())
    unit_of = {r: i for i, u in enumerate(units) for r in u}
    weight: dict[tuple[int, int], int] = {}
    for plan in program.ranks:
        for ins in plan.instructions:
            if ins.kind is NodeKind.SEND and ins.peer is not None:
                a, b = unit_of[plan.rank], unit_of[ins.peer]
                if a != b:
                    key = (min(a, b), max(a, b))
                    weight[key] = weight.get(key, 0) + 1

    def w(a: int, b: int) -> int:
        return weight.get((min(a, b), max(a, b)), 0)

    order = [unit_of[0]] if n else []
    left = set(range(len(units))) - set(order)
    while left:
        last = order[-1]
        nxt = min(left, key=lambda u: (-w(last, u), -sum(w(p, u) for p in order), units[u][0]))
        order.append(nxt)
        left.remove(nxt)
    return [units[u] for u in order]


def assign_ranks(units: Sequence[tuple[int, ...]], bundle_nodes: Sequence[str]) -> list[int]:
    """Rank -> bundle index, given the node each bundle landed on: units in order fill the
    node being filled; a unit that does not fit there goes whole to the first node with room
    for it, and only a unit no node has room for is split."""
    free: dict[str, list[int]] = {}
    for b, node in enumerate(bundle_nodes):
        free.setdefault(node, []).append(b)
    nodes = sorted(free, key=lambda nd: (-len(free[nd]), free[nd][0]))
    ranks = sum(len(u) for u in units)
    if ranks != len(bundle_nodes):
        raise ValueError(f"{ranks} ranks for {len(bundle_nodes)} bundles")
    bundle_of = [-1] * ranks
    current = 0
    for unit in units:
        while current < len(nodes) - 1 and not free[nodes[current]]:
            current += 1
        if len(free[nodes[current]]) < len(unit):
            fits = [i for i, nd in enumerate(nodes) if len(free[nd]) >= len(unit)]
            if fits:
                current = fits[0]
        for r in unit:
            while not free[nodes[current]]:
                current = (current + 1) % len(nodes)
            bundle_of[r] = free[nodes[current]].pop(0)
    return bundle_of


def check_resources(
    world_size: int,
    cpus_per_rank: float,
    gpus_per_rank: float,
    cluster: Mapping[str, float],
    backend: str,
) -> None:
    """``ClusterError`` naming what is missing when ``cluster`` (Ray's total resources) has
    fewer CPUs or GPUs than ``world_size`` ranks need."""
    cpus = cluster.get("CPU", 0.0)
    need_cpus = world_size * cpus_per_rank
    if cpus + 1e-9 < need_cpus:
        raise ClusterError(
            f"the Ray cluster has {cpus:g} CPUs; the program's {world_size} ranks need {need_cpus:g} "
            f"({cpus_per_rank:g} each): add nodes or CPUs to the cluster, or use fewer ranks"
        )
    if gpus_per_rank <= 0:
        return
    gpus = cluster.get("GPU", 0.0)
    need_gpus = math.ceil(world_size * gpus_per_rank - 1e-9)
    if gpus + 1e-9 < world_size * gpus_per_rank:
        share = "one GPU each" if gpus_per_rank >= 1 else f"{gpus_per_rank:g} of a GPU each"
        hint = (
            f"; to share GPUs between ranks, pass --ranks-per-gpu {math.ceil(world_size / gpus)}"
            if gpus >= 1 and gpus_per_rank >= 1
            else ""
        )
        have = "no GPU" if gpus == 0 else f"{gpus:g} GPUs"
        raise ClusterError(
            f"backend {backend!r}: the Ray cluster has {have}; the program's {world_size} ranks need "
            f"{need_gpus} ({share}){hint}"
        )


@attrs.frozen
class Placement:
    """Where the ranks go: the placement group, each rank's bundle, node id and node address."""

    group: Any  # ray.util.placement_group.PlacementGroup
    bundles: tuple[int, ...]  # rank -> bundle index
    nodes: tuple[str, ...]  # rank -> Ray node id
    addresses: tuple[str, ...]  # rank -> that node's address, as Ray reports it
    cpus_per_rank: float
    gpus_per_rank: float
    policy: str

    @property
    def node_count(self) -> int:
        return len(set(self.nodes))

    @property
    def rendezvous_address(self) -> str:
        """Loopback when every rank is on one node, else the address of rank 0's node."""
        return LOOPBACK if self.node_count == 1 else self.addresses[0]

    def actor_options(self, rank: int) -> dict[str, Any]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return {
            "num_cpus": self.cpus_per_rank,
            "num_gpus": self.gpus_per_rank,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                self.group, placement_group_bundle_index=self.bundles[rank]
            ),
        }

    def release(self, timeout_s: float = RELEASE_TIMEOUT_S) -> None:
        """Give the reservation back (the actors in it are killed with it), waiting at most
        ``timeout_s``: Ray's call blocks for good when the cluster's GCS is ending (a SIGTERM
        to every process of a job, as SLURM sends), and a reservation goes with its cluster,
        or with its driver's job, anyway. Past the wait the call goes on in the background."""
        import ray
        from ray.util.placement_group import remove_placement_group

        if not ray.is_initialized():  # gone with Ray; a call now would start a new Ray (``kill_workers``)
            return

        def remove() -> None:
            try:
                remove_placement_group(self.group)
            except Exception:  # already removed, or Ray shut down
                pass

        remover = threading.Thread(target=remove, name="piper-release-placement", daemon=True)
        remover.start()
        remover.join(timeout_s)


@attrs.frozen
class Reservation:
    """One bundle per rank, reserved before the program is known (``reserve``): the
    placement group and each bundle's node; ``assign`` makes it a ``Placement``."""

    group: Any  # ray.util.placement_group.PlacementGroup
    bundle_nodes: tuple[str, ...]  # bundle -> Ray node id
    address_of: Mapping[str, str]  # node id -> its address
    cpus_per_rank: float
    gpus_per_rank: float
    policy: str

    def bundle_options(self, bundle: int) -> dict[str, Any]:
        """The actor options that start an actor in ``bundle``."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return {
            "num_cpus": self.cpus_per_rank,
            "num_gpus": self.gpus_per_rank,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=bundle),
        }

    def assign(self, program: Program) -> Placement:
        """Which rank of ``program`` goes to which bundle (module doc)."""
        if program.world_size != len(self.bundle_nodes):
            raise ValueError(f"{len(self.bundle_nodes)} bundles reserved for a program of {program.world_size} ranks")
        bundles = assign_ranks(affinity_units(program), list(self.bundle_nodes))
        nodes = tuple(self.bundle_nodes[b] for b in bundles)
        return Placement(
            self.group,
            tuple(bundles),
            nodes,
            tuple(self.address_of.get(nd, LOOPBACK) for nd in nodes),
            self.cpus_per_rank,
            self.gpus_per_rank,
            self.policy,
        )


def place_ranks(
    program: Program,
    *,
    cpus_per_rank: float = 1.0,
    gpus_per_rank: float = 0.0,
    policy: str = "pack",
    backend: str = "cpu",
    timeout_s: float = 30.0,
) -> Placement:
    """Reserve one bundle per rank (module doc) and decide which rank goes where."""
    reserved = reserve(program.world_size, cpus_per_rank=cpus_per_rank, gpus_per_rank=gpus_per_rank, policy=policy,
                       backend=backend, timeout_s=timeout_s)
    return reserved.assign(program)


def reserve(
    world: int,
    *,
    cpus_per_rank: float = 1.0,
    gpus_per_rank: float = 0.0,
    policy: str = "pack",
    backend: str = "cpu",
    timeout_s: float = 30.0,
) -> Reservation:
    """Reserve one bundle for each of ``world`` ranks (module doc), within ``timeout_s``."""
    import ray
    from ray.exceptions import GetTimeoutError
    from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

    if policy not in POLICIES:
        raise ValueError(f"placement policy must be one of {list(POLICIES)}, got {policy!r}")
    if cpus_per_rank <= 0:
        raise ValueError(f"cpus_per_rank must be > 0, got {cpus_per_rank!r}")
    check_resources(world, cpus_per_rank, gpus_per_rank, ray.cluster_resources(), backend)
    bundle: dict[str, float] = {"CPU": cpus_per_rank}
    if gpus_per_rank > 0:
        bundle["GPU"] = gpus_per_rank
    group = placement_group([dict(bundle) for _ in range(world)], strategy=policy.upper())
    try:
        ray.get(group.ready(), timeout=timeout_s)
    except GetTimeoutError:
        remove_placement_group(group)
        available = {k: v for k, v in ray.available_resources().items() if k in ("CPU", "GPU")}
        raise ClusterError(
            f"could not reserve {world} ranks ({bundle} each, policy {policy!r}) on the Ray cluster within "
            f"{timeout_s:g} s; available now: {available or 'nothing'} (resources held by other jobs, or no "
            "node with enough of them)"
        ) from None
    table = placement_group_table(group)["bundles_to_node_id"]
    address_of = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")}
    return Reservation(group, tuple(table[b] for b in range(world)), address_of, cpus_per_rank, gpus_per_rank, policy)
