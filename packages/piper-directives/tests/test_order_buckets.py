"""``order.bucket_nodes`` makes the buckets of one kind (plain pass and microbatch, ``SEG``,
one tag) when a key of that kind is first asked for: one table asked for every kind in turn,
in either order, answers as a table per filter does, and a table asked for one tag makes
that tag's buckets alone."""

from __future__ import annotations

import itertools

import pytest

from piper_directives.order import bucket_nodes, candidates, matching
from piper_ir import Filter, Node, NodeKind, Phase, Tags

FILTERS = [
    {"PASS": "F", "MB": 1, "PP": 1},
    {"PASS": "B", "MB": 0, "SEG": "s1"},  # the SEG buckets hold nodes tagged SEG=s1 too
    {"PASS": "F", "MB": 0},
    {"PASS": "F", "MB": 0, "PP": 0, "VS": 1},
    {"PASS": "B", "MB": 1, "SEG": "s0"},
]


def _nodes() -> list[Node]:
    nodes = []
    for i, (phase, mb, pp, seg) in enumerate(itertools.product((Phase.F, Phase.B), (0, 1), (0, 1), ("s0", "s1"))):
        tags = {"PP": pp, "VS": i % 3} if i % 5 else {"PP": pp, "SEG": "s1" if seg == "s0" else "s0"}
        nodes.append(Node(f"n{i}", NodeKind.COMPUTE, seg, phase, mb, tags=Tags.of(tags)))
    nodes.append(Node("bare", NodeKind.COMPUTE, "s0", Phase.F, 0))
    return nodes


@pytest.mark.parametrize("specs", [FILTERS, FILTERS[::-1]], ids=["forward", "backward"])
def test_one_table_for_every_filter_answers_as_one_per_filter(specs: list[dict]) -> None:
    nodes = _nodes()
    shared = bucket_nodes(nodes)
    for spec in specs:
        flt = Filter.of(spec)
        want = [n.id for n in nodes if flt.matches(n)]
        assert [n.id for n in matching(flt, shared, nodes)] == want
        assert [n.id for n in candidates(flt, shared, nodes)] == [n.id for n in candidates(flt, bucket_nodes(nodes), nodes)]
    assert shared.made == {None, "SEG", "PP"}


def test_a_schedule_of_one_tag_makes_that_tag_s_buckets_alone() -> None:
    nodes = _nodes()
    index, flt = bucket_nodes(nodes), Filter.of({"PASS": "F", "MB": 1, "PP": 1})
    want = [n.id for n in nodes if flt.matches(n)]
    assert len(want) == 2 and [n.id for n in matching(flt, index, nodes)] == want
    assert index.made == {"PP"} and all(len(key) == 4 and key[2] == "PP" for key in index.index)
