"""``piper tune`` with sequence and context parallelism: a candidate whose rewrite the model
refuses keeps the library's reason; ``--sp``/``--cp`` on the command line, with and without
``--hardware``."""

from __future__ import annotations

import json

import pytest

from piper_directives import capture
from piper_train.cli import main
from piper_train.models import build_model
from piper_train.tuning.api import _Sharder
from piper_train.tuning.search import INVALID, evaluate
from piper_train.tuning.space import Candidate

TINY = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 128}


def test_a_context_parallel_candidate_the_model_refuses_keeps_the_reason() -> None:
    """The built-in mlp has no attention: its cp candidates are invalid with the rewrite's reason."""
    spec = build_model("mlp", stages=2)
    captured = capture(spec.model, spec.example_inputs, spec.example_targets, spec.loss_fn)
    from piper_train.tuning.costs import Profile

    profile = Profile("mlp", captured.batch_size, 2)
    e = evaluate(captured.graph, profile, Candidate("1f1b", 1, 1, cp=2), shard=_Sharder(captured), refused={})
    assert e.status == INVALID and "context" in e.reason.lower()


def _run(capsys, *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    try:
        code = main(list(args))
    except SystemExit as exit_:
        code = exit_.code
    out, err = capsys.readouterr()
    assert "Traceback" not in err, err
    return code, out, err


def test_tune_hardware_searches_sp_and_cp_and_shows_them(capsys, tmp_path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY))
    code, out, err = _run(capsys, "tune", "--hardware", "h100", "--devices", "4", "--model", f"hf:{config}",
                          "--seq-len", "32", "--batch-size", "8", "--schedules", "1f1b", "--microbatch-range", "1,2",
                          "--sp", "search", "--cp", "2", "--top", "500", "--json")
    assert code == 0, err
    rows = json.loads(out)["ranking"]
    assert any(r["sp"] for r in rows) and any(r["cp"] == 2 for r in rows)
    for r in rows:
        assert r["pp"] * r["dp"] * r["tp"] * r["cp"] == 4
        assert (" sp" in r["strategy"]) == r["sp"] and ("cp=2" in r["strategy"]) == (r["cp"] == 2)
    code, out, err = _run(capsys, "tune", "--hardware", "h100", "--devices", "4", "--model", f"hf:{config}",
                          "--cp", "3")
    assert code == 2 and "--cp: degree 3 does not divide --devices 4" in err


@pytest.mark.parametrize(("args", "message"), [
    (("--sp",), "needs --tp >= 2"),
    (("--tp", "2", "--cp", "2"), "context parallelism with tensor parallelism"),
])
def test_simulate_hardware_refuses_what_cannot_run(capsys, tmp_path, args, message) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY))
    code, _, err = _run(capsys, "simulate", "--hardware", "h100", "--devices", "4", "--model", f"hf:{config}",
                        "--pp", "1", *args)
    assert code == 2 and message in err


def test_simulate_hardware_prices_cp(capsys, tmp_path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY))
    code, out, err = _run(capsys, "simulate", "--hardware", "h100", "--devices", "4", "--model", f"hf:{config}",
                          "--seq-len", "32", "--batch-size", "8", "--pp", "2", "--microbatches", "2", "--cp", "2",
                          "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["strategy"] == "1f1b pp=2 cp=2 mb=2" and doc["parts"]["cp_comm_per_layer"] > 0
    code, _, err = _run(capsys, "tune", "--devices", "4", "--cp", "3")
    assert code == 2 and "--cp: degree 3 does not divide --devices 4" in err
