"""``piper train``/``piper check`` start their embedded cluster from their flags, before they
import torch (``piper_train.cli.early_start``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import piper_runtime
from piper_train.cli import early_start
from piper_train.cli.options import build_parser
from piper_train.cli.run_options import run_options


@pytest.fixture()
def asked(monkeypatch: pytest.MonkeyPatch) -> list[tuple[object, int]]:
    """What ``prepare_runtime`` was asked (nothing is started)."""
    calls: list[tuple[object, int]] = []
    monkeypatch.setattr(piper_runtime, "prepare_runtime", lambda options, world: calls.append((options, world)))
    return calls


def _start(argv: list[str]) -> None:
    early_start.start_cluster(build_parser().parse_args(argv))


@pytest.mark.parametrize(("argv", "world"), [
    (["train", "--model", "lm", "--schedule", "1f1b", "--pp", "2"], 2),
    (["train", "--model", "mlp", "--schedule", "gpipe", "--pp", "2", "--dp", "2"], 4),
    (["check", "--model", "mlp", "--schedule", "interleaved_1f1b", "--pp", "2", "--tp", "2"], 4),
])
def test_the_world_and_options_are_those_the_command_gives_its_trainer(asked, argv, world) -> None:
    _start(argv)
    args = build_parser().parse_args(argv)
    assert asked == [(run_options(args), world)]


def test_a_strategy_file_is_the_users_code_run_once_later(asked, tmp_path: Path) -> None:
    strategy = tmp_path / "strategy.py"
    strategy.write_text("raise SystemExit('ran early')\n")
    _start(["train", "--model", "mlp", "--strategy", str(strategy)])
    assert asked == []


def test_bad_input_is_left_to_the_command(asked) -> None:
    _start(["train", "--model", "mlp", "--schedule", "1f1b", "--pp", "2", "--timeout", "-1"])
    assert asked == []


def test_other_commands_start_nothing(asked) -> None:
    _start(["simulate", "--schedule", "1f1b", "--pp", "2"])
    assert asked == []


def test_the_cluster_is_asked_for_before_torch_is_imported() -> None:
    """The real command, in a process of its own, stopped where it asks (no cluster starts)."""
    code = (
        "import os, sys\n"
        "import piper_runtime\n"
        "def asked(options, world):\n"
        "    print('torch' in sys.modules, world, flush=True)\n"
        "    os._exit(0)\n"
        "piper_runtime.prepare_runtime = asked\n"
        "from piper_train.cli import main\n"
        "main(['train', '--model', 'lm', '--schedule', '1f1b', '--pp', '2', '--steps', '1'])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["False", "2"], out.stderr[-2000:]
