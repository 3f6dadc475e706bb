"""``piper train --json`` on the runtime: exactly one JSON document on stdout when the run
fails too (stand-in commands for every outcome: packages/piper-train/tests/test_cli_json.py;
SIGTERM, as its own process: test_listeners.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.usefixtures("ray_cluster")

FAULTY_MODEL = Path(__file__).resolve().parent / "fixtures" / "faulty_model.py"


def test_a_nan_with_on_nan_stop_leaves_the_steps_before_it(piper):
    """Was: an empty stdout (the run failed before the summary was printed)."""
    done = piper("train", "--model", f"{FAULTY_MODEL}:nan", "--pp", "2", "--microbatches", "2", "--steps", "3",
                 "--on-nan", "stop", "--json")
    assert done.returncode == 3, done.stderr
    assert done.stdout.count("\n") == 1, done.stdout
    doc = json.loads(done.stdout)
    assert (doc["command"], doc["ok"], doc["exit_code"]) == ("train", False, 3)
    assert doc["error"].startswith("piper train: run failed: step 2: the loss of microbatch 1 is nan (rank 1)")
    assert doc["error"] in done.stderr and "\x1b" not in done.stderr
    assert doc["steps"] == 1 and len(doc["losses"]) == 1 and doc["pp"] == 2 and doc["microbatches"] == 2


def test_bad_input_leaves_a_document(piper):
    done = piper("train", "--model", "gpt5", "--steps", "1", "--json")
    assert done.returncode == 2
    doc = json.loads(done.stdout)
    assert (doc["command"], doc["ok"], doc["exit_code"]) == ("train", False, 2)
    assert doc["error"].startswith("piper train: error: ") and doc["error"] in done.stderr
