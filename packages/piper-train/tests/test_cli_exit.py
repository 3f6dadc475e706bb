"""A torchrun rank whose run failed ends at once with exit code 3 (``cli._end_now``): its
message and document are written first, and the interpreter's shutdown, under rank threads
still inside native calls, is skipped. Elsewhere ``main`` returns the code as always."""

from __future__ import annotations

import argparse

import pytest

from piper_ir import ExecutionError
from piper_train import cli


class _Ended(Exception):
    """Raised by the stand-in for ``os._exit``."""


def _failing_run(args: argparse.Namespace) -> int:
    raise ExecutionError("rank 1 failed during step: injected", ranks=(1,))


@pytest.fixture
def ended(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    codes: list[int] = []

    def fake_exit(code: int) -> None:
        codes.append(code)
        raise _Ended

    monkeypatch.setattr(cli.os, "_exit", fake_exit)
    monkeypatch.setattr(cli, "_run", _failing_run)
    return codes


def test_a_failed_run_under_torchrun_ends_at_once_after_its_message(
        ended: list[int], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    with pytest.raises(_Ended):
        cli.main(["simulate", "--json"])
    out, err = capsys.readouterr()
    assert ended == [3] and "run failed: rank 1 failed during step" in err
    assert '"exit_code": 3' in out  # the --json document was written before


def test_elsewhere_a_failed_run_returns_its_code(ended: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert cli.main(["simulate"]) == 3 and ended == []
