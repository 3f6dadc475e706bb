"""``piper tune`` end to end on a tiny model: the ranking it prints, the program it writes
and ``piper train --strategy`` runs, the cache that makes a second run measure nothing, a
memory budget that moves the pick to a higher ZeRO level or to recomputation (and the run
fits it), and the bad inputs (a budget nothing fits, more devices than Ray has) with exit
code 2.

The link is given (``--latency-us``/``--bandwidth-mbs``) so no ping-pong runs; the model is
the 2-region MLP, whose regions hold no Linear pair or expert module, so only pipeline and
data parallelism are profiled (one rank per profiling run)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import ray

from piper_directives import Strategy
from piper_runtime import OptimizerSpec
from piper_train.cli import main
from piper_train.tuning.api import tune

pytestmark = pytest.mark.usefixtures("ray_cluster")

TINY = ["--model", "mlp", "--devices", "2", "--stages", "2", "--microbatch-range", "1-2", "--schedules",
        "1f1b,gpipe", "--latency-us", "50", "--bandwidth-mbs", "1000", "--profile-steps", "2",
        "--no-progress-bar"]


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    try:
        code = main(list(args))
    except SystemExit as exit_:
        code = exit_.code
    out, err = capsys.readouterr()
    assert "Traceback" not in err, err
    assert ray.is_initialized()
    return code, out, err


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tune-cache")


def test_tune_writes_a_program_piper_train_runs(cache: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    out_file = tmp_path / "best.json"
    code, out, err = _run(capsys, "tune", *TINY, "--cache-dir", str(cache), "--out", str(out_file), "--json",
                          "--validate", "1", "--validate-steps", "1")
    assert code == 0, err
    summary = json.loads(out)
    [validated] = summary["validation"]
    assert validated["strategy"] == summary["best"]["strategy"] and validated["measured_seconds"] > 0
    assert "predicted vs measured" not in err and "validation on the runtime" in err
    assert summary["command"] == "tune" and summary["space"] == len(summary["ranking"])
    fitting = [r for r in summary["ranking"] if r["status"] == "ok"]
    assert fitting and fitting[0] == summary["best"]
    predicted = [r["predicted_seconds"] for r in fitting]
    assert predicted == sorted(predicted)
    assert all(r["peak_bytes"] > 0 and 0 <= r["bubble_fraction"] <= 1 for r in fitting)
    assert "predicted ms" in err and "best:" in err  # the table goes to stderr with --json
    doc = json.loads(out_file.read_text())
    assert doc["tune"]["strategy"] == summary["best"]["strategy"]
    strategy = Strategy.from_json(out_file.read_text())
    assert strategy.directives  # the file is a directive program
    code, out, err = _run(capsys, "train", "--model", "mlp", "--strategy", str(out_file), "--steps", "2",
                          "--json", "--no-progress-bar")
    assert code == 0, err
    trained = json.loads(out)
    assert trained["steps"] == 2 and trained["microbatches"] == summary["best"]["microbatches"]


def test_second_run_measures_nothing(cache: Path) -> None:
    kw = dict(stages=2, microbatches=(1, 2), schedules=("1f1b", "gpipe"), comm=(5e-5, 1e9), profile_steps=2,
              cache_dir=cache)
    said: list[str] = []
    first = tune("mlp", 2, log=said.append, **kw)
    again = tune("mlp", 2, **kw)
    # No expert module: no expert-parallel candidate is tried (each would only be refused)
    assert any("expert parallelism left out" in line for line in said)
    assert all(e.candidate.ep == 1 for e in first.result.evaluations)
    assert again.profile_runs == 0
    assert again.profile == first.profile
    assert [e.candidate for e in again.result.fitting] == [e.candidate for e in first.result.fitting]


def test_budget_too_small_for_zero0_picks_higher_zero_and_fits(cache: Path) -> None:
    # AdamW: two moments per parameter, the state ZeRO shards (the pipeline held at one stage,
    # data parallelism only: a tensor-parallel layout would shrink the parameters themselves)
    kw = dict(stages=2, microbatches=(1, 2), schedules=("1f1b",), pps=(1,), kinds=(), comm=(5e-5, 1e9), profile_steps=2,
              cache_dir=cache, optimizer=OptimizerSpec("adamw", 1e-3))
    free = tune("mlp", 2, **kw)
    zero0 = min(e.peak_bytes for e in free.result.fitting if e.candidate.zero == 0)
    budget = zero0 - 1
    report = tune("mlp", 2, memory_budget_bytes=budget, **kw)
    best = report.best
    assert best is not None and best.candidate.zero > 0 and best.peak_bytes <= budget
    assert report.result.count("over budget") > 0
    from piper_train.models import build_model
    from piper_train.tuning.api import measure_step

    seconds, peaks = measure_step(build_model("mlp", stages=2), best.candidate, report.regions, steps=1, warmup=1,
                                  memory_budget_bytes=budget, optimizer=OptimizerSpec("adamw", 1e-3))
    assert seconds > 0 and max(peaks) <= budget  # measured on the runtime, not only estimated


def test_budget_below_every_strategy_without_recomputation_picks_recomputation_and_fits(cache: Path) -> None:
    """The pipeline's activations are what recomputation cuts: with the budget one byte under
    every candidate that keeps them, the pick recomputes, and the runtime, under that
    budget, measures a peak within it."""
    kw = dict(stages=2, microbatches=(2,), schedules=("gpipe",), pps=(2,), kinds=(), zeros=(0,), comm=(5e-5, 1e9),
              profile_steps=2, cache_dir=cache, optimizer=OptimizerSpec("sgd", 1e-3), recompute=(False, True))
    free = tune("lm", 2, **kw)
    kept = min(e.peak_bytes for e in free.result.fitting if not e.candidate.recompute)
    assert min(e.peak_bytes for e in free.result.fitting if e.candidate.recompute) < kept
    assert not free.best.candidate.recompute  # without a budget it only costs a forward
    report = tune("lm", 2, memory_budget_bytes=kept - 1, **kw)
    best = report.best
    assert best is not None and best.candidate.recompute and best.peak_bytes < kept
    from piper_train.models import build_model
    from piper_train.tuning.api import measure_step

    seconds, peaks = measure_step(build_model("lm", stages=2), best.candidate, report.regions, steps=1, warmup=1,
                                  memory_budget_bytes=kept - 1, optimizer=OptimizerSpec("sgd", 1e-3))
    assert seconds > 0 and max(peaks) <= kept - 1


def test_budget_nothing_fits_exits_2_with_the_smallest_requirement(cache: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, "tune", *TINY, "--cache-dir", str(cache), "--json", "--exhaustive")
    smallest = min(r["peak_bytes"] for r in json.loads(out)["ranking"] if r["peak_bytes"])
    code, out, err = _run(capsys, "tune", *TINY, "--cache-dir", str(cache), "--memory-budget-mb", "0.001")
    assert code == 2
    assert "no strategy fits the per-rank budget of 0.00 MiB" in err
    assert f"the smallest estimated requirement is {smallest / 2**20:.2f} MiB" in err


def test_more_devices_than_ray_has_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    cpus = int(ray.cluster_resources()["CPU"])
    code, _, err = _run(capsys, "tune", "--model", "mlp", "--devices", str(cpus + 1), "--no-progress-bar")
    assert code == 2
    assert f"--devices {cpus + 1}: the Ray cluster has {cpus} CPUs" in err


@pytest.mark.parametrize(("argv", "message"), [
    (["--microbatch-range", "4-2"], "--microbatch-range"),
    (["--schedules", "1f1b,nope"], "--schedules"),
    (["--latency-us", "5"], "give both or neither"),
    (["--devices", "0"], "--devices must be >= 1"),
])
def test_bad_options_exit_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["tune", "--model", "mlp", "--devices", "2", "--no-progress-bar"]
    if "--devices" in argv:
        args = ["tune", "--model", "mlp", "--no-progress-bar"]
    code, _, err = _run(capsys, *args, *argv)
    assert code == 2 and message in err
