"""Which communicator carries which traffic.

Pipeline traffic has two classes, each on one communicator over all ranks: ``pp.fwd`` for
activations and ``pp.bwd`` for gradients (values named ``grad:<value>``). Separate
communicators keep the forward and backward message streams independent, so a schedule may
interleave them freely without breaking in-order matching on either.
"""

from __future__ import annotations

from piper_ir import Communicator, Graph, NodeKind

PP_FWD = "pp.fwd"
PP_BWD = "pp.bwd"
_TRAFFIC = {PP_FWD: "activations", PP_BWD: "gradients"}


def communicator_for(value: str) -> str:
    """The communicator id for a point-to-point transfer of ``value``."""
    return PP_BWD if value.startswith("grad:") else PP_FWD


def communicators_for(graph: Graph) -> tuple[Communicator, ...]:
    """One communicator per traffic class the graph's SEND nodes use, in a fixed order."""
    used = {communicator_for(n.value or "") for n in graph.nodes if n.kind is NodeKind.SEND}
    ranks = tuple(range(graph.world_size))
    return tuple(Communicator(c, ranks, _TRAFFIC[c]) for c in (PP_FWD, PP_BWD) if c in used)
