"""Model FLOPs of a step (piper_train.flops) and hardware files (piper_train.hardware)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from piper_train.flops import Throughput, step_flops
from piper_train.hardware import HARDWARE, load_hardware


def test_a_linear_step_counts_forward_and_weight_gradient():
    """Linear(8 -> 4), no bias, batch 16: forward 2*16*8*4 and the weight gradient as much; the
    input needs no gradient. Counted on the meta device, nothing computed."""
    model = nn.Linear(8, 4, bias=False)
    x, y = torch.randn(16, 8), torch.randn(16, 4)
    assert step_flops(model, (x,), (y,), nn.functional.mse_loss) == 2 * (2 * 16 * 8 * 4)
    assert model.weight.grad is None  # a copy was run


def test_two_layers_add_the_hidden_input_gradient():
    model = nn.Sequential(nn.Linear(8, 6, bias=False), nn.Linear(6, 4, bias=False))
    x, y = torch.randn(10, 8), torch.randn(10, 4)
    first, second = 2 * 10 * 8 * 6, 2 * 10 * 6 * 4
    assert step_flops(model, (x,), (y,), nn.functional.mse_loss) == 2 * first + 3 * second


class NeedsValues(nn.Module):
    """Reads a value in forward (as transformers' mask code does): the meta device cannot run it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 4, bias=False)

    def forward(self, x):
        return self.lin(x) * (x.abs().max().item() > 0)


def test_a_model_that_reads_values_is_counted_on_a_real_copy_or_not_at_all():
    x, y = torch.randn(16, 8), torch.randn(16, 4)
    assert step_flops(NeedsValues(), (x,), (y,), nn.functional.mse_loss) == 2 * (2 * 16 * 8 * 4)
    assert step_flops(NeedsValues(), (x,), (y,), nn.functional.mse_loss, real=False) is None


def test_throughput_scales_to_the_steps_size_and_divides_by_devices_and_peak():
    rate = Throughput(example_flops=4 * 10**12, example_size=100, devices=2, peak_tflops=8.0)
    tflops, mfu = rate.step(size=50, seconds=0.5)  # half the example's tokens in half a second
    assert tflops == pytest.approx(2.0) and mfu == pytest.approx(0.25)
    assert Throughput(10**12, 1, 1).step(1, 1.0) == (1.0, None)


def test_shipped_hardware_files_load():
    for name in HARDWARE:
        hardware = load_hardware(name)
        assert hardware.name == name and hardware.peak("bf16") > 100 and hardware.source
    assert load_hardware("h100").peak("bf16") == pytest.approx(989.4)


@pytest.mark.parametrize("content, message", [
    ({"name": "x", "peak_tflops": {"fp32": 1.0}, "peek": 1}, "unknown key\\(s\\) peek"),
    ({"name": "x", "peak_tflops": {"fp33": 1.0}}, "peak_tflops: unknown dtype 'fp33'"),
    ({"name": "x", "peak_tflops": {"fp32": -1}}, "peak_tflops.fp32 must be a positive number"),
    ({"name": "x"}, "needs a name and peak_tflops"),
])
def test_a_bad_hardware_file_is_refused_naming_what_is_wrong(tmp_path, content, message):
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(content))
    with pytest.raises(ValueError, match=f"--hardware {path}: {message}"):
        load_hardware(str(path))
