"""``piper train --hardware``: each step's model TFLOP/s per device and MFU, in the progress
line and in ``--json``."""

from __future__ import annotations

import json
import time

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


def test_the_last_steps_line_has_the_rate_when_the_count_ends_after_every_step(piper, tmp_path, monkeypatch):
    """The FLOPs are counted on a thread of their own while the steps run: a run shorter than
    the count still prints its rate, on its last step's line."""
    from piper_train.trainer import Trainer

    count = Trainer.throughput

    def slow(self, hardware=None):
        time.sleep(1.0)  # longer than the whole run's steps
        return count(self, hardware)

    monkeypatch.setattr(Trainer, "throughput", slow)
    done = piper("train", "--model", "mlp", "--pp", "2", "--steps", "3", "--json")
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["1/3", "2/3", "3/3"]
    assert "TFLOP/s/device" not in lines[0] and "TFLOP/s/device" in lines[-1]
    assert json.loads(done.stdout)["tflops_per_device"] > 0
