"""The README's example runs as written (it documents the API, so it must stay true)."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_example_runs(capsys) -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README.md has no python example"
    exec(compile(blocks[0], str(README), "exec"), {})  # our own README
    assert capsys.readouterr().out == "['F.s0', 'F.loss', 'B.loss', 'B.s0']\n['B.s0']\n"
