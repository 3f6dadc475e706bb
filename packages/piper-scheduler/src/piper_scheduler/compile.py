"""Lower a placed, ordered global graph to a verified ``Program`` (one plan per rank).

Requires a graph after Split/Place/Order (``docs/ir-conventions.md`` sections 1-4): every
COMPUTE/OPTIMIZER node has ``devices``; cross-device data flows through SEND/RECV pairs.
Guarantees (section 5): each rank's list is a valid sequential order, matched send/receive
sequences per (communicator, src, dst), events between streams, and ``verify`` passes.

Stages, each linear in nodes + edges (tables by segment and bucket are built once, never
searched per node; the whole compile runs with the cyclic garbage collector paused,
``piper_ir.gc_paused``):

1. ``_compute_orders`` (``piper_ir.rank_order_positions``: ``rank_orders``, shared with
   ``piper_memory.plan_memory``, by position in ``graph.nodes``, as every stage names nodes):
   one Kahn pass over the whole graph (data and temporal edges, all ranks at once) so
   cross-rank paths through SEND/RECV are respected. Nodes that are not scheduled by
   themselves (SEND, RECV, unplaced markers) are released as soon as they are ready; ready
   compute nodes leave a heap by (phase, microbatch, segment position). Phase comes first so a
   graph without Order edges runs GPipe-like: all forwards, then all backwards, on each rank.
   Group operations of data parallelism (ALL_REDUCE, REDUCE_SCATTER, ALL_GATHER, MATERIALIZE,
   FREE; section 7) are listed on every member as soon as they are ready, so every member
   issues a group's collectives in the one global order.
   ``_optimizer_steps_early`` then moves, on each rank, an OPTIMIZER that only the rank's
   own work follows up to just after its segment's last backward: a rank holding several
   segments (interleaved 1F1B, DualPipe) steps one while it waits for the others' gradients.
2. ``_place_sends``: each SEND goes right after its last local predecessor (its producer).
   The sender's list fixes the message order of every channel.
3. ``_place_recvs``: each RECV goes right before the first local instruction that needs it;
   receives that the channel order puts earlier are pulled in with it, so both sides of a
   channel agree (in-order matching, as NCCL requires). This keeps deadlock freedom: every
   pulled receive's send precedes, on its rank, the send of the receive that was needed.
   An overlapped slot (DualPipe's F&B) receives what all its members need before its first
   member, as DeepSeek's DualPipe does, so the backward chunk's input never queues behind
   the forward chunk's send on the pp stream; a slot whose backward needs its own forward
   (where that would deadlock, which ``verify`` finds) keeps one receive per member.
4. ``_add_events``: a dependency between two streams of one rank becomes an event.
"""

from __future__ import annotations

from typing import NoReturn

import attrs

from piper_ir import (
    BUCKET_KINDS,
    COMPUTE_KINDS,
    Bucket,
    DeadlockError,
    ExecutionOptions,
    Graph,
    Instruction,
    Node,
    NodeKind,
    Phase,
    Program,
    RankPlan,
    SchedulingError,
    Sharding,
    ShardKind,
    TensorMeta,
    cycle_error,
    event_id,
    gc_paused,
    is_acyclic,
    rank_order_positions,
    slot_maker,
    validate,
)
from piper_scheduler.communicators import (
    communicator_for,
    communicators_for,
    group_communicator,
    norm_communicator,
    tp_communicator,
)
from piper_scheduler.kinds import COMPUTE, GRAD_NORM, MARKER, OPTIMIZER, RECV, SEND, TEMPORAL
from piper_scheduler.verify import verify

SCHEDULED_KINDS = COMPUTE_KINDS
PASS_THROUGH_KINDS = frozenset({NodeKind.SEND, NodeKind.RECV, NodeKind.MARKER})
P2P_KINDS = frozenset({NodeKind.SEND, NodeKind.RECV})
# Operations of a replicated segment's device group on one bucket (docs/ir-conventions.md,
# section 7); every member of ``devices`` gets the instruction.
GROUP_KINDS = BUCKET_KINDS
# Listed on every member of their group, as soon as ready: the bucket operations and the
# gradient norm (section 10), a collective over the world.
LISTED_KINDS = GROUP_KINDS | {NodeKind.GRAD_NORM}
OVERLAP_PHASES = frozenset({Phase.F, Phase.B, Phase.BI})

Channel = tuple[str, int, int]
ComputeGroups = set[tuple[str | None, tuple[int, ...]]]
"""(segment, device group) pairs of compute nodes (``_compute_groups``)."""

# ``Instruction``'s fields in the order its ``__init__`` takes them. ``_rank_plan`` passes
# them by position to ``make_instruction`` (``piper_ir.slot_maker``: ``waits`` passed as the
# tuple its converter makes): by keyword through ``__init__``, matching thirteen names made
# an instruction cost 2.3 us, by position 1.3 us, through ``slot_maker`` 0.4 us (392k
# instructions at 16,384 devices).
INSTRUCTION_FIELDS = (
    "id", "kind", "stream", "segment", "phase", "microbatch", "value", "peer", "communicator", "meta",
    "waits", "record", "overlap",
)
if tuple(a.name for a in attrs.fields(Instruction)) != INSTRUCTION_FIELDS:
    raise ImportError("piper_ir.Instruction's fields changed: update piper_scheduler.compile.INSTRUCTION_FIELDS")
make_instruction = slot_maker(Instruction)


def compile_program(graph: Graph, execution: ExecutionOptions | None = None) -> Program:
    """Per-rank instruction lists for ``graph``, verified before they are returned.
    ``execution``: how far the runtime may run ahead of the plan (``Program.execution``;
    default ``ExecutionOptions()``), which the memory estimate reads too."""
    with gc_paused():
        return _compile(graph, execution or ExecutionOptions())


def _compile(graph: Graph, execution: ExecutionOptions) -> Program:
    # The cycle check of ``validate`` is the Kahn pass of ``_compute_orders``: a graph that
    # fails it gets the same ValidationError, raised at the same point of the checks.
    validate(graph, cycles=False)
    if graph.world_size < 1:
        if not is_acyclic(graph):
            raise cycle_error(graph)
        raise SchedulingError("the graph is not placed (world_size is 0); run Place first")
    orders = _compute_orders(graph)
    tables = _Tables.of(graph)
    _check_supported(graph, tables)
    overlap = _overlapped_slots(graph)
    orders = _optimizer_steps_early(graph, orders, overlap)
    sends = _place_sends(graph, orders)
    groups = _compute_groups(graph)
    replica = _replicas(graph, tables, groups)
    program = _program(graph, _place_recvs(graph, orders, sends, overlap), overlap, replica, tables, groups, execution)
    try:
        verify(program)
    except DeadlockError:
        if not overlap:
            raise
        # Receiving a slot's inputs up front waits for what one of its own members produces
        # (a slot whose backward needs its forward): receive before each member instead.
        program = _program(graph, _place_recvs(graph, orders, sends, {}), overlap, replica, tables, groups, execution)
        verify(program)
    return program


def _program(
    graph: Graph,
    lists: list[list[int]],
    overlap: dict[str, tuple],
    replica: list[int],
    tables: _Tables,
    groups: ComputeGroups,
    execution: ExecutionOptions,
) -> Program:
    """``groups``: ``_compute_groups(graph)``."""
    return Program(
        world_size=graph.world_size,
        ranks=[_rank_plan(graph, r, ids, overlap, replica[r], tables) for r, ids in enumerate(lists)],
        communicators=communicators_for(graph),
        segments=graph.segments,
        values=graph.values,
        inputs=graph.inputs,
        targets=graph.targets,
        microbatches=graph.microbatches,
        placement=_placement(graph, groups),
        replicas=max((len(group) // tables.degree(segment) for segment, group in groups), default=1),
        replication=graph.replication,
        buckets=graph.buckets,
        sharding=graph.sharding,
        execution=execution,
        ties=graph.ties,
        precision=graph.precision,
        grad_norm=graph.grad_norm,
    )


class _Tables:
    """What the stages look up per node, indexed once per graph: buckets by id, per segment
    its tensor-parallel degree and the sharding whose collectives its compute issues (a scan
    of ``graph.buckets`` / ``graph.sharding`` per node would grow with nodes x segments), and
    per value the communicator and meta of its transfers (two thirds of a pipeline's
    instructions are SENDs and RECVs)."""

    def __init__(
        self,
        buckets: dict[str, Bucket],
        degrees: dict[str, int],
        collectives: dict[str, Sharding],
        transfers: dict[str, tuple[str, TensorMeta]],
    ) -> None:
        self.buckets = buckets
        self.degrees = degrees
        self.collectives = collectives
        self.transfers = transfers

    @classmethod
    def of(cls, graph: Graph) -> _Tables:
        degrees: dict[str, int] = {}
        collectives: dict[str, Sharding] = {}
        for sh in graph.sharding:  # the first entry of a segment wins, as a scan would find it
            if sh.kind is ShardKind.TP:
                degrees.setdefault(sh.segment, sh.degree)
            if sh.collectives:
                collectives.setdefault(sh.segment, sh)
        transfers = {v.name: (communicator_for(v.name), v.meta) for v in graph.values}
        return cls({b.id: b for b in graph.buckets}, degrees, collectives, transfers)

    def degree(self, segment: str | None) -> int:
        """The tensor-parallel degree of ``segment`` (1 unless it is tensor-sharded; the ranks
        of an expert-parallel group are data-parallel replicas)."""
        return self.degrees.get(segment, 1) if segment is not None else 1


def _check_supported(graph: Graph, tables: _Tables) -> None:
    for n in graph.nodes:
        if n.kind in SCHEDULED_KINDS and not n.devices:
            raise SchedulingError(f"{n.kind.value} node {n.id} has no devices; run Place first", nodes=[n.id])
        if n.kind in GROUP_KINDS:
            _check_group_node(n, tables)
        elif n.kind is GRAD_NORM:
            _check_norm_node(graph, n)
        elif n.kind not in SCHEDULED_KINDS and n.kind not in PASS_THROUGH_KINDS:
            raise SchedulingError(
                f"node {n.id} of kind {n.kind.value} is not supported by compile_program yet",
                nodes=[n.id],
            )
        if n.kind is MARKER and n.devices:
            raise SchedulingError(f"placed marker node {n.id} is not supported yet", nodes=[n.id])
        if n.kind in P2P_KINDS and n.value is None:
            raise SchedulingError(f"{n.kind.value} node {n.id} carries no value", nodes=[n.id])


def _compute_orders(graph: Graph) -> list[list[int]]:
    """Each rank's COMPUTE/OPTIMIZER nodes (and its group operations), by position in
    ``graph.nodes``, in a deterministic topological order: ``piper_ir.rank_order_positions``
    (``rank_orders``, shared with ``piper_memory.plan_memory``, by position).

    Group operations (collectives, MATERIALIZE, FREE) are listed on every member at the
    moment the one global pass releases them, so every member issues a group's collectives
    in the same order, and each runs as soon as its inputs are ready (a reduction overlaps
    the remaining backward work)."""
    orders = rank_order_positions(graph, LISTED_KINDS)
    if orders is None:  # the pass stalled: the graph has a cycle
        raise cycle_error(graph)
    return orders


def _optimizer_steps_early(graph: Graph, orders: list[list[int]], overlap: dict[str, tuple]) -> list[list[int]]:
    """Each rank's order with its optimizer steps moved up within the rank's *tail*: the
    longest end of its list whose nodes are COMPUTE/OPTIMIZER nodes of this rank alone, every
    successor one too. Nothing another rank waits for this step is in a tail (no send, no
    collective: a reduction or the gradient norm ends it), so its nodes' release times are
    fixed, and running a ready step of fixed length sooner never ends the rank later. An
    OPTIMIZER of the tail whose predecessors are all compute nodes of this rank moves to just
    after the last of them in the tail (its segment's last weight gradient), at the tail's
    start if none is in it, past an overlapped slot (DualPipe's F&B) rather than into it; one
    that would pass only other steps stays.

    This is where the steady-state step gains: on interleaved 1F1B's first rank, the later
    segment's step ran after the earlier segment's last backwards, which wait for the next
    rank's gradients; it now runs while they do (pp=2, the ``stack`` model: 1.6-2.7 ms of a
    116-118 ms step, alternated, ``benchmarks/bench_timeline.py``).

    A graph with tied parameters (``graph.ties``) keeps its order: temporal edges already
    hold a shared tensor's step after every holder's passes, which this would respect, but
    the runtime's aliasing of tied tensors was never run with steps moved. Linear in the
    tails and their edges."""
    if graph.ties:
        return orders
    nodes, succ, pred = graph.nodes, graph.successor_positions, graph.predecessor_positions
    assert succ is not None and pred is not None  # a validated graph has positions
    overlap_at = {graph.node_position[nid]: key for nid, key in overlap.items()}
    out = []
    for rank, order in enumerate(orders):
        mine = (rank,)

        def alone(j: int, mine: tuple[int, ...] = mine) -> bool:
            n = nodes[j]
            return n.devices == mine and n.kind in SCHEDULED_KINDS

        start = len(order)
        while start and alone(order[start - 1]) and all(alone(j) for j in succ[order[start - 1]]):
            start -= 1
        tail = order[start:]
        where = {p: i for i, p in enumerate(tail)}
        after: dict[int, list[int]] = {}
        for p in tail:
            if nodes[p].kind is not OPTIMIZER or not all(alone(j) for j in pred[p]):
                continue
            anchor = max((where[j] for j in pred[p] if j in where), default=-1)
            # ``anchor`` counts from the tail's start; -1 is the node before it, if any
            while anchor + 1 < len(tail) and start + anchor >= 0:
                slot = overlap_at.get(order[start + anchor])
                if slot is None or overlap_at.get(tail[anchor + 1]) != slot:
                    break
                anchor += 1
            if any(nodes[q].kind is not OPTIMIZER for q in tail[anchor + 1:where[p]]):  # past compute
                after.setdefault(anchor, []).append(p)
        if not after:
            out.append(order)
            continue
        moved = {p for ps in after.values() for p in ps}
        new = order[:start] + after.get(-1, [])
        for i, p in enumerate(tail):
            if p not in moved:
                new.append(p)
            new.extend(after.get(i, ()))
        out.append(new)
    return out


# The stages below name nodes by their position in ``graph.nodes`` and walk edges by
# ``Graph.successor_positions`` / ``predecessor_positions`` (a validated graph has them): a
# table keyed by node id, looked up once per edge, outgrows the CPU's caches at 392k nodes,
# and walking a rank's list by id took 2.7x as long as by position.


def _place_sends(graph: Graph, orders: list[list[int]]) -> list[dict[int, list[int]]]:
    """Per rank: index in the compute order -> SENDs (positions) that follow it (-1: before all)."""
    positions = [{p: i for i, p in enumerate(order)} for order in orders]
    nodes, starts = graph.nodes, graph.predecessor_positions
    assert starts is not None  # a validated graph has positions
    after: list[dict[int, list[int]]] = [{} for _ in orders]
    for k, n in enumerate(nodes):
        if n.kind is not SEND:
            continue
        for d in n.devices:
            anchor = -1
            for j in starts[k]:
                p = nodes[j]
                if d not in p.devices:
                    continue
                if p.kind is RECV:
                    raise SchedulingError(
                        f"send {n.id} forwards received value {p.id} on rank {d} without compute; "
                        "relaying is not supported yet",
                        nodes=[n.id, p.id],
                        ranks=[d],
                    )
                anchor = max(anchor, positions[d].get(j, -1))
            after[d].setdefault(anchor, []).append(k)
    return after


def _matching_recv(graph: Graph, send: int, src: int, dst: int) -> int:
    """The RECV (position) on ``dst`` that the SEND at position ``send`` on ``src`` feeds:
    the first end of its edges, in edge order, that receives from ``src``."""
    nodes = graph.nodes
    for j in graph.successor_positions[send]:  # type: ignore[index]
        r = nodes[j]
        if r.kind is RECV and dst in r.devices and r.peers[r.devices.index(dst)] == src:
            return j
    raise SchedulingError(
        f"send {nodes[send].id} on rank {src} to rank {dst} has no receive on rank {dst}",
        nodes=[nodes[send].id],
        ranks=[src, dst],
    )


def _place_recvs(
    graph: Graph, orders: list[list[int]], sends: list[dict[int, list[int]]], overlap: dict[str, tuple]
) -> list[list[int]]:
    """Full per-rank lists of node positions: sends after producers, receives before
    consumers; the consumers of an overlapped slot (``overlap``: node id -> slot key) count
    as one, at the slot's first member."""
    nodes, starts = graph.nodes, graph.predecessor_positions
    assert starts is not None  # a validated graph has positions
    # Each channel's receives in the sender's order.
    channels: dict[Channel, list[int]] = {}
    comms: dict[str, str] = {}  # value -> ``communicator_for`` it: a value has many transfers
    for src in range(len(orders)):
        for anchor in sorted(sends[src]):  # the sender's list order
            for k in sends[src][anchor]:
                send = nodes[k]
                value = send.value or ""
                comm = comms.get(value)
                if comm is None:
                    comm = comms[value] = communicator_for(value)
                dst = send.peers[send.devices.index(src)]  # ``_peer``
                key = (comm, src, dst)
                rids = channels.get(key)
                if rids is None:
                    rids = channels[key] = []
                rids.append(_matching_recv(graph, k, src, dst))
    slot: dict[tuple[int, int], tuple[Channel, int]] = {}
    for key, rids in channels.items():
        for i, rid in enumerate(rids):
            slot[(rid, key[2])] = (key, i)
    cursor = dict.fromkeys(channels, 0)
    # per position, the ranks of a receive (none for other nodes): one lookup per edge tells
    # a receive on this rank
    recv_ranks = [n.devices if n.kind is RECV else () for n in nodes]
    into: dict[int, list[Channel]] = {}  # destination rank -> its channels, sorted
    for key in sorted(channels):
        into.setdefault(key[2], []).append(key)
    slot_at = {graph.node_position[nid]: key for nid, key in overlap.items()}  # by position

    lists: list[list[int]] = []
    slot_of = slot.get
    for rank, order in enumerate(orders):
        out: list[int] = list(sends[rank].get(-1, ()))

        def pull(rid: int, rank: int = rank, out: list[int] = out) -> None:
            if (rid, rank) not in slot:
                raise SchedulingError(
                    f"receive {nodes[rid].id} on rank {rank} has no matching send", nodes=[nodes[rid].id], ranks=[rank]
                )
            key, i = slot[(rid, rank)]
            rids = channels[key]
            while cursor[key] <= i:
                out.append(rids[cursor[key]])
                cursor[key] += 1

        # An overlapped slot receives what all its members need before its first member.
        members: dict[tuple, list[int]] = {}
        for p in order if slot_at else ():
            if p in slot_at:
                members.setdefault(slot_at[p], []).append(p)
        following = sends[rank].get
        for i, p in enumerate(order):
            if slot_at and p in slot_at:
                for m in members.pop(slot_at[p], ()):
                    for j in starts[m]:
                        if rank in recv_ranks[j]:
                            pull(j)
            else:  # the common case, one node: no member list
                for j in starts[p]:
                    if rank in recv_ranks[j]:
                        # nearly always the next receive of its channel: taken here; the
                        # others (earlier ones pulled in with it, none to take) are ``pull``'s
                        at = slot_of((j, rank))
                        if at is not None and cursor[at[0]] == at[1]:
                            out.append(j)
                            cursor[at[0]] += 1
                        else:
                            pull(j)
            out.append(p)
            sent = following(i)
            if sent is not None:
                out.extend(sent)
        for key in into.get(rank, ()):  # receives nobody here consumes
            if cursor[key] < len(channels[key]):
                pull(channels[key][-1])
        lists.append(out)
    return lists


def _check_group_node(n: Node, tables: _Tables) -> None:
    if len(n.devices) < 2:
        raise SchedulingError(f"{n.kind.value} node {n.id} needs a group of two or more devices", nodes=[n.id])
    if n.value not in tables.buckets:
        raise SchedulingError(
            f"{n.kind.value} node {n.id} names {n.value!r}, which is not a bucket of the graph", nodes=[n.id]
        )


def _check_norm_node(graph: Graph, n: Node) -> None:
    if graph.grad_norm is None:
        raise SchedulingError(f"gradient norm node {n.id}: the graph has no GradNorm (what each rank counts)", nodes=[n.id])
    if tuple(sorted(n.devices)) != tuple(range(graph.world_size)):
        raise SchedulingError(
            f"gradient norm node {n.id} runs on {list(n.devices)}, not on every one of the {graph.world_size} devices",
            nodes=[n.id],
        )


def _replicas(graph: Graph, tables: _Tables, groups: ComputeGroups) -> list[int]:
    """Each rank's position in the device groups of the compute it runs (its replica index);
    a rank must hold the same position in all of them. The ranks of a tensor-parallel group
    share one replica index: they see the same data. Optimizer nodes do not count: a
    segment's optimizer runs on every device holding its parameters, which for mirrored
    replicas (DualPipe) is larger than the group any microbatch runs on.

    ``groups``: ``_compute_groups(graph)``, each (segment, group) once, which tell the
    positions when every rank holds one; otherwise the walk over the nodes names the first
    node that gives a rank a second one."""
    replica: dict[int, int] = {}
    for segment, devices in groups:
        degree = tables.degree(segment)
        for j, d in enumerate(devices):
            if replica.setdefault(d, j // degree) != j // degree:
                _replica_conflict(graph, tables)
    return [replica.get(r, 0) for r in range(graph.world_size)]


def _replica_conflict(graph: Graph, tables: _Tables) -> NoReturn:
    """Raise for the first compute node, in graph order, that puts a rank at a second
    position (``_replicas``)."""
    position: dict[int, tuple[int, str]] = {}
    for n in graph.nodes:
        if n.kind is not COMPUTE:
            continue
        degree = tables.degree(n.segment)
        for j, d in enumerate(n.devices):
            j //= degree
            seen = position.setdefault(d, (j, n.id))
            if seen[0] != j:
                raise SchedulingError(
                    f"rank {d} is replica {seen[0]} of the group of {seen[1]} but replica {j} of the group "
                    f"of {n.id} ({list(n.devices)}); a rank must hold one position in all its device groups",
                    nodes=[seen[1], n.id],
                    ranks=[d],
                )
    raise AssertionError("_replicas saw a rank at two positions, the nodes at one")


def _overlapped_slots(graph: Graph) -> dict[str, tuple]:
    """Compute node id -> a key shared by the nodes of one ``Order`` slot that holds both a
    forward and a backward (B or BI) chunk: DualPipe's overlapped F&B.

    The graph does not name slots, but ``Order`` links every node of slot k to every node of
    the next slot on the same device with a temporal edge carrying its ``origin``; so nodes of
    one slot are exactly those with the same device and the same ordered predecessors and
    successors. Linear in the number of such edges.
    """
    # the ordered edges picked out first, in one tight pass: a fifth of a pipeline's edges
    ordered = [e for e in graph.edges if e.kind is TEMPORAL and e.origin is not None]
    # A node that is the only successor of its predecessors (or, with none, the only
    # predecessor of its successors) shares its slot with no other node: nearly every node.
    # ``forks`` (starts with two or more successors) and ``joins`` (ends with two or more
    # predecessors), found with two tables made in C, tell the few others (``near``); the
    # sets of ordered neighbours are made for the edges around those alone (0.1 s against
    # 0.3 at 16,384 devices, where every edge had its sets).
    last_after = {e.src: e.dst for e in ordered}
    last_before = {e.dst: e.src for e in ordered}
    forks = {e.src for e in ordered if last_after[e.src] != e.dst}
    joins = {e.dst for e in ordered if last_before[e.dst] != e.src}
    if not forks and not joins:
        return {}
    near = {e.dst for e in ordered if e.src in forks} | {e.src for e in ordered if e.dst in joins}
    preds: dict[str, set[str]] = {}
    succs: dict[str, set[str]] = {}
    # Every edge into or out of a node of ``near``: each set the loop below reads is whole.
    for e in [e for e in ordered if e.src in near or e.dst in near]:
        src, dst = e.src, e.dst
        before, after = preds.get(dst), succs.get(src)
        if before is None:
            preds[dst] = {src}
        else:
            before.add(src)
        if after is None:
            succs[src] = {dst}
        else:
            after.add(dst)
    groups: dict[tuple, list[Node]] = {}
    for n in graph.nodes:
        if n.kind is COMPUTE and n.id in near and n.phase in OVERLAP_PHASES and (n.id in preds or n.id in succs):
            before, after = preds.get(n.id), succs.get(n.id)
            # A node that is the only successor of one of its predecessors (or the only
            # predecessor of one of its successors) shares its slot with no other node: every
            # slot in 1F1B-like schedules. Only the rest need the key's two sets.
            if len(succs[next(iter(before))] if before else preds[next(iter(after))]) == 1:  # type: ignore[arg-type]
                continue
            key = (n.devices, frozenset(before or ()), frozenset(after or ()))
            groups.setdefault(key, []).append(n)
    out: dict[str, tuple] = {}
    for key, members in groups.items():
        phases = {n.phase for n in members}
        if Phase.F in phases and phases & {Phase.B, Phase.BI}:
            out.update((n.id, key) for n in members)
    return out


def _rank_plan(
    graph: Graph,
    rank: int,
    ids: list[int],
    overlap: dict[str, tuple],
    replica: int,
    tables: _Tables,
) -> RankPlan:
    """Instructions for the nodes at positions ``ids`` on ``rank``, with events between
    streams; the compute of each overlapped slot gets one ``overlap`` number (0, 1, ... in
    list order).

    One pass, from the last instruction back to the first: an instruction records an event
    when a later one of another stream waits for it, and every later one has been looked at
    by then, so each instruction is made as its waits are found (no second pass, no list of
    waits by position). Those of SENDs and RECVs (two thirds of a pipeline's) are made
    without a call of ``_fields``."""
    nodes, starts = graph.nodes, graph.predecessor_positions
    assert starts is not None  # a validated graph has positions
    placed = [nodes[p] for p in ids]
    # position -> its stream, for the nodes on this rank: one lookup per edge in a table of
    # this rank's nodes tells both whether the source is here and its stream.
    stream_of = {p: n.stream for p, n in zip(ids, placed, strict=True)}.get
    numbers: dict[str, int] = {}  # node id -> its slot's overlap number, in list order
    if overlap:
        slots: dict[tuple, int] = {}
        for n in placed:
            if n.id in overlap:
                numbers[n.id] = slots.setdefault(overlap[n.id], len(slots))
    events: dict[int, str] = {}  # position -> the event it records, for those others wait on
    transfers, recorded, number_of = tables.transfers.get, events.get, numbers.get
    no_waits: tuple[str, ...] = ()
    instructions = []
    append = instructions.append
    for k in range(len(ids) - 1, -1, -1):
        n = placed[k]
        nid, kind, stream, bucket = n.id, n.kind, n.stream, None
        for j in starts[ids[k]]:
            src_stream = stream_of(j)
            if src_stream is not None and src_stream != stream:
                ev = events.get(j)
                if ev is None:
                    ev = events[j] = event_id(nodes[j].id)
                if bucket is None:
                    bucket = [ev]
                elif ev not in bucket:
                    bucket.append(ev)
        if kind is SEND or kind is RECV:  # two thirds of the instructions: inline
            transfer = transfers(n.value or "")
            if transfer is None:
                _unknown_value(placed, tables)
            communicator, meta = transfer  # type: ignore[misc]
            peer = n.peers[n.devices.index(rank)]  # ``_peer``, inline
        elif kind is COMPUTE and not tables.collectives:  # ``_fields`` of compute without collectives
            peer = communicator = meta = None
        else:
            peer, communicator, meta = None, *_fields(n, rank, tables)
        append(make_instruction(  # by position, in the order of INSTRUCTION_FIELDS
            nid, kind, stream, n.segment, n.phase, n.microbatch, n.value, peer, communicator, meta,
            no_waits if bucket is None else tuple(bucket), recorded(ids[k]), number_of(nid) if numbers else None,
        ))
    instructions.reverse()
    return RankPlan(rank, instructions, replica)


def _unknown_value(placed: list[Node], tables: _Tables) -> NoReturn:
    """Raise for the first SEND or RECV of ``placed`` whose value the graph does not have."""
    for n in placed:
        if (n.kind is SEND or n.kind is RECV) and (n.value or "") not in tables.transfers:
            raise SchedulingError(f"{n.kind.value} node {n.id} carries unknown value {n.value!r}", nodes=[n.id])
    raise AssertionError("a transfer of an unknown value was seen")


def _fields(n: Node, rank: int, tables: _Tables) -> tuple[str | None, TensorMeta | None]:
    """The ``communicator`` and ``meta`` of the instruction of ``n`` on ``rank``, a node
    that is no SEND or RECV."""
    kind = n.kind
    if kind is COMPUTE:
        # A tensor-parallel segment's compute issues all-reduces on its group inside, an
        # expert-parallel one all-to-alls; a tensor- and expert-parallel one both, named by
        # the wider group (its expert-parallel one, which holds the tensor-parallel one: every
        # member issues the segment's compute in one order).
        sh = tables.collectives.get(n.segment or "") if n.phase is not None else None
        if sh is None:
            return None, None
        if sh.expert_degree > 1:
            return tp_communicator(sh.group_of(rank, sh.expert_degree), "ep"), None
        return tp_communicator(sh.group_of(rank), sh.kind), None
    if kind in GROUP_KINDS:
        # The flat bucket, padded to a multiple of the shards: what a collective moves; an
        # all-reduce of a sharded bucket (a mirrored one's gradient shard) moves one shard.
        bucket = tables.buckets[n.value or ""]
        numel = bucket.shard_numel if kind is NodeKind.ALL_REDUCE else bucket.padded_numel
        communicator = None if kind is NodeKind.FREE else group_communicator(n.stream, n.devices)
        return communicator, TensorMeta((numel,), bucket.dtype)
    if kind is GRAD_NORM:
        # the sum of squares, summed over the world
        return norm_communicator(n.devices), TensorMeta((1,), "float64")
    return None, None


def _compute_groups(graph: Graph) -> ComputeGroups:
    """(segment, device group) of every compute node, each pair once: a segment runs its
    microbatches on one group, so a pipeline's 132k compute nodes make a few hundred pairs,
    which ``_replicas``, ``_placement`` and the replica count read."""
    return {(n.segment, n.devices) for n in graph.nodes if n.kind is COMPUTE}


def _placement(graph: Graph, groups: ComputeGroups) -> list[tuple[str, tuple[int, ...]]]:
    """``groups``: ``_compute_groups(graph)``."""
    devices: dict[str, set[int]] = {s.id: set() for s in graph.segments}
    for segment, group in groups:
        if segment is not None:
            devices[segment].update(group)
    return [(s.id, tuple(sorted(devices[s.id]))) for s in graph.segments]
