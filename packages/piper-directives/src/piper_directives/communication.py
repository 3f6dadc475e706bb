"""Insert communication: lower every cross-device data edge of a placed graph to SEND -> RECV.

The communication phase of ``Strategy.apply``, after Place, Shard and Replicate (so every
node has its device group). Requires a placed graph. Guarantees one SEND/RECV pair per value,
microbatch and pair of device groups (docs/ir-conventions.md, sections 3 and 7), on the
stream the producing region's ``Place`` named (``place.send_streams``).
"""

from __future__ import annotations

import attrs

from piper_ir import DirectiveError, Edge, Graph, Node, NodeKind, transfer_ids


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
        if key not in pairs:
            sid, rid = transfer_ids(e.value, src.microbatch, s_devs, d_devs)
            stream = streams.get(src.segment or "", "pp")
            common = dict(value=e.value, microbatch=src.microbatch, tags=src.tags, stream=stream)
            nodes.append(Node(sid, NodeKind.SEND, devices=s_devs, peers=d_devs, **common))
            nodes.append(Node(rid, NodeKind.RECV, devices=d_devs, peers=s_devs, **common))
            edges.append(Edge(e.src, sid, value=e.value))
            edges.append(Edge(sid, rid, value=e.value))
            pairs[key] = (sid, rid)
        edges.append(Edge(pairs[key][1], e.dst, value=e.value))
    return attrs.evolve(graph, nodes=tuple(nodes), edges=tuple(edges))
