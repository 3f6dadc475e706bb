"""``piper simulate``, ``piper plan`` and ``piper show``, run in-process."""

import json
import subprocess
import sys

import pytest

from piper_train.cli import main, scheduling


def _json(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("pp", "m"), [(2, 4), (4, 6)])
def test_simulate_json_reports_the_published_bubble(capsys, schedule, pp, m):
    assert main(["simulate", "--schedule", schedule, "--pp", str(pp), "--microbatches", str(m),
                 "--cost", "F=1,B=2", "--json"]) == 0
    out = _json(capsys)
    assert out["makespan"] == m * 3 + (pp - 1) * 3
    assert out["idle"] == [(pp - 1) * 3.0] * pp and out["busy"] == [m * 3.0] * pp


def test_simulate_stages_and_segments(capsys):
    assert main(["simulate", "--pp", "2", "--stages", "4", "--segments-per-stage", "2", "--microbatches", "4",
                 "--cost", "F=1,B=2,loss=0", "--json"]) == 0
    out = _json(capsys)
    assert out["ranks"] == 2 and out["busy"] == [4 * 4 * 3.0] * 2


def test_simulate_writes_trace_and_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    trace, png = tmp_path / "t.json", tmp_path / "g.png"
    assert main(["simulate", "--pp", "2", "--microbatches", "2", "--trace", str(trace), "--png", str(png)]) == 0
    assert "makespan" in capsys.readouterr().out
    assert json.loads(trace.read_text())["traceEvents"] and png.read_bytes()[:4] == b"\x89PNG"


def test_bad_cost_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:  # argparse's: the type of --cost is CostModel.parse
        main(["simulate", "--cost", "F=x"])
    assert exit_.value.code == 2
    assert "argument --cost: expected KEY=NUMBER" in capsys.readouterr().err


def test_plan_then_show(tmp_path, capsys):
    out = tmp_path / "program.json"
    assert main(["plan", "--schedule", "1f1b", "--pp", "2", "--microbatches", "3", "--synthetic", "--out", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    assert main(["show", str(out), "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["makespan"] == 3 * 3 + 3
    assert main(["show", str(out)]) == 0
    text = capsys.readouterr().out
    assert "rank 0" in text and "s0:F0" in text and "verified" in text


def test_long_steps_of_a_plan_are_said_as_they_end(tmp_path, capsys, monkeypatch):
    out = tmp_path / "program.json"
    args = ["plan", "--schedule", "zb1p", "--pp", "2", "--microbatches", "4", "--synthetic", "--out", str(out)]
    monkeypatch.setattr(scheduling, "SAY_AFTER_S", 60.0)  # no step is long: nothing is said
    assert main(args) == 0
    quiet = capsys.readouterr()
    assert "took" not in quiet.err
    monkeypatch.setattr(scheduling, "SAY_AFTER_S", 0.0)  # every step counts as long
    assert main(args) == 0
    said = capsys.readouterr()
    steps = [line.split(" took ")[0] for line in said.err.splitlines()]
    assert steps == [
        *(f"plan: strategy phase {name!r}" for name in ("split", "recompute", "place", "shard", "context",
                                                        "replicate", "context records", "communication",
                                                        "split backward", "order", "validate")),
        "plan: memory plan",
        "plan: compile (with verify)",
        "plan: JSON of the program",
        f"plan: writing {out}",
    ], said.err
    untimed = [[line for line in text.splitlines() if not line.startswith("compiled ")] for text in (said.out, quiet.out)]
    assert untimed[0] == untimed[1] and len(untimed[0]) == len(said.out.splitlines()) - 1  # stdout as before
    assert main(["simulate", "--schedule", "1f1b", "--pp", "2", "--microbatches", "4", "--json"]) == 0
    simulated = capsys.readouterr()
    assert json.loads(simulated.out)["makespan"] > 0  # stdout stays JSON
    assert "simulate: compile (with verify) took" in simulated.err and "memory plan" not in simulated.err


def test_plan_captures_a_model(tmp_path, capsys):
    pytest.importorskip("torch")
    out = tmp_path / "mlp.json"
    assert main(["plan", "--model", "mlp", "--pp", "2", "--microbatches", "2", "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["show", str(out), "--json"]) == 0
    assert _json(capsys)["ranks"] == 2


def test_show_rejects_other_documents(tmp_path, capsys):
    bad = tmp_path / "x.json"
    bad.write_text("{}")
    assert main(["show", str(bad)]) == 2
    assert "error" in capsys.readouterr().err


def test_simulate_uses_the_schedules_default_stages(capsys):
    assert main(["simulate", "--schedule", "zb1p", "--pp", "4", "--microbatches", "8", "--cost", "F=1,B=2,W=1",
                 "--json"]) == 0
    assert _json(capsys)["idle"] == [3.0] * 4  # (PP-1)(F+B-2W)
    assert main(["simulate", "--schedule", "dualpipev", "--pp", "2", "--microbatches", "4", "--json"]) == 0
    out = _json(capsys)
    assert "stages=4" in out["description"] and out["ranks"] == 2


def test_plan_writes_a_torch_csv_that_simulate_and_plan_accept(tmp_path, capsys):
    csv_path, out = tmp_path / "i1f1b.csv", tmp_path / "p.json"
    assert main(["plan", "--schedule", "interleaved_1f1b", "--pp", "2", "--microbatches", "4", "--synthetic",
                 "--out", str(out), "--torch-csv", str(csv_path)]) == 0
    assert "wrote" in capsys.readouterr().out
    rows = csv_path.read_text().splitlines()
    assert rows[0].startswith("0F0,0F1,2F0,2F1,0F2,2B0") and rows[1].startswith("1F0,1F1,3F0,3B0")
    assert main(["show", str(out), "--json"]) == 0
    from_schedule = _json(capsys)
    # pp, stages and microbatches come from the file (the defaults 2 / 4 would not fit)
    assert main(["simulate", "--strategy", str(csv_path), "--pp", "3", "--microbatches", "1", "--json"]) == 0
    from_csv = _json(capsys)
    assert "stages=4 microbatches=4" in from_csv["description"]
    assert from_csv["makespan"] == from_schedule["makespan"] and from_csv["idle"] == from_schedule["idle"]
    out2 = tmp_path / "q.json"
    assert main(["plan", "--strategy", str(csv_path), "--synthetic", "--out", str(out2)]) == 0
    capsys.readouterr()
    assert out2.read_text() == out.read_text()


def test_simulate_accepts_dualpipev_from_torch_csv_with_more_regions(tmp_path, capsys):
    csv_path = tmp_path / "dpv.csv"
    assert main(["plan", "--schedule", "dualpipev", "--pp", "2", "--microbatches", "4", "--synthetic",
                 "--out", str(tmp_path / "p.json"), "--torch-csv", str(csv_path)]) == 0
    assert "OVERLAP_F_B" in csv_path.read_text()
    capsys.readouterr()
    assert main(["simulate", "--strategy", str(csv_path), "--stages", "8", "--json"]) == 0
    assert "stages=8" in _json(capsys)["description"]


def test_bad_torch_csv_is_a_usage_error(tmp_path, capsys):
    bad = tmp_path / "bad.csv"
    bad.write_text("0F0,0B0\n0F1,0B1\n")
    assert main(["simulate", "--strategy", str(bad)]) == 2
    assert "stage 0 is computed on ranks 0 and 1" in capsys.readouterr().err
    assert main(["simulate", "--strategy", str(tmp_path / "missing.csv")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_simulate_charges_overlapped_pairs_fb(capsys):
    args = ["simulate", "--schedule", "dualpipev", "--pp", "4", "--microbatches", "8", "--json", "--cost"]
    assert main([*args, "F=1,B=2,W=1"]) == 0
    plain = _json(capsys)
    assert main([*args, "F=1,B=2,W=1,FB=2"]) == 0
    fused = _json(capsys)
    assert fused["makespan"] < plain["makespan"]
    assert max(fused["idle"]) == 3.0  # (PP/2-1)(F&B+B-3W) with PP = 8 stages, F&B = B = 2


def test_scheduling_commands_import_neither_torch_nor_ray(tmp_path):
    """simulate, show and a synthetic plan run no processes: they leave torch and ray unimported."""
    out = tmp_path / "p.json"
    code = (
        "import sys\n"
        "from piper_train.cli import main\n"
        f"assert main(['plan', '--synthetic', '--out', {str(out)!r}]) == 0\n"
        f"assert main(['show', {str(out)!r}, '--json']) == 0\n"
        "assert main(['simulate', '--schedule', 'zb1p', '--json']) == 0\n"
        "print(sorted(m for m in ('torch', 'ray') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "[]"


@pytest.mark.parametrize(("command", "args", "option"), [
    ("simulate", ["--microbatches", "10000000"], "10000000 microbatches (--microbatches)"),
    ("simulate", ["--pp", "200000"], "200000 stages (--stages/--pp)"),
    ("simulate", ["--pp", "4", "--segments-per-stage", "100000"], "100000 segments per stage (--segments-per-stage)"),
    ("plan", ["--microbatches", "10000000", "--out", "never.json"], "10000000 microbatches (--microbatches)"),
])
def test_huge_sizes_are_refused_before_anything_is_built(capsys, command, args, option):
    """Bounded work: exit 2 at once (nothing is built: this would take minutes and GBs)."""
    assert main([command, *args]) == 2
    err = capsys.readouterr().err
    assert f"the pipeline is too large to {command}" in err and option in err and "the limit is 100,000" in err


def test_a_strategy_file_with_a_huge_split_is_refused(tmp_path, capsys):
    strategy = tmp_path / "s.json"
    strategy.write_text(json.dumps({"directives": [
        {"op": "split", "microbatches": 1000000},
        {"op": "place", "filter": {"PP": 0}, "devices": [0]},
    ]}))
    assert main(["simulate", "--strategy", str(strategy)]) == 2
    assert "1000000 microbatches" in capsys.readouterr().err


# -- bad input: exit code 2, the culprit named, no traceback ----------------------------------


def _refused(capsys, *argv: str) -> str:
    assert main(list(argv)) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return err


def test_a_deeply_nested_strategy_file_is_refused_naming_it(tmp_path, capsys):
    deep = tmp_path / "deep.json"
    deep.write_text('{"directives": ' + "[" * 100000 + "]" * 100000 + "}")
    err = _refused(capsys, "simulate", "--strategy", str(deep))
    assert f"{deep}: JSON nested too deeply to read" in err


def test_a_strategy_file_that_is_not_utf8_is_refused_naming_it(tmp_path, capsys):
    binary = tmp_path / "s.json"
    binary.write_bytes(b"\xff\xfe\x00 not text")
    err = _refused(capsys, "simulate", "--strategy", str(binary))
    assert f"--strategy {binary} is not UTF-8 text (byte 0" in err


def test_place_on_a_device_beyond_the_others_names_the_directive_and_its_index(tmp_path, capsys):
    strategy = tmp_path / "s.json"
    strategy.write_text(json.dumps({"directives": [
        {"op": "split", "microbatches": 2},
        {"op": "place", "filter": {"PP": 0}, "devices": [0]},
        {"op": "place", "filter": {"PP": 1}, "devices": [99]},
    ]}))
    err = _refused(capsys, "simulate", "--strategy", str(strategy))
    assert "this Place names device 99, but devices 1..98 hold no region" in err
    assert f"directive: Place({{PP: 1}}, devices=[99], stream='pp') at {strategy}#2" in err


@pytest.mark.parametrize("count", [-1, 0])
def test_a_bad_split_count_in_a_strategy_file_blames_the_split(tmp_path, capsys, count):
    strategy = tmp_path / "s.json"
    strategy.write_text(json.dumps({"directives": [
        {"op": "split", "microbatches": count}, {"op": "place", "filter": {"PP": 0}, "devices": [0]},
    ]}))
    err = _refused(capsys, "simulate", "--strategy", str(strategy))
    assert f"microbatches must be a positive int, got {count}" in err
    assert f"directive: Split(microbatches={count}) at {strategy}#0" in err and "synthetic_graph" not in err


def test_a_model_file_with_a_syntax_error_is_refused_naming_file_and_line(tmp_path, capsys):
    model = tmp_path / "broken.py"
    model.write_text("import torch\n\ndef make(:\n    pass\n")
    err = _refused(capsys, "plan", "--model", f"{model}:make", "--out", str(tmp_path / "p.json"))
    assert f"running {model} failed: SyntaxError at {model}:3: invalid syntax" in err


def test_a_factory_that_raises_is_refused_naming_file_and_line(tmp_path, capsys):
    model = tmp_path / "raising.py"
    model.write_text("def make():\n    return helper()\n\ndef helper():\n    raise RuntimeError('no data here')\n")
    err = _refused(capsys, "plan", "--model", f"{model}:make", "--out", str(tmp_path / "p.json"))
    assert "the factory make() raised RuntimeError: no data here" in err
    assert f"(at {model}:5 in helper)" in err


@pytest.mark.parametrize("command", ["train", "check", "plan"])
def test_help_says_that_a_model_file_is_executed(capsys, command):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    assert "A file is EXECUTED" in " ".join(capsys.readouterr().out.split())


def test_version_names_every_package_and_the_torch_and_ray_in_use(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"piper {version('piper-train')} (") and out.count("\n") == 1
    for name in ("piper-ir", "piper-directives", "piper-scheduler", "piper-memory", "piper-runtime", "torch", "ray"):
        assert f"{name} {version(name)}" in out


def test_a_split_backward_costs_the_same_however_it_is_spelled(capsys) -> None:
    """B=3 with W=1 is BI=2 with W=1: ``--cost`` goes through ``CostModel.parse`` (before,
    the command's own parser never derived BI and simulated 38 instead of 49)."""
    spans = []
    for cost in ("F=2,B=3,W=1", "F=2,BI=2,W=1", "F=2,B=3,BW=1"):
        assert main(["simulate", "--schedule", "zb1p", "--pp", "4", "--microbatches", "8", "--cost", cost,
                     "--json"]) == 0
        spans.append(json.loads(capsys.readouterr().out)["makespan"])
    assert spans == [49, 49, 49]
