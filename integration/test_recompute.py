"""Recomputation (item 5 of issue 10): ``Recompute(filter)`` and ``torch.utils.checkpoint``
drop a region's activations after its forward and recompute them for its backward. The
gradients are those of training without it (bit for bit: the same operations, the same
dropout masks) and match single-device training; the estimate and the measured per-rank
peak both hold less (benchmarks/bench_recompute.py prints the figures at a larger size).
``piper train/check --recompute all`` recomputes every region, ``--recompute N`` every N-th."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.utils.checkpoint
from torch import nn

from piper_directives import Recompute, Strategy, annotate, build_schedule
from piper_memory import estimate_memory
from piper_runtime import OptimizerSpec
from piper_train.check import reference_for, run_check
from piper_train.models import ModelSpec, build_model
from piper_train.profile import activation_bytes
from piper_train.trainer import Trainer

ADAMW = OptimizerSpec("adamw", 1e-3)


def _two_steps(workload: ModelSpec, strategy: Strategy):
    with Trainer(workload.model, workload.example_inputs, workload.example_targets, workload.loss_fn, strategy,
                 optimizer=ADAMW) as trainer:
        results = [trainer.step(*workload.batches(step), keep_grads=True, memory=True) for step in range(2)]
        reference = reference_for(trainer, workload, ADAMW, 0)
        wanted = [reference.step(*workload.batches(step)) for step in range(2)]
        profile = activation_bytes(trainer.program, trainer.captured.modules, *workload.batches(0))
        estimate = estimate_memory(trainer.program, "adamw", activation_bytes=profile)
    return results, wanted, estimate


@pytest.mark.usefixtures("ray_cluster")
def test_recompute_gives_the_same_gradients_and_holds_less():
    workload = build_model("transformer", stages=4)
    base = build_schedule("1f1b", 2, 4, stages=4)
    kept, _, kept_estimate = _two_steps(workload, base)
    recomputed, wanted, estimate = _two_steps(workload, Strategy([*base.directives, Recompute({"PP": "*"})]))
    for got, same, want in zip(recomputed, kept, wanted, strict=True):
        assert got.losses == same.losses
        for name, g in got.grads.items():
            assert torch.equal(g, same.grads[name]), name
            torch.testing.assert_close(g, want.grads[name], rtol=1e-5, atol=1e-6)
    for rank in (0, 1):  # measured (second step) and estimated: activations and the whole peak
        assert recomputed[1].memory[rank].activations < kept[1].memory[rank].activations
        assert recomputed[1].memory[rank].total < kept[1].memory[rank].total
        assert estimate[rank].peak_activation_bytes < kept_estimate[rank].peak_activation_bytes
        assert estimate[rank].peak_bytes < kept_estimate[rank].peak_bytes


class Checkpointed(nn.Module):
    """Four regions, each running its layers (with dropout) under torch.utils.checkpoint."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(0.1), nn.Linear(16, 8))
                                    for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            with annotate("PP"):
                x = x + torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
        return x


@pytest.mark.usefixtures("ray_cluster")
def test_torch_utils_checkpoint_is_recomputed_by_the_runtime():
    torch.manual_seed(0)
    x, y = torch.randn(16, 8), torch.randn(16, 8)
    workload = ModelSpec("checkpointed", Checkpointed(), (x,), (y,), nn.functional.mse_loss,
                         lambda step: ((x,), (y,)), 4, 0)
    report = run_check(workload, build_schedule("dualpipev", 2, 4, stages=4), optimizer=ADAMW, steps=2)
    assert report.ok, report.failures()
    assert all(s.recompute for s in report.program.segments if s.id != "loss")


def test_the_command_line_recomputes_every_region(piper):
    """``--recompute all``: the same losses, a lower measured peak on every rank, and the
    single-device gradients (a GPT with dropout: the recomputed forward draws the same masks)."""
    base = ("train", "--model", "lm", "--steps", "2", "--json", "--no-progress-bar")
    kept, recomputed = piper(*base), piper(*base, "--recompute", "all")
    assert kept.returncode == recomputed.returncode == 0
    assert "recompute=all" in recomputed.stderr and "recompute" not in kept.stderr
    kept_run, recomputed_run = json.loads(kept.stdout), json.loads(recomputed.stdout)
    assert recomputed_run["losses"] == kept_run["losses"]
    assert all(r < k for r, k in zip(recomputed_run["peak_memory_bytes"], kept_run["peak_memory_bytes"], strict=True))
    # Every 2nd region: of lm's two (one per rank), region 0 only; rank 1 holds what it held.
    every_other = piper(*base, "--recompute", "2")
    assert every_other.returncode == 0 and "recompute=2" in every_other.stderr
    every_other_run = json.loads(every_other.stdout)
    assert every_other_run["losses"] == kept_run["losses"]
    (first, second), (kept_first, kept_second) = every_other_run["peak_memory_bytes"], kept_run["peak_memory_bytes"]
    assert first < kept_first and second == kept_second
    gpt = f"{Path(__file__).parent / 'fixtures' / 'user_model.py'}:gpt"
    checked = piper("check", "--model", gpt, "--pp", "2", "--steps", "2", "--recompute", "all")
    assert checked.returncode == 0 and "recompute=all" in checked.stdout and "PASS" in checked.stdout
