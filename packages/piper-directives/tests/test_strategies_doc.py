"""docs/strategies.md stays true: its Python strategy and its JSON form are the same program,
and the program applies to a graph with two regions."""

from __future__ import annotations

import re
from pathlib import Path

from piper_directives import Strategy
from piper_directives.synthetic import synthetic_graph

DOC = Path(__file__).resolve().parents[3] / "docs" / "strategies.md"


def test_the_python_and_json_examples_are_one_program() -> None:
    text = DOC.read_text()
    (python, *_) = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    (doc, *_) = re.findall(r"```json\n(.*?)```", text, flags=re.S)
    namespace: dict = {}
    exec(compile(python, str(DOC), "exec"), namespace)  # our own documentation
    strategy = namespace["strategy"]
    assert Strategy.from_json(doc) == strategy
    assert Strategy.from_json(strategy.to_json()) == strategy
    placed = strategy.apply(synthetic_graph(2, 4, batch=2))
    assert placed.world_size == 4
    # the loss, on a group no Replicate names, is replicated with ZeRO-0
    assert {r.segment: r.zero for r in placed.replication} == {"s0": 1, "s1": 1, "loss": 0}
