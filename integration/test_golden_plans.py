"""Golden plans: the compiled programs of the library's canonical schedules, checked in as text.

Each case builds a plan the way ``Trainer`` does, on a synthetic graph (no torch): the
schedule's strategy (``piper_directives``), memory planning (``piper_memory.plan_memory``),
then ``piper_scheduler.compile_program``; its listing (``piper_ir.format_listing``: the
communicators, then one instruction per line grouped by rank, labels in torch's action
notation) must equal ``golden/<case>.txt`` byte for byte. A failure names the first
differing line of every rank. After an intended change of the scheduler, rewrite the files
with ``PIPER_UPDATE_GOLDEN=1`` and review their diff::

    PIPER_UPDATE_GOLDEN=1 .venv/bin/python -m pytest -p no:cacheprovider --import-mode=importlib -q integration/test_golden_plans.py

The files also parse back into the very communicators and instructions (``parse_listing``),
and compiling a case twice, in this process or in others with other hash seeds, gives the
same JSON byte for byte.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import attrs
import pytest

from piper_directives import build_schedule, expert_parallel, one_f_one_b
from piper_directives.replicate import segment_buckets
from piper_directives.synthetic import synthetic_graph
from piper_ir import Graph, Listing, ParamShard, Program, ShardKind, format_listing, parse_listing, to_json
from piper_memory import plan_memory
from piper_scheduler import compile_program

GOLDEN = Path(__file__).parent / "golden"
UPDATE = os.environ.get("PIPER_UPDATE_GOLDEN") == "1"
HIDDEN = 4  # small metas keep the files short; the plan does not depend on sizes


def _with_experts(graph: Graph) -> Graph:
    """What ``shard_experts`` records torch-side for a model whose regions each call one
    expert module, here faked on the synthetic graph: each region's weight holds the experts
    (cut on dimension 0), each forward issues one dispatch/combine, and the buckets are
    rebuilt without the experts (``replicate.segment_buckets``, as ``expert_code`` does)."""
    sharding, buckets = [], [b for b in graph.buckets if b.segment not in {s.segment for s in graph.sharding}]
    replication = {r.segment: r for r in graph.replication}
    for sh in graph.sharding:
        if sh.kind is not ShardKind.EP or sh.segment not in replication:
            sharding.append(sh)
            continue
        expert = next(name for name, _ in graph.segment_by_id[sh.segment].params if name.endswith(".weight"))
        sh = attrs.evolve(sh, params=(ParamShard(expert, 0),), collectives=1)
        sharding.append(sh)
        buckets += segment_buckets(graph.segment_by_id[sh.segment], replication[sh.segment], sh, frozenset({expert}))
    order = {s.id: i for i, s in enumerate(graph.segments)}
    return attrs.evolve(graph, sharding=tuple(sharding), buckets=tuple(sorted(buckets, key=lambda b: order[b.segment])))


@attrs.frozen
class Case:
    name: str
    built: str  # how the plan is built, for the file's header
    build: Callable[[], Graph]  # the graph compile_program gets

    def program(self) -> Program:
        return compile_program(self.build())

    def text(self) -> str:
        comments = [
            f"golden plan {self.name}: {self.built}",
            "then plan_memory and compile_program; one instruction per line: label (torch's action notation)",
            "and key=value fields (piper_ir.text). Rewrite: PIPER_UPDATE_GOLDEN=1 pytest integration/test_golden_plans.py",
        ]
        return format_listing(self.program(), comments)


def _schedule(name: str, pp: int, mb: int, regions: int, **kw: int) -> Callable[[], Graph]:
    return lambda: plan_memory(
        build_schedule(name, pp, mb, stages=regions, **kw).apply(synthetic_graph(regions, mb, hidden=HIDDEN, batch=2))
    )


CASES = [
    Case("1f1b_pp2_mb4", 'build_schedule("1f1b", 2, 4) on synthetic_graph(2, 4)', _schedule("1f1b", 2, 4, 2)),
    Case(
        "interleaved_1f1b_pp2_mb4_s4",
        'build_schedule("interleaved_1f1b", 2, 4, stages=4) on synthetic_graph(4, 4)',
        _schedule("interleaved_1f1b", 2, 4, 4),
    ),
    Case("zb1p_pp2_mb4", 'build_schedule("zb1p", 2, 4) on synthetic_graph(2, 4)', _schedule("zb1p", 2, 4, 2)),
    Case("dualpipe_pp2_mb4", 'build_schedule("dualpipe", 2, 4) on synthetic_graph(2, 4)', _schedule("dualpipe", 2, 4, 2)),
    Case(
        "dualpipev_pp2_mb4",
        'build_schedule("dualpipev", 2, 4) on synthetic_graph(4, 4)',
        _schedule("dualpipev", 2, 4, 4),
    ),
    Case(
        "1f1b_pp2_mb4_dp2_zero3",
        'build_schedule("1f1b", 2, 4, dp=2, zero=3) on synthetic_graph(2, 4)',
        _schedule("1f1b", 2, 4, 2, dp=2, zero=3),
    ),
    Case(
        "1f1b_pp2_mb4_ep2",
        "expert_parallel(one_f_one_b(2, 4), 2) on synthetic_graph(2, 4), each region's weight its experts",
        lambda: plan_memory(_with_experts(expert_parallel(one_f_one_b(2, 4), 2).apply(
            synthetic_graph(2, 4, hidden=HIDDEN, batch=2)
        ))),
    ),
]
IDS = [c.name for c in CASES]


def _sections(text: str) -> dict[str, list[tuple[int, str]]]:
    """The file's lines (with line numbers) by section: the header (comments and
    communicators), then each ``rank <r>`` and its instructions."""
    out: dict[str, list[tuple[int, str]]] = {"header": []}
    current = "header"
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("rank "):
            current = line.split()[0] + " " + line.split()[1]
            out[current] = []
        out[current].append((number, line))
    return out


def first_differences(expected: str, actual: str) -> list[str]:
    """For each section that differs, its first differing line in both texts."""
    want, have = _sections(expected), _sections(actual)
    report = []
    for section in dict.fromkeys([*want, *have]):
        a, b = want.get(section, []), have.get(section, [])
        for k in range(max(len(a), len(b))):
            x = a[k] if k < len(a) else (None, "(nothing)")
            y = b[k] if k < len(b) else (None, "(nothing)")
            if x[1] != y[1]:
                report.append(
                    f"{section}, its line {k + 1}:\n"
                    f"  golden (line {x[0] or '-'}): {x[1].strip()}\n  compiled (line {y[0] or '-'}): {y[1].strip()}"
                )
                break
    return report


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_plan_matches_golden_file(case: Case) -> None:
    path = GOLDEN / f"{case.name}.txt"
    text = case.text()
    if UPDATE:
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    if not path.exists():
        pytest.fail(f"{path} is missing; write it with PIPER_UPDATE_GOLDEN=1", pytrace=False)
    golden = path.read_text()
    if golden != text:
        pytest.fail(
            f"the compiled plan differs from {path.name} (PIPER_UPDATE_GOLDEN=1 rewrites it):\n"
            + "\n".join(first_differences(golden, text)),
            pytrace=False,
        )


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_golden_file_parses_back_into_the_plan(case: Case) -> None:
    program = case.program()
    golden = parse_listing((GOLDEN / f"{case.name}.txt").read_text())
    assert golden == Listing.of(program)
    assert all(plan.instructions for plan in program.ranks)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_compiling_twice_gives_identical_json(case: Case) -> None:
    assert to_json(case.program()) == to_json(case.program())


DIGESTS = """
import hashlib, runpy, sys
from piper_ir import to_json
cases = runpy.run_path(sys.argv[1])["CASES"]
for case in cases:
    print(case.name, hashlib.sha256(to_json(case.program()).encode()).hexdigest())
"""


def test_compiling_in_other_processes_gives_identical_json() -> None:
    """Set iteration order changes with the hash seed between processes; no plan may."""
    here = "".join(f"{c.name} {hashlib.sha256(to_json(c.program()).encode()).hexdigest()}\n" for c in CASES)
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        proc = subprocess.run(
            [sys.executable, "-c", DIGESTS, __file__], capture_output=True, text=True, env=env, timeout=300
        )
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout == here, f"PYTHONHASHSEED={seed}"


def test_a_changed_plan_is_reported_by_rank_and_line() -> None:
    golden = CASES[0].text()
    lines = golden.splitlines(keepends=True)
    first_rank1 = next(i for i, line in enumerate(lines) if line.startswith("rank 1"))
    changed = lines[: first_rank1 + 2] + lines[first_rank1 + 3 :]  # drop rank 1's second instruction
    report = first_differences(golden, "".join(changed))
    assert len(report) == 1 and report[0].startswith("rank 1, its line 3:")
    assert f"golden (line {first_rank1 + 3})" in report[0]
