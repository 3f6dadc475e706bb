"""Job files end to end: ``piper train --config job.toml`` and ``--config job.yaml`` train
exactly as the command line they write down (the same losses, bit for bit), a strategy
embedded in the file as a named one, and ``--print-config``'s file runs the same again.
Runs on the runtime the tests choose (``conftest.runtime``: ``local`` unless told)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tomli_w

from piper_directives import build_schedule

from .conftest import Done

pytestmark = pytest.mark.usefixtures("ray_cluster")

STEPS = ("--model", "mlp", "--steps", "3", "--seed", "5", "--lr", "0.01", "--optimizer", "adam",
         "--no-progress-bar", "--prefetch", "0", "--json")


def losses(done: Done) -> list[float]:
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["steps"] == 3
    return doc["losses"]


TOML = """\
# the command line's options, written down
model = "mlp"
steps = 3
seed = 5
lr = 0.01
optimizer = "adam"
no_progress_bar = true
prefetch = 0
pp = 2
microbatches = 2
dp = 2
zero = 1
"""

YAML = """\
model: mlp
steps: 3
seed: 5
lr: 0.01
optimizer: adam
no_progress_bar: true
prefetch: 0
pp: 2
microbatches: 2
dp: 2
zero: 1
"""


def test_toml_and_yaml_job_files_reproduce_the_command_lines_losses(piper, tmp_path: Path) -> None:
    cli = losses(piper("train", *STEPS, "--pp", "2", "--microbatches", "2", "--dp", "2", "--zero", "1"))
    toml = tmp_path / "job.toml"
    toml.write_text(TOML, encoding="utf-8")
    yaml = tmp_path / "job.yml"
    yaml.write_text(YAML, encoding="utf-8")
    assert losses(piper("train", "--config", str(toml), "--json")) == cli
    assert losses(piper("train", "--config", str(yaml), "--json")) == cli
    # a flag overrides the file: another learning rate, other losses, those of the command line
    lr = losses(piper("train", *STEPS, "--pp", "2", "--microbatches", "2", "--dp", "2", "--zero", "1",
                      "--lr", "0.05"))
    assert lr != cli and losses(piper("train", "--config", str(toml), "--json", "--lr", "0.05")) == lr


def test_an_embedded_strategy_trains_as_the_named_file_and_print_config_runs_the_same(piper, tmp_path: Path) -> None:
    program = build_schedule("gpipe", 2, 2)
    named = tmp_path / "gpipe.json"
    named.write_text(program.to_json(), encoding="utf-8")
    cli = losses(piper("train", *STEPS, "--strategy", str(named)))
    job = tmp_path / "job.toml"
    job.write_text(tomli_w.dumps({"model": "mlp", "steps": 3, "seed": 5, "lr": 0.01, "optimizer": "adam",
                                  "no_progress_bar": True, "prefetch": 0,
                                  "strategy": json.loads(program.to_json())}), encoding="utf-8")
    assert losses(piper("train", "--config", str(job), "--json")) == cli
    printed = piper("train", "--config", str(job), "--print-config", "yaml")
    assert printed.returncode == 0
    again = tmp_path / "printed.yaml"
    again.write_text(printed.stdout, encoding="utf-8")
    assert losses(piper("train", "--config", str(again), "--json")) == cli
