"""``--optimizer-impl`` of ``piper train`` / ``piper check``: the parsed choice reaches the
``OptimizerSpec`` the ranks and the reference build from (no Ray)."""

from __future__ import annotations

import pytest

from piper_runtime.optim import IMPLEMENTATIONS
from piper_train.cli import main
from piper_train.cli.options import OPTIMIZER_IMPLEMENTATIONS, build_parser
from piper_train.cli.training import _optimizer


def test_the_command_line_offers_the_runtimes_implementations() -> None:
    assert OPTIMIZER_IMPLEMENTATIONS == IMPLEMENTATIONS


@pytest.mark.parametrize(("argv", "expected"), [([], "auto"), (["--optimizer-impl", "for-loop"], "for-loop")])
def test_the_choice_reaches_the_optimizer_spec(argv: list[str], expected: str) -> None:
    spec = _optimizer(build_parser().parse_args(["check", "--optimizer", "adam", *argv]))
    assert spec.name == "adam" and spec.implementation == expected


def test_an_unknown_implementation_is_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as err:
        main(["train", "--optimizer-impl", "fast"])
    assert err.value.code == 2
    assert "--optimizer-impl: invalid choice: 'fast'" in capsys.readouterr().err
