"""Bad strategies fail with a clear error before any worker starts."""

from __future__ import annotations

import pytest
import ray

from piper_directives import Order, Place, Split, Strategy
from piper_ir import DirectiveError
from piper_train.models import build_model
from piper_train.trainer import Trainer

pytestmark = pytest.mark.usefixtures("ray_cluster")


def _trainer(strategy: Strategy) -> Trainer:
    w = build_model("mlp", stages=2)
    return Trainer(w.model, w.example_inputs, w.example_targets, w.loss_fn, strategy)


def _live_actors() -> int:
    return sum(1 for a in ray._private.state.actors().values() if a["State"] == "ALIVE")


@pytest.mark.parametrize(
    ("strategy", "message"),
    [
        (Strategy([Split(4), Place({"PP": 0}, 0)]), r"not placed by any Place directive: s1 \(PP=1\)"),
        (Strategy([Split(4), Place({"PP": 0}, (0, 1, 0)), Place({"PP": 1}, 2)]), "device 0 is named twice"),
        (
            Strategy([Split(2), Place({"PP": 0}, 0), Place({"PP": 1}, 1),
                      Order([{"PP": 1, "PASS": "B", "MB": 0}, {"PP": 1, "PASS": "F", "MB": 0}], name="backwards")]),
            r"(?s)cycle F.s1.mb0 -> B.s1.mb0.*directive: backwards",
        ),
    ],
)
def test_bad_strategies_start_nothing(strategy, message):
    before = _live_actors()
    with pytest.raises(DirectiveError, match=message):
        _trainer(strategy)
    assert _live_actors() == before


def test_cycle_error_names_the_nodes_and_where_the_order_was_written():
    strategy = Strategy([Split(2), Place({"PP": 0}, 0), Place({"PP": 1}, 1),
                         Order([{"PP": 1, "PASS": "B", "MB": 0}, {"PP": 1, "PASS": "F", "MB": 0}])])
    with pytest.raises(DirectiveError) as err:
        _trainer(strategy)
    assert {"F.s1.mb0", "B.s1.mb0"} <= set(err.value.nodes)
    assert "test_errors.py" in str(err.value)


def test_a_batch_too_small_for_its_microbatches_is_refused_and_nothing_hangs():
    w = build_model("mlp", stages=2)
    with Trainer(w.model, w.example_inputs, w.example_targets, w.loss_fn, Strategy([Split(2), Place({"PP": 0}, 0), Place({"PP": 1}, 1)])) as trainer:
        inputs, targets = w.batches(0)
        with pytest.raises(ValueError, match="a batch of 1 samples cannot give each of 2 microbatches a sample"):
            trainer.step((inputs[0][:1],), (targets[0][:1],))
        assert trainer.state.step == 0  # nothing was sent
        assert trainer.step((inputs[0][:6],), (targets[0][:6],)).loss > 0  # another size trains (a new program)
        assert trainer.step(inputs, targets).loss > 0  # still usable afterwards
