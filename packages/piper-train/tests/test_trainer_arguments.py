"""Arguments of the wrong kind are refused by name before anything is captured or started:
a schedule's name where a Strategy goes, an optimizer's name where an OptimizerSpec goes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from piper_train.trainer import Trainer


def test_a_schedule_name_or_an_optimizer_name_is_refused_saying_what_to_pass() -> None:
    model, x, y = nn.Linear(4, 4), torch.randn(8, 4), torch.randn(8, 4)
    with pytest.raises(TypeError, match=r"got str '1f1b'; for a library schedule by name use Trainer.with_schedule"):
        Trainer(model, x, y, nn.functional.mse_loss, "1f1b")
    with pytest.raises(TypeError, match=r"optimizer must be a piper_runtime.OptimizerSpec .*got str 'adam'"):
        Trainer(model, x, y, nn.functional.mse_loss, lambda regions: None, optimizer="adam")
