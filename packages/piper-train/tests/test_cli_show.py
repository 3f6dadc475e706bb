"""``piper show`` on files that are not a sound saved plan: exit 2 with one line naming the
file and what is wrong with it, never a traceback (issue 34)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import attrs
import pytest

from piper_ir import NodeKind, to_json
from piper_scheduler import compile_program
from piper_scheduler.testing import pipeline_graph
from piper_train.cli import main

PROGRAM = compile_program(pipeline_graph(2, 2, "1f1b"))


def _document(**changes: object) -> str:
    doc = json.loads(to_json(PROGRAM))
    doc["value"].update(changes)
    return json.dumps(doc)


def _without_key(key: str) -> str:
    doc = json.loads(to_json(PROGRAM))
    del doc["value"][key]
    return json.dumps(doc)


def _no_step() -> str:
    plan = PROGRAM.ranks[0]
    kept = [ins for ins in plan.instructions if ins.kind is not NodeKind.OPTIMIZER]
    return to_json(attrs.evolve(PROGRAM, ranks=(attrs.evolve(plan, instructions=kept), *PROGRAM.ranks[1:])))


CASES = [
    ("deep.json", lambda: "[" * 200_000 + "]" * 200_000, "nested too deeply"),
    ("deep-object.json", lambda: '{"format":' * 100_000 + "1" + "}" * 100_000, "nested too deeply"),
    ("latin1.json", lambda: _document().replace('"s0"', '"s\u00e9"', 1).encode("latin-1"), "not UTF-8 text"),
    ("garbage.bin", lambda: bytes(range(256)) * 4, "not"),
    ("types.json", lambda: _document(world_size="two"), "invalid Program document|expected int"),
    ("ranks.json", lambda: _document(ranks={"0": []}), "expected a list"),
    ("missing.json", lambda: _without_key("ranks"), "invalid Program document"),
    ("graph.json", lambda: to_json(pipeline_graph(2, 2)), "holds a Graph, not a Program"),
    ("no-step.json", _no_step, "does not verify: rank 0 stream 'compute' instruction 7 B.s0.mb1"),
]


@pytest.mark.parametrize(("name", "content", "message"), CASES, ids=[c[0] for c in CASES])
def test_a_file_that_is_not_a_sound_plan_exits_2_naming_it(tmp_path: Path, capsys, name, content, message) -> None:
    path = tmp_path / name
    data = content()
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
    assert main(["show", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"piper show: error: {path}"), err
    assert "Traceback" not in err and re.search(message, err), err


def test_an_unreadable_path_exits_2_naming_it(tmp_path: Path, capsys) -> None:
    assert main(["show", str(tmp_path)]) == 2
    assert f"piper show: error: cannot read {tmp_path}" in capsys.readouterr().err
