"""A ``--model`` file that is not Python text, or not valid Python, is refused naming the file
(and the line), before it runs: exit code 2 from the command, no traceback."""

from __future__ import annotations

import pytest

from piper_train.cli import main
from piper_train.workload import load_factory

BAD = {
    "binary": (bytes(range(256)), r"binary\.py is not Python source: a NUL byte at line 1 \(a binary file\?\)"),
    "latin": (b'x = 1\nname = "caf\xe9"\n', r"latin\.py is not utf-8 text: byte 0xe9 at line 2 cannot be decoded"),
    "cookie": (b"# -*- coding: klingon -*-\nx = 1\n", r"cookie\.py: unknown encoding: klingon"),
    "syntax": (b"def f():\n    return (1,\n", r"SyntaxError at .*syntax\.py:2: '\(' was never closed"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_file_that_is_not_python_is_named(name, tmp_path, capsys) -> None:
    content, message = BAD[name]
    path = tmp_path / f"{name}.py"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=message):
        load_factory(f"{path}:f")
    assert main(["plan", "--model", f"{path}:f", "--out", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"piper plan: error: model '{path}:f': ") and str(path) in err and "Traceback" not in err


def test_a_file_that_declares_its_encoding_runs(tmp_path) -> None:
    path = tmp_path / "declared.py"
    path.write_bytes(b'# -*- coding: latin-1 -*-\nNAME = "caf\xe9"\ndef f():\n    raise RuntimeError(NAME)\n')
    with pytest.raises(ValueError, match="the factory f\\(\\) raised RuntimeError: caf\u00e9"):
        load_factory(f"{path}:f")


def test_a_strategy_file_that_is_not_utf8_is_named(tmp_path, capsys) -> None:
    """``plan --model`` without ``--stages`` reads the strategy first to count its regions."""
    path = tmp_path / "s.json"
    path.write_bytes(b'{"directives": ["\xff"]}')
    assert main(["plan", "--model", "mlp", "--strategy", str(path), "--out", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err
    assert f"--strategy {path} is not UTF-8 text" in err and "Traceback" not in err
