"""``piper tune --hardware`` and ``piper simulate --hardware``: Llama-3-70B planned for 1,024
H100s on this machine, without allocating the model (docs/planning.md)."""

from __future__ import annotations

import json
import resource
import time
from pathlib import Path

import pytest

from piper_train.cli import main

LLAMA3_70B = {"model_type": "llama", "hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64,
              "num_key_value_heads": 8, "intermediate_size": 28672, "vocab_size": 128256,
              "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0}


@pytest.fixture(scope="module")
def llama70b(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("llama3-70b") / "config.json"
    path.write_text(json.dumps(LLAMA3_70B))
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


def test_tune_plans_llama3_70b_on_1024_h100s_without_allocating_it(capsys, llama70b):
    started = time.perf_counter()
    code, out, err = run(capsys, "tune", "--hardware", "h100", "--devices", "1024", "--model", f"hf:{llama70b}",
                         "--schedules", "1f1b,zb1p,interleaved_1f1b", "--microbatch-range", "8-64", "--top", "5",
                         "--json")
    seconds = time.perf_counter() - started
    assert code == 0, err
    doc = json.loads(out)
    assert seconds < 60
    # Its weights alone would be 141 GB in bf16; this process never held a tenth of that.
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 < 14e9
    assert doc["parameters"] == 70_553_706_496 and doc["devices"] == 1024
    ranking = doc["ranking"]
    assert len(ranking) == 5 and doc["best"] == ranking[0]
    for row in ranking:
        assert row["fits"] and row["peak_bytes"] <= 80 * 2**30
        assert row["pp"] * row["dp"] * row["tp"] == 1024
        assert 0 < row["mfu"] < 1 and 0 <= row["bubble"] < 1
        assert row["tokens_per_second"] == pytest.approx(1024 * 4096 / row["step_seconds"])
    assert [r["step_seconds"] for r in ranking] == sorted(r["step_seconds"] for r in ranking)
    assert "MFU" in err and "GiB/dev" in err  # the table, on stderr with --json


def test_simulate_prices_one_strategy_and_simulates_its_schedule(capsys, llama70b):
    code, out, err = run(capsys, "simulate", "--hardware", "h100", "--devices", "64", "--model", f"hf:{llama70b}",
                         "--schedule", "zb1p", "--pp", "4", "--tp", "8", "--microbatches", "16", "--batch-size", "32",
                         "--seq-len", "2048", "--zero", "1", "--recompute", "all", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["strategy"] == "zb1p pp=4 dp=2 tp=8 zero=1 mb=16 recompute"
    # The closed form and the simulator on the compiled ZB-H1 schedule agree on the pipeline.
    assert doc["simulated_pipeline_seconds"] == pytest.approx(doc["parts"]["pipeline"], rel=0.02)
    assert doc["step_seconds"] == pytest.approx(sum(doc["parts"][k] for k in ("pipeline", "dp_exposed", "optimizer")))


def test_planning_refusals_name_the_culprit(capsys, llama70b, tmp_path):
    code, out, err = run(capsys, "tune", "--hardware", "h100", "--devices", "8", "--model", "mlp", "--json")
    assert code == 2 and "--model hf:CONFIG" in json.loads(out)["error"]
    bad = tmp_path / "hw.json"
    bad.write_text(json.dumps({"name": "x", "peak_tflops": {"bf16": 100}, "link_efficiency": 2}))
    code, _, err = run(capsys, "tune", "--hardware", str(bad), "--devices", "8", "--model", f"hf:{llama70b}")
    assert code == 2 and "link_efficiency" in err
    code, _, err = run(capsys, "simulate", "--tp", "2")
    assert code == 2 and "give --hardware too" in err
    code, _, err = run(capsys, "simulate", "--hardware", "h100", "--devices", "6", "--pp", "4",
                       "--model", f"hf:{llama70b}")
    assert code == 2 and "--devices 6 is not a multiple" in err
