"""The synthetic graph follows the capture conventions and the real directive passes run on it."""

import subprocess
import sys

import pytest

from piper_directives.order import Order, apply_orders
from piper_directives.place import place_all
from piper_directives.schedules import build_schedule
from piper_directives.split import Split
from piper_directives.synthetic import synthetic_graph
from piper_ir import DirectiveError, NodeKind, validate


def test_captured_shape():
    g = validate(synthetic_graph(2, microbatches=4, segments_per_stage=2, hidden=8, batch=3))
    assert [s.id for s in g.segments] == ["s0", "s1", "s2", "s3", "loss"]
    assert [s.tags.get("PP") for s in g.stage_segments()] == [0, 0, 1, 1]
    assert g.loss_segment().inputs == ("v:s3", "target:0")
    assert g.value_by_name["input:0"].meta.shape == (12, 8)
    assert g.value_by_name["grad:v:s1"].meta == g.value_by_name["v:s1"].meta
    assert g.microbatches == 1 and g.world_size == 0
    assert sum(n.kind is NodeKind.OPTIMIZER for n in g.nodes) == 4
    edges = {(e.src, e.dst, e.value) for e in g.edges}
    assert ("F.s3", "F.loss", "v:s3") in edges and ("B.loss", "B.s3", "grad:v:s3") in edges
    assert ("F.s0", "F.s1", "v:s0") in edges and ("B.s1", "B.s0", "grad:v:s0") in edges


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_schedules_apply(schedule):
    g = build_schedule(schedule, 4, 8, stages=8).apply(synthetic_graph(8, 8, 2, hidden=4))
    assert g.world_size == 4 and g.microbatches == 8
    assert {n.devices for n in g.nodes if n.segment == "loss"} == {(3,)}
    assert sum(n.kind is NodeKind.SEND for n in g.nodes) == 2 * 3 * 8


def test_apply_orders_equals_one_by_one():
    strategy = build_schedule("1f1b", 3, 4)
    g = synthetic_graph(3, 4, 2, hidden=4)
    placed = place_all(Split(4).apply(g), [d for d in strategy.directives if type(d).__name__ == "Place"])
    orders = [d for d in strategy.directives if isinstance(d, Order)]
    one_by_one = placed
    for order in orders:
        one_by_one = order.apply(one_by_one)
    assert apply_orders(placed, orders) == one_by_one


def test_apply_orders_names_the_first_order_with_a_cycle():
    placed = place_all(Split(2).apply(synthetic_graph(2, 2)), build_schedule("gpipe", 2, 2).directives[1:3])
    fine = Order([{"PP": 0, "PASS": "F", "MB": 0}, {"PP": 0, "PASS": "F", "MB": 1}], name="fine")
    bad = Order([{"PP": 1, "PASS": "B", "MB": 0}, {"PP": 1, "PASS": "F", "MB": 0}], name="bad")
    broken = Order([{"PP": 7}], name="broken")
    with pytest.raises(DirectiveError, match="bad") as err:
        apply_orders(placed, [fine, bad, fine])
    assert "cycle" in str(err.value)
    with pytest.raises(DirectiveError, match="cycle"):  # the cycle comes before the bad slot
        apply_orders(placed, [bad, broken])
    with pytest.raises(DirectiveError, match="matches no compute node"):
        apply_orders(placed, [fine, broken])


def test_rejects_bad_sizes():
    with pytest.raises(ValueError, match="stages"):
        synthetic_graph(0)


def test_directive_programs_need_no_torch():
    """Only capture needs torch: building and applying a schedule works without it."""
    code = (
        "import sys; sys.modules['torch'] = None;"
        "import piper_directives as d;"
        "from piper_directives.synthetic import synthetic_graph;"
        "g = d.build_schedule('1f1b', 2, 4).apply(synthetic_graph(2, 4));"
        "assert g.world_size == 2"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
