"""Randomness (item 3 of issue 10): every forward draws for (seed, region, microbatch, step,
replica), so a strategy draws single-device training's dropout masks, while different
microbatches, steps, replicas and seeds still draw different ones. Both sides draw through
the one ``piper_semantics.randomness.seeded`` (its own tests: packages/piper-semantics)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from piper_directives import annotate, build_schedule
from piper_runtime import OptimizerSpec
from piper_train.check import reference_for
from piper_train.models import ModelSpec
from piper_train.trainer import Trainer


class Dropped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(6, 6) for _ in range(2))
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with annotate("PP"):
            x = self.drop(self.layers[0](x))
        with annotate("PP"):
            return self.layers[1](x)


@pytest.mark.usefixtures("ray_cluster")
def test_masks_differ_per_microbatch_and_step_and_match_one_device():
    """Every row of the batch is the same sample and the learning rate is 0: a loss can only
    differ from another by its dropout mask. The reference runs each microbatch as the two
    replicas' shards, each drawing for its own replica index."""
    torch.manual_seed(0)
    x, y = torch.randn(1, 6).repeat(16, 1), torch.randn(1, 6).repeat(16, 1)
    workload = ModelSpec("dropped", Dropped(), (x,), (y,), nn.functional.mse_loss, lambda step: ((x,), (y,)), 2, 0)
    still = OptimizerSpec("sgd", 0.0)
    strategy = build_schedule("1f1b", 2, 4, dp=2)
    # Bare tensors and tuples of them are the same batch to a Trainer
    with Trainer(workload.model, x, y, nn.functional.mse_loss, strategy, optimizer=still, seed=3) as trainer:
        steps = [trainer.step((x,), (y,)), trainer.step(x, y)]
        reference = reference_for(trainer, workload, still, seed=3)
        wanted = [reference.step((x,), (y,)) for _ in range(2)]
    for got, want in zip(steps, wanted, strict=True):
        torch.testing.assert_close(torch.tensor(got.losses), torch.tensor(want.losses), rtol=1e-6, atol=0)
    assert len(set(steps[0].losses)) == 4  # each microbatch its own masks
    assert set(steps[0].losses).isdisjoint(steps[1].losses)  # and each step
