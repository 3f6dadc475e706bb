"""Insert communication: lower every cross-device data edge of a placed graph to SEND -> RECV.

The communication phase of ``Strategy.apply``, after Place, Shard and Replicate (so every
node has its device group). Requires a placed graph. Guarantees one SEND/RECV pair per value,
microbatch and pair of device groups (docs/ir-conventions.md, sections 3 and 7), on the
stream the producing region's ``Place`` named (``place.send_streams``).
"""

from __future__ import annotations

import attrs

from piper_ir import DirectiveError, Edge, EdgeKind, Graph, Node, NodeKind, transfer_ids

SEND, RECV, DATA = NodeKind.SEND, NodeKind.RECV, EdgeKind.DATA
# ``Node``'s first fields in the order its ``__init__`` takes them: the pairs are made by position
NODE_FIELDS = ("id", "kind", "segment", "phase", "microbatch", "tags", "devices", "stream", "value", "peers")
if tuple(a.name for a in attrs.fields(Node))[: len(NODE_FIELDS)] != NODE_FIELDS:
    raise ImportError("piper_ir.Node's fields changed: update piper_directives.communication.NODE_FIELDS")


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
    pairs: dict[tuple[str, int | None, tuple[int, ...], tuple[int, ...]], tuple[str, str]] = {}
    for e in graph.edges:
        src, dst = by_id[e.src], by_id[e.dst]
        if e.value is None or src.devices == dst.devices:
            edges.append(e)
            continue
        s_devs, d_devs = src.devices, dst.devices
        if len(s_devs) != len(d_devs):
            raise DirectiveError(
                f"value {e.value} flows from device group {list(s_devs)} to {list(d_devs)}: replicas pair "
                "up elementwise, so both groups need the same number of devices",
                nodes=[e.src, e.dst],
            )
        selfs = [a for a, b in zip(s_devs, d_devs, strict=True) if a == b]
        if selfs:
            raise DirectiveError(
                f"value {e.value} flows from device group {list(s_devs)} to {list(d_devs)}: paired "
                f"elementwise, device {selfs[0]} would send to itself; list both groups in replica order",
                nodes=[e.src, e.dst],
            )
        key = (e.value, src.microbatch, s_devs, d_devs)
        pair = pairs.get(key)
        if pair is None:
            sid, rid = pair = pairs[key] = transfer_ids(e.value, src.microbatch, s_devs, d_devs)
            stream = streams.get(src.segment or "", "pp")
            # Node(id, kind, segment, phase, microbatch, tags, devices, stream, value, peers) and
            # Edge(src, dst, kind, value), by position (NODE_FIELDS): by keyword, matching the
            # names was a third of this pass (130k pairs at 16,384 devices)
            nodes.append(Node(sid, SEND, None, None, src.microbatch, src.tags, s_devs, stream, e.value, d_devs))
            nodes.append(Node(rid, RECV, None, None, src.microbatch, src.tags, d_devs, stream, e.value, s_devs))
            edges.append(Edge(e.src, sid, DATA, e.value))
            edges.append(Edge(sid, rid, DATA, e.value))
        edges.append(Edge(pair[1], e.dst, DATA, e.value))
    return attrs.evolve(graph, nodes=tuple(nodes), edges=tuple(edges))
