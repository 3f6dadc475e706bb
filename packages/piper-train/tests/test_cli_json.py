"""``--json``: stdout holds exactly one JSON document in every outcome
(``piper_train.cli.document``). In-process, with stand-in commands where a real one would need
Ray (the real ones: integration/test_cli_json.py, integration/test_listeners.py)."""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import threading

import pytest

from piper_ir import ExecutionError
from piper_train import cli, stopping
from piper_train.cli import main
from piper_train.cli.document import emit, readable, strip_ansi

RAY_TRACEBACK = "\x1b[36mray::RankWorker.run_steps()\x1b[39m (pid=4242, ip=127.0.0.1)\n  \x1b[1mboom\x1b[0m"


def one_document(out: str) -> dict:
    """The one JSON document ``out`` holds (fails on anything else: a stray line, none)."""
    assert out.endswith("\n") and out.count("\n") == 1, f"not one line on stdout: {out!r}"
    return json.loads(out)


def _instead_of_simulate(monkeypatch: pytest.MonkeyPatch, command) -> None:
    """``piper simulate`` runs ``command`` (its real parser, a stand-in body)."""
    monkeypatch.setattr(cli, "_command", lambda name: command)


def test_a_successful_command_adds_its_outcome(capfd):
    assert main(["simulate", "--pp", "2", "--microbatches", "2", "--json"]) == 0
    doc = one_document(capfd.readouterr().out)
    assert doc["command"] == "simulate" and doc["makespan"] > 0
    assert (doc["ok"], doc["exit_code"], doc["error"]) == (True, 0, None)


@pytest.mark.parametrize(("argv", "message"), [
    (["simulate", "--json", "--pp", "x"], "piper simulate: error: argument --pp: invalid int value: 'x'"),
    (["train", "--json", "--timeout", "0"], "piper train: error: --timeout must be > 0"),
    (["--json"], "piper: error: the following arguments are required: command"),
])
def test_a_usage_error_gets_a_document(capfd, argv, message):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    out, err = capfd.readouterr()
    doc = one_document(out)
    assert (doc["ok"], doc["exit_code"]) == (False, 2)
    assert doc["error"].startswith(message) and f"\n{doc['error']}\n" in err  # argparse's own line


def test_bad_input_found_by_the_command_gets_a_document(capfd):
    assert main(["simulate", "--pp", "1000", "--microbatches", "1000000", "--json"]) == 2
    out, err = capfd.readouterr()
    doc = one_document(out)
    assert doc["exit_code"] == 2 and doc["error"].startswith("piper simulate: error: the pipeline is too large")
    assert doc["error"] in err


def test_what_else_reaches_stdout_goes_to_stderr(capfd, monkeypatch):
    """Ray's driver prints a worker's death on ``sys.stdout`` from a thread of its own; native
    code and child processes write on file descriptor 1."""

    def command(args: argparse.Namespace) -> int:
        thread = threading.Thread(target=print, args=("(raylet) A worker died or was killed",))
        thread.start()
        thread.join()
        os.write(1, b"native write\n")
        subprocess.run([sys.executable, "-c", "print('child process')"], check=True)
        emit(args, {"command": "simulate", "makespan": 1.0})
        return 0

    _instead_of_simulate(monkeypatch, command)
    assert main(["simulate", "--json"]) == 0
    out, err = capfd.readouterr()
    assert one_document(out)["makespan"] == 1.0
    for stray in ("(raylet) A worker died", "native write", "child process"):
        assert stray in err
    assert sys.stdout is not sys.stderr  # put back


@pytest.mark.parametrize(("error", "code", "message"), [
    (ExecutionError(f"step 2: rank 1 raised: {RAY_TRACEBACK}"), 3, "piper simulate: run failed: step 2: rank 1"),
    (KeyboardInterrupt(), 130, "piper simulate: interrupted"),
    (stopping.Terminated(), 143, "piper simulate: terminated (SIGTERM)"),
], ids=["run failed", "Ctrl-C", "SIGTERM"])
def test_a_failed_run_leaves_its_partial_document(capfd, monkeypatch, error, code, message):
    def command(args: argparse.Namespace) -> int:
        emit(args, {"command": "simulate", "steps": 1, "losses": [2.5]})  # the steps done before it failed
        if isinstance(error, stopping.Terminated):
            monkeypatch.setattr(stopping, "terminating", lambda: True)
        raise error

    _instead_of_simulate(monkeypatch, command)
    assert main(["simulate", "--json"]) == code
    out, err = capfd.readouterr()
    doc = one_document(out)
    assert (doc["ok"], doc["exit_code"], doc["steps"], doc["losses"]) == (False, code, 1, [2.5])
    assert doc["error"].startswith(message) and message in err
    assert "\x1b" not in doc["error"] and "\x1b" not in err  # stderr is no terminal here
    if code == 3:
        assert "ray::RankWorker.run_steps() (pid=4242, ip=127.0.0.1)\n  boom" in doc["error"]


def test_a_bug_leaves_a_document_and_its_traceback(capfd, monkeypatch):
    def command(args: argparse.Namespace) -> int:
        raise RuntimeError("a bug")

    _instead_of_simulate(monkeypatch, command)
    with pytest.raises(RuntimeError, match="a bug"):
        main(["simulate", "--json"])
    doc = one_document(capfd.readouterr().out)
    assert (doc["exit_code"], doc["error"]) == (1, "piper simulate: RuntimeError: a bug")


def test_without_json_nothing_changes(capfd, monkeypatch):
    def command(args: argparse.Namespace) -> int:
        raise ExecutionError(RAY_TRACEBACK)

    _instead_of_simulate(monkeypatch, command)
    assert main(["simulate"]) == 3
    out, err = capfd.readouterr()
    assert out == "" and err == "piper simulate: run failed: ray::RankWorker.run_steps() (pid=4242, ip=127.0.0.1)\n  boom\n"


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_colour_codes_reach_a_terminal_only():
    assert readable(RAY_TRACEBACK, _Terminal()) == RAY_TRACEBACK
    assert readable(RAY_TRACEBACK, io.StringIO()) == strip_ansi(RAY_TRACEBACK)
    assert strip_ansi("\x1b]0;title\x07a\x1b[1;31mb\x1b[0mc\x1bMd") == "abcd"
