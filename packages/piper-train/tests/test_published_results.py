"""Published training results against the analytic planner (docs/published-results.md): the
doc's table is what ``benchmarks/bench_published.py`` prints from the planner today, every row
names a cited source, and each calibrated hardware file is the fit on its family's one row."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _script():
    spec = importlib.util.spec_from_file_location("bench_published", ROOT / "benchmarks" / "bench_published.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench():
    return _script()


@pytest.fixture(scope="module")
def data(bench):
    return bench.load()


@pytest.fixture(scope="module")
def priced(bench, data):
    return bench.price_all(data, bench.DATA.parent)


def test_every_row_names_a_cited_source_and_a_layout_that_multiplies_out(data):
    sources, families = data["sources"], data["families"]
    assert len(data["rows"]) >= 10 and len({r["source"] for r in data["rows"]}) >= 2
    for source in sources.values():
        assert source["url"].startswith("https://") and source["title"] and source["read"]
    for row in data["rows"]:
        assert row["source"] in sources, row["id"]
        assert row["family"] in families, row["id"]
        assert row["published"]["value"] > 0 and row["published"]["metric"] in ("tflops_per_gpu", "tokens_per_s_per_gpu")
        assert row["tp"] * row["pp"] * row["dp"] * row["cp"] == row["gpus"], row["id"]
        assert row["global_batch"] % (row["dp"] * row["micro_batch"]) == 0, row["id"]
        assert row["precision"] == "bf16" and row["notes"], row["id"]
        assert (ROOT / "benchmarks" / "published" / row["model"] / "config.json").is_file(), row["id"]
    ids = {r["id"]: r for r in data["rows"]}
    for name, family in families.items():
        assert ids[family["calibrate_on"]]["family"] == name
        assert sum(r["family"] == name for r in data["rows"]) >= 2, name  # one fitted, at least one predicted


def test_the_doc_table_is_what_the_planner_predicts_today(bench, data, priced):
    """When the planner changes: ``.venv/bin/python benchmarks/bench_published.py --fit
    --update-doc`` (and the prose's count, below)."""
    text = bench.DOC.read_text(encoding="utf-8")
    shown = text[text.index(bench.BEGIN) + len(bench.BEGIN):text.index(bench.END)].strip()
    assert shown == (bench.table(priced, data) + "\n\n" + bench.summary(priced, data, bench.DATA.parent)).strip()


def test_each_calibrated_file_reproduces_its_row_and_is_the_base_scaled(bench, data, priced):
    """The fitted row's calibrated figure is its published one (the step scales exactly with
    the factor), and refitting gives the committed file's factor."""
    from piper_train.hardware import load_hardware

    factors = bench.factors(data, bench.DATA.parent)
    for p in priced:
        if p.calibration_row:
            assert p.calibrated == pytest.approx(p.published, rel=1e-6), p.row["id"]
            assert bench.fit(p.uncalibrated, p.row) == pytest.approx(factors[p.row["family"]][0], rel=1e-9)
        else:  # every other row: the same factor times its uncalibrated figure
            assert p.calibrated == pytest.approx(p.uncalibrated * factors[p.row["family"]][0], rel=1e-6), p.row["id"]
    for name, family in data["families"].items():
        base = load_hardware(bench.hardware_spec(bench.DATA.parent, family["base"]))
        cal = load_hardware(str(bench.DATA.parent / family["calibrated"]))
        k = factors[name][0]
        assert cal.memory_tb_per_s == pytest.approx(base.memory_tb_per_s * k)
        assert cal.inter_node_gb_per_s == pytest.approx(base.inter_node_gb_per_s * k)
        assert cal.planning("flop_efficiency") == base.planning("flop_efficiency")


def test_the_doc_counts_the_rows_within_tolerance(bench, data, priced):
    """The doc's prose states the same count the summary computes."""
    summary = bench.summary(priced, data, bench.DATA.parent)
    within, total = map(int, re.search(r"all families: (\d+) of (\d+)", summary).groups())
    text = bench.DOC.read_text(encoding="utf-8")
    prose = text[:text.index(bench.BEGIN)] + text[text.index(bench.END):]
    assert f"{within} of {total} predicted rows" in " ".join(prose.split())  # across a line break too


def test_a_faster_memory_never_slows_megatrons_177b_step(bench, data):
    """GPT 177B on 2,304 H100s (tp8 pp6): raising the memory efficiency from 0.7 to 1 must not
    lengthen the step. It did while ``Planner.bounds`` balanced the stages at tp=1 and priced
    them at tp 8 (docs/published-results.md, item 1): the balance moved a layer onto the last
    stage."""
    import attrs

    from piper_train.hardware import load_hardware

    row = next(r for r in data["rows"] if r["id"] == "megatron-gpt-177b")
    pricer = bench.Pricer(bench.DATA.parent)
    base = attrs.evolve(load_hardware("h100"), flop_efficiency=1.0)
    slower = pricer.plan(row, attrs.evolve(base, memory_efficiency=0.7)).step_seconds
    faster = pricer.plan(row, attrs.evolve(base, memory_efficiency=1.0)).step_seconds
    assert faster <= slower
