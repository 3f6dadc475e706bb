"""Chrome trace JSON and the Gantt PNG."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from piper_scheduler import CostModel, compile_program, plot_gantt, simulate, to_chrome_trace
from piper_scheduler.testing import pipeline_graph


@pytest.fixture(scope="module")
def timeline():
    return simulate(
        compile_program(pipeline_graph(3, 4, "1f1b")), CostModel(overrides={"loss": {"F": 0, "B": 0}})
    )


def test_chrome_trace_structure(timeline) -> None:
    trace = json.loads(json.dumps(to_chrome_trace(timeline)))
    events = trace["traceEvents"]
    names = {(e["pid"], e["args"]["name"]) for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {(0, "rank 0"), (1, "rank 1"), (2, "rank 2")}
    threads = {
        (e["pid"], e["tid"]): e["args"]["name"]
        for e in events
        if e["ph"] == "M" and e["name"] == "thread_name"
    }
    assert threads[(0, 0)] == "compute" and threads[(0, 1)] == "pp"
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == len(timeline.intervals)
    first = next(e for e in complete if e["args"]["id"] == "B.s1.mb0")
    iv = next(iv for iv in timeline.intervals if iv.instruction == "B.s1.mb0")
    assert (first["pid"], first["tid"], first["cat"], first["name"]) == (1, 0, "compute", "s1:B0")
    assert (first["ts"], first["dur"]) == (iv.start * 1000, 2000.0)
    assert first["args"]["microbatch"] == 0


def test_gantt_png_is_written(timeline, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = plot_gantt(timeline, tmp_path / "1f1b.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
