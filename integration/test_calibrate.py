"""``piper tune --calibrate`` writes this machine's hardware file, and ``piper tune --hardware``
plans a model that runs here from it (docs/planning.md, "Calibration")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from piper_train.cli import main
from piper_train.hardware import load_hardware

TINY = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64, "max_position_embeddings": 64}


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
    return path


def run(capsys, *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    try:
        code = main(list(args))
    except SystemExit as exit_:
        code = exit_.code
    out, err = capsys.readouterr()
    assert "Traceback" not in err, err
    return code, out, err


def test_calibrate_then_plan_this_machine(capsys, tmp_path, config):
    out = tmp_path / "here.json"
    # --calibrate-seconds 0.6: the model's step timed 0.6 s or more per size and strategy, the rest 0.1 s
    code, stdout, _ = run(capsys, "tune", "--calibrate", "--devices", "2", "--model", f"hf:{config}", "--seq-len", "8",
                          "--out", str(out), "--calibrate-seconds", "0.6", "--json")
    assert code == 0
    doc = json.loads(stdout)  # exactly one JSON document
    assert doc["calibrate"] is True and doc["out"] == str(out) and json.loads(out.read_text()) == doc["hardware"]
    hw = load_hardware(str(out))
    assert hw.peak("fp32") > 0 and 0 < hw.flop_efficiency <= 1 and hw.devices_per_node == 2
    assert hw.intra_node_gb_per_s > 0 and hw.memory_gib > 0
    # the model's own step, timed at 1 and 2 sequences (--batch-size 1: the microbatch), is what the figures fit
    step = doc["step"]
    assert doc["runtime"] == "local" and step["sequences"] == [1, 2] and min(step["seconds"]) > 0
    assert step["flop_efficiency"] == hw.flop_efficiency and "fitted to" in hw.source and "over 0.1 s or more" in hw.source
    # with ZeRO-1 too: where its reduce-scatter and all-gather ran slower than the ring's, the factor is in the file
    zero1 = step["zero1"]
    assert zero1 is None or (zero1["sequences"] == 2 and zero1["scatter_gather_factor"] == hw.scatter_gather_factor > 1)
    code, stdout, _ = run(capsys, "tune", "--hardware", str(out), "--precision", "fp32", "--devices", "2", "--model",
                          f"hf:{config}", "--seq-len", "8", "--batch-size", "4", "--microbatch-range", "1-4",
                          "--recompute", "none", "--json")
    assert code == 0
    plan = json.loads(stdout)
    assert plan["hardware"] == "here" and plan["ranking"] and plan["best"]["step_seconds"] > 0
    # the step is priced in fp32 against the measured fp32 peak
    best = plan["best"]
    assert best["mfu"] == pytest.approx(best["tflops_per_device"] / hw.peak("fp32"))


def test_calibrate_refuses_what_it_cannot_measure(capsys, tmp_path, config):
    model = tmp_path / "net.py"
    model.write_text("")
    code, stdout, _ = run(capsys, "tune", "--calibrate", "--devices", "2", "--model", f"{model}:make", "--json",
                          "--out", str(tmp_path / "x.json"))
    assert code == 2 and "--model hf:CONFIG" in json.loads(stdout)["error"]
    code, _, err = run(capsys, "tune", "--calibrate", "--devices", "2", "--precision", "fp64")
    assert code == 2 and "--precision fp64" in err
    code, stdout, _ = run(capsys, "tune", "--devices", "2", "--precision", "bf16", "--json")  # profiling: no dtype
    assert code == 2 and "--precision" in json.loads(stdout)["error"]
    code, stdout, _ = run(capsys, "tune", "--devices", "2", "--runtime", "ray", "--json")  # profiling: no --runtime
    assert code == 2 and "--runtime" in json.loads(stdout)["error"]
    for bad in (["--calibrate-seconds", "1"], ["--calibrate", "--calibrate-seconds", "-1"]):
        code, _, err = run(capsys, "tune", "--devices", "2", *bad)
        assert code == 2 and "--calibrate-seconds" in err
    # without --model: square products only; a CPU file has no bf16 peak, and planning in bf16 names the field
    out = tmp_path / "here.json"
    assert run(capsys, "tune", "--calibrate", "--devices", "2", "--out", str(out), "--calibrate-seconds", "0.3")[0] == 0
    assert "(1 shapes" in load_hardware(str(out)).source
    code, stdout, _ = run(capsys, "tune", "--hardware", str(out), "--devices", "2", "--model", f"hf:{config}",
                          "--seq-len", "8", "--json")
    assert code == 2 and "peak_tflops.bf16" in json.loads(stdout)["error"]
