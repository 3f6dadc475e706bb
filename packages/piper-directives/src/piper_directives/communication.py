"""Insert communication: lower every cross-device data edge of a placed graph to SEND -> RECV.

The communication phase of ``Strategy.apply``, after Place, Shard and Replicate (so every
node has its device group). Requires a placed graph. Guarantees one SEND/RECV pair per value,
microbatch and pair of device groups (docs/ir-conventions.md, sections 3 and 7), on the
stream the producing region's ``Place`` named (``place.send_streams``).
"""

from __future__ import annotations

import attrs

from piper_ir import DirectiveError, Edge, EdgeKind, Graph, Node, NodeKind, slot_maker, transfer_ids

SEND, RECV, DATA = NodeKind.SEND, NodeKind.RECV, EdgeKind.DATA
# ``Node``'s and ``Edge``'s fields in the order their ``__init__`` takes them: the pairs are
# made by position, through the slots (``piper_ir.slot_maker``; ``devices`` and ``peers``
# passed as the tuples their converters make)
NODE_FIELDS = ("id", "kind", "segment", "phase", "microbatch", "tags", "devices", "stream", "value", "peers", "origin")
EDGE_FIELDS = ("src", "dst", "kind", "value", "origin")
if tuple(a.name for a in attrs.fields(Node)) != NODE_FIELDS or tuple(a.name for a in attrs.fields(Edge)) != EDGE_FIELDS:
    raise ImportError("piper_ir.Node's or Edge's fields changed: update piper_directives.communication")
make_node, make_edge = slot_maker(Node), slot_maker(Edge)


def insert_communication(graph: Graph, streams: dict[str, str]) -> Graph:
    """Replace each cross-device data edge with SEND -> RECV (one pair per value, microbatch
    and pair of device groups, shared by every consumer on the receiving group).

    Groups pair elementwise (docs/ir-conventions.md, section 7): replica ``j`` of the
    producing group sends to replica ``j`` of the consuming one, so both groups must have the
    same size and no replica may send to itself. Single-device groups are the case N = 1.
    """
    by_id = graph.node_by_id
    nodes = list(graph.nodes)
    edges: list[Edge] = []
    add_node, add_edge = nodes.append, edges.append
    pairs: dict[tuple[str, int | None, tuple[int, ...], tuple[int, ...]], tuple[str, str]] = {}
    for e in graph.edges:
        value = e.value
        src, dst = by_id[e.src], by_id[e.dst]
        s_devs, d_devs = src.devices, dst.devices
        if value is None or s_devs == d_devs:
            add_edge(e)
            continue
        if len(s_devs) != len(d_devs):
            raise DirectiveError(
                f"value {value} flows from device group {list(s_devs)} to {list(d_devs)}: replicas pair "
                "up elementwise, so both groups need the same number of devices",
                nodes=[e.src, e.dst],
            )
        # (one device each: they differ, or the edge would not cross)
        selfs = [a for a, b in zip(s_devs, d_devs, strict=True) if a == b] if len(s_devs) > 1 else None
        if selfs:
            raise DirectiveError(
                f"value {value} flows from device group {list(s_devs)} to {list(d_devs)}: paired "
                f"elementwise, device {selfs[0]} would send to itself; list both groups in replica order",
                nodes=[e.src, e.dst],
            )
        mb = src.microbatch
        key = (value, mb, s_devs, d_devs)
        pair = pairs.get(key)
        if pair is None:
            sid, rid = pair = pairs[key] = transfer_ids(value, mb, s_devs, d_devs)
            stream, tags = streams.get(src.segment or "", "pp"), src.tags
            # Node(id, kind, segment, phase, microbatch, tags, devices, stream, value, peers,
            # origin) and Edge(src, dst, kind, value, origin), by position (NODE_FIELDS,
            # EDGE_FIELDS): by keyword, matching the names was a third of this pass (130k pairs
            # at 16,384 devices)
            add_node(make_node(sid, SEND, None, None, mb, tags, s_devs, stream, value, d_devs, None))
            add_node(make_node(rid, RECV, None, None, mb, tags, d_devs, stream, value, s_devs, None))
            add_edge(make_edge(e.src, sid, DATA, value, None))
            add_edge(make_edge(sid, rid, DATA, value, None))
        add_edge(make_edge(pair[1], e.dst, DATA, value, None))
    return attrs.evolve(graph, nodes=tuple(nodes), edges=tuple(edges))
