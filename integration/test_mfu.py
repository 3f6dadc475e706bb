"""``piper train --hardware``: each step's model TFLOP/s per device and MFU, in the progress
line and in ``--json``."""

from __future__ import annotations

import json

import pytest

from piper_train.flops import step_flops
from piper_train.workload import load_workload


def test_mfu_is_the_steps_flops_over_time_devices_and_peak(piper, tmp_path):
    hardware = tmp_path / "cpu.json"
    hardware.write_text(json.dumps({"name": "cpu", "peak_tflops": {"fp32": 0.05}, "source": "test"}))
    done = piper("train", "--model", "mlp", "--pp", "2", "--steps", "3", "--hardware", str(hardware), "--json")
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["tflops_per_device"] > 0
    assert summary["mfu"] == pytest.approx(summary["tflops_per_device"] / 0.05)
    assert "TFLOP/s/device (MFU " in done.stderr
    # The FLOPs behind them: the mlp's step, spread over the step's time and 2 devices.
    spec = load_workload("mlp", stages=2)
    flops = step_flops(spec.model, spec.example_inputs, spec.example_targets, spec.loss_fn)
    seconds = flops / (summary["tflops_per_device"] * 1e12 * 2)
    assert 0.0001 < seconds < 10
