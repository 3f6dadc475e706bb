"""``piper check --precision fp64`` without workers (issue 36, item 6): the float64 copy of a
workload, the refusals, and numbers compared at full precision (a held-out loss is a Python
float, and ``torch.tensor(x)`` would round it to float32 first)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from piper_directives.precision import precision_of
from piper_ir import CaptureError, Precision
from piper_train import check
from piper_train.check import TOLERANCES, in_float64, run_check
from piper_train.cli import main
from piper_train.models import ModelSpec, build_model


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(8, 4)
        self.head = nn.Linear(4, 8, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("steps", torch.arange(3))  # an integer buffer stays one
        self.register_buffer("scale", torch.ones(4))

    def forward(self, tokens: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(tokens) * self.scale) * weights


def _tied_workload() -> ModelSpec:
    def batches(step: int):
        return (torch.arange(4).reshape(2, 2) + step, torch.ones(2, 2, 1)), (torch.zeros(2, 2, 8),)

    inputs, targets = batches(0)
    return ModelSpec("tied", Tied(), inputs, targets, nn.functional.mse_loss, batches, 1, 0,
                     eval_batches=lambda k: batches(-1 - k))


def test_in_float64_converts_a_private_copy_of_the_model_and_every_batch():
    workload = _tied_workload()
    converted = in_float64(workload)
    model = converted.model
    assert model is not workload.model and workload.model.emb.weight.dtype == torch.float32  # the caller's as it was
    assert {p.dtype for p in model.parameters()} == {torch.float64}
    assert model.head.weight is model.emb.weight  # the tie survives the copy and the conversion
    assert model.steps.dtype == torch.int64 and model.scale.dtype == torch.float64
    for inputs, targets in (converted.batches(1), converted.eval_batches(0),
                            (converted.example_inputs, converted.example_targets)):
        assert inputs[0].dtype == torch.int64  # token ids as they are
        assert inputs[1].dtype == targets[0].dtype == torch.float64
    assert torch.equal(converted.batches(1)[0][0], workload.batches(1)[0][0])
    out = model(*converted.example_inputs)
    assert out.dtype == torch.float64


def test_a_workload_without_held_out_data_keeps_none():
    workload = build_model("mlp", stages=1)
    converted = in_float64(workload)
    assert converted.eval_batches is not None and converted.eval_batches(0)[0][0].dtype == torch.float64
    plain = ModelSpec("x", workload.model, workload.example_inputs, workload.example_targets, workload.loss_fn,
                      workload.batches, 1, 0)
    assert in_float64(plain).eval_batches is None


def test_fp64_has_tolerances_near_rounding_and_is_judged_entry_by_entry():
    rtol, atol = TOLERANCES["fp64"]
    assert rtol <= 1e-10 and atol <= 1e-12
    assert "fp64" not in check.SCALED and "bf16" in check.SCALED


def test_precision_fp64_is_a_float64_model_not_a_recipe_on_fp32_weights():
    assert precision_of("fp64", torch.float64) == Precision(compute="float64", master="float64")
    with pytest.raises(CaptureError, match=r"'fp64' needs a float64 model: its parameters are float32.*model\.double"):
        precision_of("fp64", torch.float32)


@pytest.mark.parametrize("command", ["train", "plan"])
def test_fp64_outside_check_is_refused_naming_the_flag(command, capsys):
    extra = ["--out", "x.json"] if command == "plan" else []
    with pytest.raises(SystemExit) as err:
        main([command, "--precision", "fp64", *extra])
    assert err.value.code == 2
    text = capsys.readouterr().err
    assert "--precision fp64 is for piper check" in text and "model.double()" in text


def test_check_offers_fp64():
    from piper_train.cli.options import build_parser

    args = build_parser().parse_args(["check", "--precision", "fp64"])
    assert args.precision == "fp64"


def test_exact_keeps_every_bit_of_a_python_float():
    a, b = 2.0, 2.0 + 4e-8  # the same float32 (its step at 2.0 is 2.4e-7)
    assert torch.tensor(a) == torch.tensor(b)
    assert check._exact(b).item() == b and check._exact(a) != check._exact(b)


class _FakeTrainer:
    """What ``run_check`` uses of a ``Trainer``: no steps, one held-out batch, one parameter."""

    program = None

    def __init__(self, *args, **kwargs) -> None:
        self.precision = kwargs["precision"]

    def __enter__(self) -> _FakeTrainer:
        return self

    def __exit__(self, *exc) -> None:
        pass

    def parameters(self) -> dict[str, torch.Tensor]:
        return {"w": torch.ones(2, dtype=torch.float64)}

    def evaluate(self, inputs, targets) -> float:
        return 2.0 + 4e-8


class _FakeReference(_FakeTrainer):
    microbatches = shards = 1

    def __init__(self) -> None:
        pass

    def whole_and_pieces(self, inputs, targets) -> tuple[float, float]:
        return 2.0, 2.0

    def evaluate(self, inputs, targets) -> float:
        return 2.0


def test_held_out_losses_are_compared_at_full_precision(monkeypatch):
    """Two held-out losses 4e-8 apart, one float32 value: the check sees their difference
    (before, both became the same float32 and compared equal), and fp64 fails it."""
    made: list[_FakeTrainer] = []

    def trainer(*args, **kwargs):
        made.append(_FakeTrainer(*args, **kwargs))
        return contextlib.nullcontext(made[-1])

    monkeypatch.setattr(check, "Trainer", trainer)
    monkeypatch.setattr(check, "reference_for", lambda *args, **kwargs: _FakeReference())
    rtol, atol = TOLERANCES["fp64"]
    report = run_check(_tied_workload(), None, steps=0, eval_batches=1, rtol=rtol, atol=atol, precision="fp64",
                       runtime="local")
    assert made[0].precision is None  # fp64 runs the float64 copy in its own dtypes
    (eval_,) = [d for d in report.differences if d.what == "eval"]
    assert eval_.abs == pytest.approx(4e-8, rel=1e-6) and not eval_.ok and not report.ok
    assert report.whole_batch is not None and report.whole_batch.ok
