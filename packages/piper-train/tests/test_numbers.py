"""Every number a user gives is checked where it is given, naming it, before anything runs:
each numeric option of every ``piper`` command refuses NaN, infinities and values below its
minimum with a usage error naming the flag (exit code 2, no traceback), and the Python API
refuses a NaN learning rate or timeout with a ``ValueError`` naming the parameter."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from piper_runtime import OptimizerSpec
from piper_train import bounds, cli
from piper_train.cli.options import MAXIMUMS, MINIMUMS, build_parser, finite_float, wandb_target
from piper_train.cli.outputs import output_file
from piper_train.schedule import LearningRate, LRSchedule
from piper_train.trainer import Trainer

# What each command needs besides the option under test (nothing of it is read: the parse fails).
REQUIRED = {"plan": ["--out", "{tmp}/p.json"], "show": ["{tmp}/p.json"], "tune": ["--devices", "2"],
            "export": ["{tmp}/ckpt", "--out", "{tmp}/m.pt"]}


def _numeric_options() -> list[tuple[str, argparse.Action]]:
    """(command, option) for every option of every command whose value is read as numbers."""
    top = build_parser()
    commands = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction)).choices
    return [
        (name, action)
        for name, parser in commands.items()
        for action in parser._actions
        if action.option_strings and action.type not in (None, Path, output_file, wandb_target)  # texts
    ]


OPTIONS = _numeric_options()


@pytest.fixture
def no_run(monkeypatch):
    """A command that got past its checks fails the test at once instead of running."""
    monkeypatch.setattr(cli, "_run", lambda args: pytest.fail(f"piper {args.command} ran with {vars(args)}"))


def _refused(argv: list[str], tmp_path, capsys) -> str:
    argv = [argv[0], *(a.format(tmp=tmp_path) for a in REQUIRED.get(argv[0], [])), *argv[1:]]
    with pytest.raises(SystemExit) as done:
        cli.main(argv)
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize("value", ["nan", "inf"])
@pytest.mark.parametrize(("command", "action"), OPTIONS, ids=[f"{c} {a.option_strings[0]}" for c, a in OPTIONS])
def test_every_numeric_option_refuses_nan_and_infinities(command, action, value, tmp_path, capsys, no_run) -> None:
    flag = action.option_strings[0]
    given = f"F={value}" if flag == "--cost" else value
    err = _refused([command, f"{flag}={given}"], tmp_path, capsys)
    assert f"piper {command}: error: argument {flag}" in err


@pytest.mark.parametrize(("command", "action"), [(c, a) for c, a in OPTIONS if a.dest in MINIMUMS],
                         ids=[f"{c} {a.option_strings[0]}" for c, a in OPTIONS if a.dest in MINIMUMS])
def test_every_numeric_option_refuses_a_value_below_its_minimum(command, action, tmp_path, capsys, no_run) -> None:
    minimum, strict = MINIMUMS[action.dest]
    below = int(minimum) if strict else int(minimum) - 1
    flag = action.option_strings[0]
    err = _refused([command, f"{flag}={below}"], tmp_path, capsys)
    assert f"error: {flag} must be {'>' if strict else '>='} {minimum:g}, got {below}" in err


@pytest.mark.parametrize(("command", "action"), [(c, a) for c, a in OPTIONS if a.dest in MAXIMUMS],
                         ids=[f"{c} {a.option_strings[0]}" for c, a in OPTIONS if a.dest in MAXIMUMS])
def test_a_value_that_would_overflow_where_it_is_used_is_refused(command, action, tmp_path, capsys, no_run) -> None:
    """``--timeout 1e308`` overflowed a worker's ``timedelta`` (exit 3, a traceback), and
    ``--memory-budget-mb 1e308`` the budget's ``int()`` in bytes (a traceback)."""
    flag = action.option_strings[0]
    err = _refused([command, f"{flag}=1e308"], tmp_path, capsys)
    assert f"error: {flag} must be <= {MAXIMUMS[action.dest]:g}, got 1e+308" in err


def test_every_numeric_option_has_its_rule() -> None:
    """A new option is covered by the tests above only if it reads finite numbers and says its
    minimum: no bare ``float`` (which reads NaN), and every number in ``MINIMUMS`` but the seed
    (any integer) and the ZeRO level (a choice)."""
    assert not [a.option_strings for _, a in OPTIONS if a.type is float]
    unruled = {a.option_strings[0] for _, a in OPTIONS if a.type in (int, finite_float)} - {"--seed", "--zero"}
    assert unruled <= {f"--{name.replace('_', '-')}" for name in MINIMUMS}
    assert len(OPTIONS) > 50  # the walk found the commands' options


def test_finite_numbers_pass() -> None:
    assert finite_float("1e-3") == 1e-3 and finite_float("-2") == -2.0
    for text in ("-inf", "NaN", "Infinity", "1e999"):  # float() reads each; the last as inf
        with pytest.raises(argparse.ArgumentTypeError, match="expected a finite number"):
            finite_float(text)
    assert bounds.problem(0.0, minimum=0) is None and bounds.problem(1, minimum=0, strict=True) is None
    assert bounds.problem(True) == "must be a number" and bounds.problem(math.nan) == "must be a finite number"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"timeout_s": math.nan}, "timeout_s must be a finite number, got nan"),
        ({"timeout_s": 0}, "timeout_s must be > 0, got 0"),
        ({"timeout_s": 1e308}, "timeout_s must be <= 1e\\+09, got 1e\\+308"),
        ({"step_timeout_s": math.inf}, "step_timeout_s must be a finite number, got inf"),
        ({"clip_grad_norm": math.nan}, "clip_grad_norm must be a finite number"),
        ({"memory_budget_bytes": 0}, "memory_budget_bytes must be > 0"),
    ],
)
def test_the_trainer_refuses_bad_numbers_by_name_before_capturing(kwargs, message) -> None:
    """(A bad learning rate or weight decay never gets this far: ``OptimizerSpec`` refuses it.)"""
    class Uncapturable(nn.Module):
        def forward(self, x):
            raise AssertionError("captured")

    with pytest.raises(ValueError, match=message):
        Trainer(Uncapturable(), torch.zeros(2, 2), torch.zeros(2, 2), nn.functional.mse_loss, lambda n: None,
                **kwargs)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: LearningRate(math.nan), "lr must be a finite number, got nan"),
        (lambda: LRSchedule("cosine", total_steps=4, min_lr=math.nan), "min_lr must be a finite number"),
        (lambda: LRSchedule("cosine", total_steps=4, min_lr=-1.0), "min_lr must be >= 0, got -1.0"),
        (lambda: LRSchedule("step", step_size=2, gamma=math.inf), "gamma must be a finite number"),
        (lambda: LRSchedule("step", step_size=2, gamma=0.0), "gamma must be > 0"),
    ],
)
def test_the_learning_rate_schedule_refuses_bad_numbers_by_name(make, message) -> None:
    with pytest.raises(ValueError, match=message):
        make()


@pytest.mark.parametrize(("make", "message"), [
    (lambda: OptimizerSpec("adamw", math.nan), "learning rate must be a finite number >= 0, got nan"),
    (lambda: OptimizerSpec("sgd", -0.1), "learning rate must be a finite number >= 0, got -0.1"),
    (lambda: OptimizerSpec("adamw", 1e-3, weight_decay=math.inf), "weight decay must be a finite number >= 0"),
])
def test_an_optimizer_spec_refuses_bad_numbers(make, message) -> None:
    with pytest.raises(ValueError, match=message):
        make()
