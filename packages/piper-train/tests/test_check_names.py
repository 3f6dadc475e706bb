"""``piper check`` compares gradients by name: a name one side lacks is a clear error (item 8
of issue 10), never an assertion, and a zero gradient stands for a missing one."""

from __future__ import annotations

import pytest
import torch

from piper_ir import ExecutionError, PiperError
from piper_train.check import _same_names


def test_names_only_one_side_has_are_an_execution_error_naming_them():
    got = {"a.weight": torch.ones(2), "b.weight": torch.ones(2)}
    want = {"a.weight": torch.ones(2), "c.weight": torch.ones(2)}
    with pytest.raises(ExecutionError) as err:
        _same_names(got, want)
    text = str(err.value)
    assert "only the strategy has ['b.weight']" in text and "only single-device training has ['c.weight']" in text
    assert isinstance(err.value, PiperError)  # the CLI's exit 2 (bad input), not 1 (numbers differ)


def test_a_zero_gradient_on_one_side_stands_for_a_missing_one():
    got = {"a.weight": torch.ones(2), "unused.weight": torch.zeros(3)}
    want = {"a.weight": torch.ones(2)}
    _same_names(got, want)
    assert torch.equal(want["unused.weight"], torch.zeros(3))
