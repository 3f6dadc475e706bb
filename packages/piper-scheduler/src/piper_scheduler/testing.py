"""Hand-built pipeline graphs for tests (here and in other packages).

``pipeline_graph`` builds the graph that Capture + Split + Place + Order would produce for a
chain of ``pp`` stage segments, one per rank, with the loss on the last rank, following
``docs/ir-conventions.md`` sections 1-4 exactly. ``schedule_order`` gives the compute order
each rank must run for a named schedule, so tests can compare compiled plans against it.
"""

from __future__ import annotations

from piper_ir import (
    Edge,
    EdgeKind,
    Graph,
    Node,
    NodeKind,
    Phase,
    Segment,
    SegmentRole,
    Tags,
    TensorMeta,
    Value,
    compute_id,
    grad_name,
    transfer_ids,
)

SCHEDULES = ("gpipe", "1f1b")

Slot = tuple[str, Phase, int | None]
"""(segment id, phase, microbatch) of one compute node."""


def schedule_order(pp: int, microbatches: int, schedule: str, rank: int) -> list[Slot]:
    """The compute order of ``rank`` under ``schedule`` ("gpipe" or "1f1b").

    The loss forward runs right after the last stage's forward of the same microbatch and the
    loss backward right before the last stage's backward (it produces that backward's input).
    The optimizer step of the rank's stage comes last.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; expected one of {SCHEDULES}")
    seg, last = f"s{rank}", rank == pp - 1
    m = microbatches
    if schedule == "gpipe":
        steps = [(Phase.F, i) for i in range(m)] + [(Phase.B, i) for i in range(m)]
    else:
        warmup = min(pp - 1 - rank, m)
        steps = [(Phase.F, i) for i in range(warmup)]
        for i in range(m - warmup):
            steps += [(Phase.F, warmup + i), (Phase.B, i)]
        steps += [(Phase.B, i) for i in range(m - warmup, m)]
    order: list[Slot] = []
    for phase, mb in steps:
        if last and phase is Phase.B:
            order.append(("loss", Phase.B, mb))
        order.append((seg, phase, mb))
        if last and phase is Phase.F:
            order.append(("loss", Phase.F, mb))
    order.append((seg, Phase.OPT, None))
    return order


def pipeline_graph(
    pp: int,
    microbatches: int,
    schedule: str | None = "1f1b",
    *,
    stream: str = "pp",
    batch: int = 2,
    hidden: int = 8,
) -> Graph:
    """A placed (and, unless ``schedule`` is None, ordered) ``pp``-stage pipeline graph.

    Stage ``s{i}`` runs on rank ``i`` and maps ``v:s{i-1}`` (``input:0`` for i = 0) to
    ``v:s{i}``; the loss segment reads ``v:s{pp-1}`` and ``target:0`` on rank ``pp - 1``.
    ``batch`` is the per-microbatch batch size. SEND/RECV nodes use ``stream``.
    """
    if pp < 1 or microbatches < 1:
        raise ValueError("pp and microbatches must be at least 1")
    m = microbatches

    def meta(requires_grad: bool = True) -> TensorMeta:
        return TensorMeta((batch, hidden), "float32", batch_dim=0, requires_grad=requires_grad)

    values = [Value("input:0", meta(False)), Value("target:0", meta(False))]
    segments = []
    for i in range(pp):
        src = "input:0" if i == 0 else f"v:s{i - 1}"
        segments.append(
            Segment(
                f"s{i}",
                SegmentRole.STAGE,
                Tags.of(PP=i),
                inputs=(src,),
                outputs=(f"v:s{i}",),
                params=((f"s{i}.weight", TensorMeta((hidden, hidden), "float32")),),
            )
        )
        values += [Value(f"v:s{i}", meta()), Value(grad_name(f"v:s{i}"), meta())]
    values.append(Value("v:loss", TensorMeta((), "float32", requires_grad=True)))
    segments.append(
        Segment("loss", SegmentRole.LOSS, Tags(), inputs=(f"v:s{pp - 1}", "target:0"), outputs=("v:loss",))
    )

    nodes: list[Node] = []
    edges: list[Edge] = []

    def compute(seg: str, phase: Phase, mb: int | None, dev: int) -> str:
        tags = Tags.of(PP=int(seg[1:])) if seg != "loss" else Tags()
        kind = NodeKind.OPTIMIZER if phase is Phase.OPT else NodeKind.COMPUTE
        nid = compute_id(phase, seg, mb)
        nodes.append(Node(nid, kind, segment=seg, phase=phase, microbatch=mb, tags=tags, devices=(dev,)))
        return nid

    def flow(src: str, dst: str, value: str, mb: int, src_dev: int, dst_dev: int, tags: Tags) -> None:
        if src_dev == dst_dev:
            edges.append(Edge(src, dst, EdgeKind.DATA, value))
            return
        sid, rid = transfer_ids(value, mb, (src_dev,), (dst_dev,))
        common = dict(value=value, microbatch=mb, tags=tags, stream=stream)
        nodes.append(Node(sid, NodeKind.SEND, devices=(src_dev,), peers=(dst_dev,), **common))
        nodes.append(Node(rid, NodeKind.RECV, devices=(dst_dev,), peers=(src_dev,), **common))
        edges.extend(
            [
                Edge(src, sid, EdgeKind.DATA, value),
                Edge(sid, rid, EdgeKind.DATA, value),
                Edge(rid, dst, EdgeKind.DATA, value),
            ]
        )

    last = pp - 1
    for mb in range(m):
        fwd = [compute(f"s{i}", Phase.F, mb, i) for i in range(pp)]
        floss = compute("loss", Phase.F, mb, last)
        bloss = compute("loss", Phase.B, mb, last)
        bwd = [compute(f"s{i}", Phase.B, mb, i) for i in range(pp)]
        for i in range(pp - 1):
            flow(fwd[i], fwd[i + 1], f"v:s{i}", mb, i, i + 1, Tags.of(PP=i))
        edges.append(Edge(fwd[last], floss, EdgeKind.DATA, f"v:s{last}"))
        edges.append(Edge(floss, bloss, EdgeKind.DATA))
        for i in range(pp):
            edges.append(Edge(fwd[i], bwd[i], EdgeKind.DATA))
        edges.append(Edge(bloss, bwd[last], EdgeKind.DATA, grad_name(f"v:s{last}")))
        for i in range(pp - 1, 0, -1):
            flow(bwd[i], bwd[i - 1], grad_name(f"v:s{i - 1}"), mb, i, i - 1, Tags.of(PP=i))
    for i in range(pp):
        opt = compute(f"s{i}", Phase.OPT, None, i)
        edges.extend(Edge(compute_id(Phase.B, f"s{i}", mb), opt, EdgeKind.DATA) for mb in range(m))

    if schedule is not None:
        for rank in range(pp):
            ids = [compute_id(phase, seg, mb) for seg, phase, mb in schedule_order(pp, m, schedule, rank)]
            origin = f"Order({schedule}) at piper_scheduler/testing.py"
            edges.extend(
                Edge(a, b, EdgeKind.TEMPORAL, origin=origin) for a, b in zip(ids, ids[1:], strict=False)
            )

    return Graph(
        segments=segments,
        values=values,
        nodes=nodes,
        edges=edges,
        inputs=("input:0",),
        targets=("target:0",),
        microbatches=m,
        world_size=pp,
    )
