"""Hypothesis properties: random valid Graphs and Programs round-trip through JSON unchanged,
serialise deterministically, pass ``validate``, and have a topological order."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from piper_ir import (
    CodeRef,
    Communicator,
    Edge,
    EdgeKind,
    Filter,
    Graph,
    Instruction,
    Node,
    NodeKind,
    Phase,
    Program,
    RankPlan,
    Segment,
    SegmentRole,
    Tags,
    TensorMeta,
    Value,
    find_cycle,
    from_json,
    to_json,
    topological_order,
    validate,
)

# Small examples keep the suite fast on a shared 2-core machine.
FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Non-ASCII and JSON-special characters make sure strings survive json.dumps/loads.
names = st.text(alphabet='abcxyz:._-é"\\/ ', min_size=1, max_size=8)
maybe_name = st.none() | names
dtypes = st.sampled_from(["float32", "float64", "bfloat16", "int64", "bool", "weird"])


@st.composite
def tensor_metas(draw: st.DrawFn) -> TensorMeta:
    shape = tuple(draw(st.lists(st.integers(0, 64), max_size=4)))
    batch_dim = draw(st.none() | st.integers(0, len(shape) - 1)) if shape else None
    return TensorMeta(shape, draw(dtypes), batch_dim, draw(st.booleans()))


tags = st.dictionaries(st.sampled_from(["PP", "EP", "DP", "VP"]), st.integers(-2, 9), max_size=3).map(Tags.of)
filters = st.dictionaries(
    st.sampled_from(["PP", "EP", "PASS", "MB", "SEG"]),
    st.integers(0, 5) | st.sampled_from(["*", "F"]),
    max_size=3,
).map(Filter.of)
code_refs = st.builds(CodeRef, format=names, version=st.integers(0, 3), digest=names)


@st.composite
def segments(draw: st.DrawFn, seg_id: str) -> Segment:
    return Segment(
        id=seg_id,
        role=draw(st.sampled_from(SegmentRole)),
        tags=draw(tags),
        inputs=tuple(draw(st.lists(names, max_size=3))),
        outputs=tuple(draw(st.lists(names, max_size=3))),
        params=tuple(draw(st.lists(st.tuples(names, tensor_metas()), max_size=2))),
        code=draw(st.none() | code_refs),
        source=draw(maybe_name),
    )


@st.composite
def graphs(draw: st.DrawFn) -> Graph:
    """A valid graph: edges only go from earlier to later nodes, so it is a DAG."""
    n_segs = draw(st.integers(0, 3))
    segs = [draw(segments(f"s{i}")) for i in range(n_segs)]
    values = [Value(f"v{i}", draw(tensor_metas())) for i in range(draw(st.integers(0, 4)))]
    microbatches = draw(st.integers(1, 4))
    world = draw(st.integers(0, 4))
    nodes = []
    for i in range(draw(st.integers(0, 8))):
        kind = draw(st.sampled_from(NodeKind))
        devices = draw(st.lists(st.integers(0, world - 1), unique=True, max_size=world)) if world else []
        peers = [draw(st.integers(0, 7)) for _ in devices] if kind in (NodeKind.SEND, NodeKind.RECV) else []
        nodes.append(
            Node(
                id=f"n{i}",
                kind=kind,
                segment=draw(st.none() | st.sampled_from([s.id for s in segs])) if segs else None,
                phase=draw(st.none() | st.sampled_from(Phase)),
                microbatch=draw(st.none() | st.integers(0, microbatches - 1)),
                tags=draw(tags),
                devices=devices,
                stream=draw(st.sampled_from(["compute", "pp", "dp"])),
                value=draw(st.none() | st.sampled_from([v.name for v in values])) if values else None,
                peers=peers,
                origin=draw(maybe_name),
            )
        )
    edges = []
    if len(nodes) >= 2:
        pairs = st.tuples(st.integers(0, len(nodes) - 1), st.integers(0, len(nodes) - 1)).filter(
            lambda p: p[0] < p[1]
        )
        for a, b in draw(st.lists(pairs, max_size=12)):
            kind = draw(st.sampled_from(EdgeKind))
            value = draw(st.none() | st.sampled_from([v.name for v in values])) if values else None
            edges.append(
                Edge(f"n{a}", f"n{b}", kind, value if kind is EdgeKind.DATA else None, draw(maybe_name))
            )
    return Graph(
        segments=segs,
        values=values,
        nodes=nodes,
        edges=edges,
        inputs=[v.name for v in values[:1]],
        targets=[v.name for v in values[1:2]],
        microbatches=microbatches,
        world_size=world,
    )


instructions = st.builds(
    Instruction,
    id=names,
    kind=st.sampled_from(NodeKind),
    stream=st.sampled_from(["compute", "pp", "dp"]),
    segment=maybe_name,
    phase=st.none() | st.sampled_from(Phase),
    microbatch=st.none() | st.integers(0, 7),
    value=maybe_name,
    peer=st.none() | st.integers(0, 3),
    communicator=st.none() | st.sampled_from(["pp.fwd", "pp.bwd"]),
    meta=st.none() | tensor_metas(),
    waits=st.lists(names, max_size=2).map(tuple),
    record=maybe_name,
)


@st.composite
def programs(draw: st.DrawFn) -> Program:
    world = draw(st.integers(1, 3))
    segs = [draw(segments(f"s{i}")) for i in range(draw(st.integers(0, 2)))]
    return Program(
        world_size=world,
        ranks=[RankPlan(r, draw(st.lists(instructions, max_size=4))) for r in range(world)],
        communicators=draw(
            st.lists(
                st.builds(Communicator, id=names, ranks=st.lists(st.integers(0, world - 1)), traffic=names),
                max_size=2,
            )
        ),
        segments=segs,
        values=[Value(f"v{i}", draw(tensor_metas())) for i in range(draw(st.integers(0, 3)))],
        inputs=draw(st.lists(names, max_size=2)),
        targets=draw(st.lists(names, max_size=2)),
        microbatches=draw(st.integers(1, 8)),
        placement=[
            (s.id, tuple(draw(st.lists(st.integers(0, world - 1), unique=True, max_size=world))))
            for s in segs
        ],
    )


@FAST
@given(graphs())
def test_graph_round_trips(graph: Graph) -> None:
    text = to_json(graph)
    assert from_json(text) == graph
    assert to_json(from_json(text)) == text


@FAST
@given(graphs())
def test_graph_json_is_deterministic(graph: Graph) -> None:
    rebuilt = Graph(
        graph.segments,
        graph.values,
        graph.nodes,
        graph.edges,
        graph.inputs,
        graph.targets,
        graph.microbatches,
        graph.world_size,
    )
    assert to_json(graph) == to_json(rebuilt) == to_json(graph)
    assert to_json(graph, indent=2) == to_json(graph, indent=2)
    assert json.loads(to_json(graph, indent=2)) == json.loads(to_json(graph))


@FAST
@given(graphs())
def test_validate_accepts_generated_dags(graph: Graph) -> None:
    assert validate(graph) is graph
    assert find_cycle(graph) is None
    order = topological_order(graph)
    assert order is not None and sorted(order) == sorted(n.id for n in graph.nodes)
    position = {node: i for i, node in enumerate(order)}
    assert all(position[e.src] < position[e.dst] for e in graph.edges)


@FAST
@given(programs())
def test_program_round_trips(program: Program) -> None:
    text = to_json(program)
    assert from_json(text) == program
    assert to_json(from_json(text)) == text


@FAST
@given(st.one_of(tensor_metas(), tags, filters, code_refs, instructions))
def test_small_values_round_trip(value: object) -> None:
    assert from_json(to_json(value)) == value
