"""``plan_memory``: the data-parallel reductions, gathers and frees of ZeRO 0-3 as graph nodes.

Requires a graph after ``Order`` (docs/ir-conventions.md, sections 1-4) whose
``Graph.replication`` and ``Graph.buckets`` were recorded by ``Replicate`` (section 7).
Guarantees, per bucket ``b`` of each replicated segment ``s`` on group ``G`` (every new node on
``devices=G`` with ``segment=s``, ``value=b.id`` and ``s``'s tags; ``devices=b.devices`` for a
bucket of one shard position of a data x tensor/expert parallel segment, sections 8-9):

- zero 0: ``allreduce.<b>`` after every weight-gradient pass (``B``/``BW``) of ``s``, before
  ``OPT.s``: one reduction per step per bucket, after the last microbatch;
- zero 1: ``reducescatter.<b>`` in its place, then ``allgather.<b>`` after ``OPT.s``;
- zero 2: ``reducescatter.<b>.mb<i>`` after each weight-gradient pass, which also precedes the
  next such pass of ``s`` in the rank's compute order (the full gradient never outlives one
  microbatch), then ``allgather.<b>`` after ``OPT.s``;
- zero 3: as zero 2 without the all-gather, plus ``materialize.<b>.<k>`` / ``free.<b>.<k>``
  around chain ``k`` of uses (``F``/``B``/``BI``/``BW`` of ``s``).

Every bucket of a replicated segment also gets where its state lives (``Bucket.params_home``,
``grads_home``, ``optimizer_home``; ``zero_residency``): zero 0 all full; zero 1 optimizer
state sharded; zero 2 gradients too (between microbatches); zero 3 parameters too
(materialized per use). A runtime reads these, not the ZeRO level.

A segment with mirrored replicas sharded per microbatch group (DualPipe with ZeRO-2/3: its
buckets name ``mirrors``, docs/ir-conventions.md section 7) is planned per group, each group
with its own buckets, passes and chains as if it were a segment of its own; then one
``allreduce.<b>.<j>`` per bucket ``b`` of the first group and shard position ``j``, on the
sorted ranks at position ``j`` of every group, sums that shard's gradient after all their
reduce-scatters and before ``OPT.s``.

A chain is a maximal run of uses of ``s`` in the rank's compute order that no use of another
segment with parameters interrupts: the loss (no parameters) and optimizer steps do not, so
an ``F`` followed by its ``B`` shares one gather. The materialization of a chain waits for the
compute just before its first use and for the free of the chain before it on the rank, so a
rank holds one segment's gathered parameters at a time; the free follows the last use.

Tied parameters (``Graph.ties``, ``piper_memory.ties``) leave their holders' buckets for
buckets of their own, one per unit of holders on the same devices, planned as above with the
passes and uses of every holder of the unit (a reduce-scatter after each holder's pass from
ZeRO-2 on, chains of any holder's uses at ZeRO-3), then summed over the units: one
``allreduce.<b>`` over all their ranks at ZeRO-0, else the mirror sum per shard position, both
on stream ``tie`` before every holder's ``OPT``. Holders sharing one tensor on a rank get
temporal edges from each of their weight-gradient passes to the owner's ``OPT``.

The compute order is ``piper_ir.rank_orders``, the rule ``compile_program`` uses. Every node
added here depends only on nodes that rule has already ordered and is released as soon as it
is ready, so the compile of the planned graph runs compute in the same order. Edges from a
materialization go to every use of its chain and from every use to the free, so a different
order could cost memory but never correctness. The pass is pure: a new graph comes back.
"""

from __future__ import annotations

from collections import defaultdict

import attrs

from piper_ir import (
    BUCKET_KINDS,
    TIE_STREAM,
    Bucket,
    Edge,
    EdgeKind,
    Graph,
    MemoryPlanError,
    Node,
    NodeKind,
    Phase,
    Replication,
    Residency,
    compute_id,
    rank_orders,
    validate,
)
from piper_memory.ties import TieUnit, tie_buckets, tie_units

USE_PHASES = frozenset({Phase.F, Phase.B, Phase.BI, Phase.BW})
GRAD_PHASES = frozenset({Phase.B, Phase.BW})  # the passes that write parameter gradients
PLANNED_KINDS = BUCKET_KINDS
ORIGIN = "plan_memory"


def plan_memory(graph: Graph) -> Graph:
    """``graph`` with the ZeRO nodes and edges of its ``Replication`` records and the buckets
    and sums of its ``Tie`` records (module doc)."""
    if not graph.replication and not graph.ties:
        return graph
    planned = [n.id for n in graph.nodes if n.kind in PLANNED_KINDS]
    if planned:
        raise MemoryPlanError("the graph is already memory-planned", nodes=planned)
    orders = rank_orders(graph)
    if orders is None:
        raise MemoryPlanError("the graph has a cycle; cannot order its compute")
    units = tie_units(graph)
    graph = attrs.evolve(graph, buckets=tie_buckets(graph, units))
    tied = {u.bucket.id for family in units for u in family if u.bucket is not None}
    buckets: dict[str, list[Bucket]] = defaultdict(list)
    for b in graph.buckets:
        if b.id not in tied:
            buckets[b.segment].append(b)
    with_params = {s.id for s in graph.segments if s.params}
    builder = _Builder(graph, orders, with_params)
    zero3: list[_Zero3] = []
    for rep in graph.replication:
        if not buckets.get(rep.segment):
            continue  # nothing to keep in sync (the loss, a segment without parameters)
        for unit, unit_buckets in _units(rep, buckets[rep.segment]):
            builder.reductions(unit, unit_buckets)
            if rep.zero == 3:
                zero3.append(_Zero3((rep.segment, unit.devices), unit, unit_buckets, frozenset({rep.segment})))
        builder.mirror_sums(rep, buckets[rep.segment])
    for family in units:
        zero3 += builder.tie_sums(family)
    builder.materializations(zero3)
    edges = tuple(dict.fromkeys(builder.edges))  # one edge per (src, dst, kind), first kept
    zero = {rep.segment: rep.zero for rep in graph.replication}
    homes = tuple(
        attrs.evolve(b, **zero_residency(zero[b.segment])) if b.segment in zero else b for b in graph.buckets
    )
    return validate(
        attrs.evolve(graph, nodes=graph.nodes + tuple(builder.nodes), edges=graph.edges + edges, buckets=homes)
    )


def zero_residency(zero: int) -> dict[str, Residency]:
    """Where a bucket's parameters, gradients and optimizer state live at ZeRO level ``zero``,
    as ``Bucket`` fields: 0 everything full; 1 optimizer state sharded; 2 gradients too
    (between microbatches); 3 parameters too (materialized per use)."""
    if zero not in (0, 1, 2, 3):
        raise MemoryPlanError(f"ZeRO level {zero!r} is not 0, 1, 2 or 3")
    full, sharded = Residency.FULL, Residency.SHARDED
    return {
        "params_home": sharded if zero >= 3 else full,
        "grads_home": sharded if zero >= 2 else full,
        "optimizer_home": sharded if zero >= 1 else full,
    }


def _units(rep: Replication, buckets: list[Bucket]) -> list[tuple[Replication, list[Bucket]]]:
    """What the ZeRO machinery runs on: the segment's whole group, or, for mirrored buckets
    (``Bucket.mirrors``), each microbatch group with its own buckets, as if it were a
    replicated segment of its own."""
    if not any(b.mirrors for b in buckets):
        return [(rep, buckets)]
    groups: dict[tuple[int, ...], list[Bucket]] = {}
    for b in buckets:
        groups.setdefault(b.devices, []).append(b)
    return [(attrs.evolve(rep, devices=g), bs) for g, bs in groups.items()]


@attrs.frozen
class _Zero3:
    """Buckets whose parameters live sharded, on ``rep.devices``, materialized around each
    chain of uses by the ``users`` segments (one segment; every holder of a tie's unit)."""

    key: tuple[str, tuple[int, ...]]
    rep: Replication
    buckets: list[Bucket]
    users: frozenset[str]


class _Builder:
    """Collects the nodes and edges of one ``plan_memory`` call."""

    def __init__(self, graph: Graph, orders: list[list[str]], with_params: set[str]) -> None:
        self.graph = graph
        self.orders = orders
        self.position = [{nid: i for i, nid in enumerate(order)} for order in orders]
        self.with_params = with_params
        self.nodes: list[Node] = []
        self.edges: list[Edge] = []

    def _node(self, nid: str, kind: NodeKind, rep: Replication, bucket: Bucket, stream: str, mb: int | None = None) -> str:
        seg = self.graph.segment_by_id[rep.segment]
        devices = bucket.devices or rep.devices  # a shard's replicas, or the whole group
        self.nodes.append(
            Node(nid, kind, rep.segment, None, mb, seg.tags, devices, stream, bucket.id, origin=rep.origin or ORIGIN)
        )
        return nid

    def _data(self, src: str, dst: str) -> None:
        self.edges.append(Edge(src, dst, EdgeKind.DATA))

    def _after(self, src: str, dst: str, why: str) -> None:
        self.edges.append(Edge(src, dst, EdgeKind.TEMPORAL, origin=f"{ORIGIN}: {why}"))

    def _segment_nodes(self, rep: Replication) -> tuple[list[Node], str]:
        """The weight-gradient passes of the segment in the compute order of its first
        device, and its optimizer node."""
        order = self.position[rep.devices[0]]
        group = set(rep.devices)  # a mirrored unit's: only the passes its group runs
        grads = [
            n
            for n in self.graph.nodes
            if n.segment == rep.segment
            and n.kind is NodeKind.COMPUTE
            and n.phase in GRAD_PHASES
            and group.issuperset(n.devices)
        ]
        grads.sort(key=lambda n: order.get(n.id, -1))
        opts = [n.id for n in self.graph.nodes if n.segment == rep.segment and n.kind is NodeKind.OPTIMIZER]
        if len(opts) != 1 or not grads:
            raise MemoryPlanError(
                f"replicated segment {rep.segment} needs one optimizer node and a backward; found "
                f"{len(opts)} optimizer node(s) and {len(grads)} weight-gradient pass(es)",
                directive=rep.origin,
                nodes=opts,
            )
        return grads, opts

    def reductions(
        self, rep: Replication, buckets: list[Bucket], passes: tuple[list[Node], list[str]] | None = None
    ) -> None:
        """The reductions of ``buckets`` after the weight-gradient passes and before the
        optimizer steps ``passes`` names (default: ``rep.segment``'s, ``_segment_nodes``)."""
        grads, opts = passes or self._segment_nodes(rep)
        for b in buckets:
            if rep.zero == 0:
                ar = self._node(f"allreduce.{b.id}", NodeKind.ALL_REDUCE, rep, b, rep.reduce_stream)
                for g in grads:
                    self._data(g.id, ar)
                for opt in opts:
                    self._data(ar, opt)
                continue
            if rep.zero == 1:
                rs = self._node(f"reducescatter.{b.id}", NodeKind.REDUCE_SCATTER, rep, b, rep.reduce_stream)
                for g in grads:
                    self._data(g.id, rs)
                for opt in opts:
                    self._data(rs, opt)
            else:
                for g, nxt in zip(grads, [*grads[1:], None], strict=True):
                    mb = 0 if g.microbatch is None else g.microbatch
                    # Another holder's pass of a tied parameter's bucket: named after its segment.
                    of = "" if g.segment == rep.segment else f"{g.segment}."
                    rs = self._node(
                        f"reducescatter.{b.id}.{of}mb{mb}", NodeKind.REDUCE_SCATTER, rep, b, rep.reduce_stream,
                        g.microbatch,
                    )
                    self._data(g.id, rs)
                    for opt in opts:
                        self._data(rs, opt)
                    if nxt is not None:
                        # The next pass accumulates into the buffer this reduce-scatter empties.
                        self._after(rs, nxt.id, "gradient buffer reused by the next microbatch")
            if rep.zero < 3:
                ag = self._node(f"allgather.{b.id}", NodeKind.ALL_GATHER, rep, b, rep.gather_stream)
                for opt in opts:
                    self._data(opt, ag)

    def tie_sums(self, family: list[TieUnit]) -> list[_Zero3]:
        """One family of a tie's units (``piper_memory.ties``): each unit's holders step one
        tensor after all their passes; each unit's bucket is reduced within the unit as its
        owner's ZeRO level says (its holders' passes and optimizer steps); then the units'
        gradients are summed on stream ``tie``. Returns the units whose parameters live
        sharded (ZeRO-3), for ``materializations``."""
        zero3: list[_Zero3] = []
        passes: dict[str, tuple[list[Node], list[str]]] = {}
        for unit in family:
            grads, opts = self._holder_nodes(unit)
            passes[unit.owner] = (grads, opts)
            owner_opt = compute_id(Phase.OPT, unit.owner)
            if len(unit.holders) > 1:
                for g in grads:
                    self._after(g.id, owner_opt, "tied holders share one tensor, stepped by its owner")
            if unit.bucket is None or unit.replication.zero == 0:
                continue
            self.reductions(unit.replication, [unit.bucket], (grads, opts))
            if unit.replication.zero == 3:
                zero3.append(_Zero3((f"tie:{unit.bucket.id}", unit.devices), unit.replication, [unit.bucket],
                                    frozenset(unit.holders)))
        with_bucket = [u for u in family if u.bucket is not None]
        if not with_bucket:
            return zero3
        first = with_bucket[0]
        grads = [g for u in with_bucket for g in passes[u.owner][0]]
        opts = [o for u in with_bucket for o in passes[u.owner][1]]
        sums: list[tuple[str, tuple[int, ...]]] = []
        if first.replication.zero == 0:
            sums.append((f"allreduce.{first.bucket.id}", tuple(sorted({d for u in with_bucket for d in u.devices}))))
        elif len(with_bucket) > 1:
            sums += [
                (f"allreduce.{first.bucket.id}.{j}", tuple(sorted(u.devices[j] for u in with_bucket)))
                for j in range(len(first.devices))
            ]
        family_ids = {u.bucket.id for u in with_bucket}
        scatters = [n.id for n in self.nodes if n.kind is NodeKind.REDUCE_SCATTER and n.value in family_ids]
        seg = self.graph.segment_by_id[first.owner]
        for nid, devices in sums:
            self.nodes.append(
                Node(nid, NodeKind.ALL_REDUCE, first.owner, None, None, seg.tags, devices, TIE_STREAM,
                     first.bucket.id, origin=first.replication.origin or ORIGIN)
            )
            for src in scatters or [g.id for g in grads]:
                self._data(src, nid)
            for opt in opts:
                self._data(nid, opt)
        return zero3

    def _holder_nodes(self, unit: TieUnit) -> tuple[list[Node], list[str]]:
        """The weight-gradient passes of a tie unit's holders on its devices, in the compute
        order of its first device, and their optimizer nodes."""
        order = self.position[unit.devices[0]]
        devices = set(unit.devices)
        holders = set(unit.holders)
        grads = [
            n
            for n in self.graph.nodes
            if n.segment in holders and n.kind is NodeKind.COMPUTE and n.phase in GRAD_PHASES
            and devices.intersection(n.devices)
        ]
        grads.sort(key=lambda n: order.get(n.id, -1))
        opts = [n.id for n in self.graph.nodes if n.segment in holders and n.kind is NodeKind.OPTIMIZER]
        return grads, opts

    def mirror_sums(self, rep: Replication, buckets: list[Bucket]) -> None:
        """Mirrored buckets: position ``j`` of every group holds the same shard range; one
        ``allreduce.<b>.<j>`` per bucket ``b`` of the first group sums that shard's gradient
        over those ranks (sorted), after every group's reduce-scatters and before ``OPT.s``."""
        firsts = [b for b in buckets if b.mirrors and b.devices == buckets[0].devices]
        if not firsts:
            return
        by_id = {b.id: b for b in buckets}
        _, (opt,) = self._segment_nodes(rep)
        seg = self.graph.segment_by_id[rep.segment]
        scatters: dict[str, list[str]] = defaultdict(list)
        for n in self.nodes:
            if n.kind is NodeKind.REDUCE_SCATTER and n.segment == rep.segment:
                scatters[n.value].append(n.id)
        for b in firsts:
            family = [b, *(by_id[m] for m in b.mirrors)]
            for j in range(len(b.devices)):
                devices = tuple(sorted(m.devices[j] for m in family))
                nid = f"allreduce.{b.id}.{j}"
                self.nodes.append(
                    Node(
                        nid, NodeKind.ALL_REDUCE, rep.segment, None, None, seg.tags, devices,
                        rep.reduce_stream, b.id, origin=rep.origin or ORIGIN,
                    )
                )
                for m in family:
                    for rs in scatters[m.id]:
                        self._data(rs, nid)
                self._data(nid, opt)

    def materializations(self, zero3: list[_Zero3]) -> None:
        """MATERIALIZE/FREE per chain of uses, for every ZeRO-3 segment (module doc); a
        mirrored segment's groups count as segments of their own (``_units``), a tie's unit
        as one whose uses are its holders'."""
        if not zero3:
            return
        by_key = {z.key: z for z in zero3}
        nodes = self.graph.node_by_id
        # Chains per unit, read off the compute order of the unit's first device.
        chains: dict[tuple[str, tuple[int, ...]], list[list[str]]] = {}
        for z in zero3:
            runs: list[list[str]] = []
            open_run = False
            for nid in self.orders[z.rep.devices[0]]:
                n = nodes[nid]
                if n.kind is not NodeKind.COMPUTE or n.phase not in USE_PHASES:
                    continue
                if n.segment in z.users:
                    if not open_run:
                        runs.append([])
                        open_run = True
                    runs[-1].append(nid)
                elif n.segment in self.with_params:
                    open_run = False
            chains[z.key] = runs
        for key, runs in chains.items():
            z = by_key[key]
            rep = z.rep
            for k, run in enumerate(runs):
                for b in z.buckets:
                    mat = self._node(f"materialize.{b.id}.{k}", NodeKind.MATERIALIZE, rep, b, rep.gather_stream)
                    free = self._node(f"free.{b.id}.{k}", NodeKind.FREE, rep, b, rep.gather_stream)
                    for use in run:
                        self._data(mat, use)
                        self._after(use, free, "gathered parameters live until the chain's last use")
                    if k > 0:
                        self._after(f"free.{b.id}.{k - 1}", mat, "one gathered copy of a bucket at a time")
                    for d in b.devices or rep.devices:
                        self._wait_for_previous(mat, run[0], d, by_key, chains)

    def _wait_for_previous(self, mat: str, first: str, rank: int, by_key: dict, chains: dict) -> None:
        """``mat`` after the compute before ``first`` on ``rank`` and, when that compute ends a
        chain of another ZeRO-3 segment there, after that chain's frees."""
        order, position = self.orders[rank], self.position[rank]
        i = position.get(first)
        if not i:
            return
        nodes = self.graph.node_by_id
        prev = None
        for j in range(i - 1, -1, -1):
            if nodes[order[j]].kind in (NodeKind.COMPUTE, NodeKind.OPTIMIZER):
                prev = order[j]
                break
        if prev is None:
            return
        self._after(prev, mat, "gather after the compute before the chain")
        # The chain (of another ZeRO-3 segment) that was open last on this rank before ``first``.
        last: tuple[int, tuple[str, tuple[int, ...]], int] | None = None
        for key, runs in chains.items():
            z = by_key[key]
            if nodes[first].segment in z.users or rank not in z.rep.devices:
                continue
            for k, run in enumerate(runs):
                end = position.get(run[-1], -1)
                if end < i and (last is None or end > last[0]):
                    last = (end, key, k)
        if last is not None:
            _, key, k = last
            for b in by_key[key].buckets:
                if not b.devices or rank in b.devices:
                    self._after(f"free.{b.id}.{k}", mat, "free the previous chain's parameters first")
