"""``order.matching`` (the nodes an Order slot's filter selects, from the buckets of
``bucket_nodes``) agrees with testing every node with ``Filter.matches``: the buckets it
returns untested hold only matches, and every other filter is still tested node by node."""

from __future__ import annotations

import itertools

import pytest

from piper_directives.order import bucket_nodes, candidates, matching
from piper_ir import Filter, Node, NodeKind, Phase, Tags


def _nodes() -> list[Node]:
    """Compute nodes over phases, microbatches, segments and tags, with the awkward cases: a
    tag named SEG that differs from the segment, a node without a tag, an optimizer step."""
    nodes = []
    for i, (phase, mb, pp, seg) in enumerate(itertools.product((Phase.F, Phase.B), (0, 1), (0, 1), ("s0", "s1"))):
        tags = {"PP": pp, "VS": i % 3} if i % 5 else {"PP": pp, "SEG": "s1" if seg == "s0" else "s0"}
        nodes.append(Node(f"n{i}", NodeKind.COMPUTE, seg, phase, mb, tags=Tags.of(tags)))
    nodes.append(Node("bare", NodeKind.COMPUTE, "s0", Phase.F, 0))
    nodes.append(Node("opt", NodeKind.OPTIMIZER, "s0", Phase.OPT))
    return nodes


FILTERS = [
    {"PASS": "F", "MB": 0},
    {"PASS": "F", "MB": 1, "PP": 1},
    {"PASS": "B", "MB": 0, "SEG": "s1"},  # the SEG bucket also holds nodes tagged SEG=s1
    {"PASS": "F", "MB": 0, "PP": 0, "VS": 1},  # two tags: the bucket of one, tested
    {"PASS": "F", "MB": 0, "VS": "*"},  # a wildcard still needs the tag
    {"PASS": "B", "MB": (0, 1), "PP": 0},  # a set of microbatches: no bucket
    {"PASS": "F", "MB": 0, "PP": (0, 1)},
    {"PP": 1},  # no pass and microbatch: every node
    {"PASS": "OPT", "MB": 0},
    {"PASS": "F", "MB": 7},  # nothing
]


@pytest.mark.parametrize("spec", FILTERS, ids=str)
def test_matching_is_every_node_that_matches(spec: dict) -> None:
    nodes = _nodes()
    flt, index = Filter.of(spec), bucket_nodes(nodes)
    want = [n.id for n in nodes if flt.matches(n)]
    assert [n.id for n in matching(flt, index, nodes)] == want
    assert [n.id for n in candidates(flt, index, nodes) if flt.matches(n)] == want


def test_seg_filter_leaves_out_a_node_tagged_seg() -> None:
    nodes = _nodes()
    flt = Filter.of({"PASS": "B", "MB": 0, "SEG": "s1"})
    tagged = [n for n in candidates(flt, bucket_nodes(nodes), nodes) if n.segment != "s1"]
    assert tagged, "the case this guards: the bucket holds a node of another segment tagged SEG=s1"
    assert all(n.segment == "s1" for n in matching(flt, bucket_nodes(nodes), nodes))
