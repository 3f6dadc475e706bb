"""Job files (``piper train --config job.toml|job.yaml``, ``--print-config``; piper_train.cli.jobs):
what they hold, how the command line overrides them, what is refused and how it is named. No
run here (``--print-config`` runs nothing); the runs: integration/test_jobs.py."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from piper_directives import Strategy, build_schedule
from piper_train.cli import jobs, main
from piper_train.cli.options import SUBCOMMANDS, build_parser, check_args
from piper_train.cli.request import StrategyRequest, model_regions


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``piper ARGV`` in this process: exit code, stdout, stderr."""
    capsys.readouterr()
    try:
        code = main(list(argv))
    except SystemExit as exit_:
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err


def parsed(*argv: str) -> argparse.Namespace:
    """The options ``piper ARGV`` runs with (a job file's, then the flags')."""
    parser = build_parser()
    args = parser.parse_args(list(argv))
    if args.config is not None:
        args = jobs.apply(parser, args, list(argv))
    check_args(parser, args)
    return args


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


BASE = ("--model", "mlp", "--pp", "2", "--microbatches", "2", "--runtime", "local")


@pytest.mark.parametrize("kind", ["toml", "yaml"])
def test_print_config_round_trips(tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str) -> None:
    (tmp_path / "ck").mkdir()
    argv = ["train", *BASE, "--dp", "2", "--zero", "1", "--lr", "1e-05", "--recompute", "all", "--steps", "3",
            "--lr-schedule", "cosine", "--warmup-steps", "1", "--clip-grad-norm", "0.5", "--wandb", "proj/run",
            "--metrics", str(tmp_path / "m.jsonl"), "--checkpoint-dir", str(tmp_path / "ck"), "--resume",
            "--steps-per-call", "2", "--on-nan", "continue", "--timeout", "12.5", "--memory-budget-mb", "100"]
    code, printed, _ = run(capsys, *argv, "--print-config", kind)
    assert code == 0
    job = write(tmp_path, f"job.{kind}", printed)
    code, again, _ = run(capsys, "train", "--config", str(job), "--print-config", kind)
    assert code == 0 and again == printed
    assert vars(parsed("train", "--config", str(job))) | {"config": None, "subparser": None} == \
        vars(parsed(*argv)) | {"subparser": None}
    config = jobs.effective(parsed(*argv))
    assert config["lr"] == 1e-05 and config["recompute"] == "all" and config["resume"] is True
    assert config["steps_per_call"] == 2 and "lr_step_size" not in config  # unset: left out


def test_the_command_line_overrides_the_file(tmp_path: Path) -> None:
    job = write(tmp_path, "job.toml", 'model = "mlp"\npp = 2\nlr = 0.01\nschedule = "gpipe"\nlog_grad_norm = true\n')
    args = parsed("train", "--config", str(job), "--lr", "0.02", "--pp", "4")
    assert (args.model, args.pp, args.lr, args.schedule, args.log_grad_norm) == ("mlp", 4, 0.02, "gpipe", True)
    args = parsed("train", "--lr", "0.02", "--config", str(job))  # wherever --config stands
    assert (args.lr, args.pp) == (0.02, 2)


def test_print_config_with_json_is_the_documents_config(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    job = write(tmp_path, "job.yaml", "model: mlp\nlr: 0.25\n")
    assert main(["check", "--config", str(job), "--print-config", "--json", "--steps", "2"]) == 0
    out = capfd.readouterr().out
    assert out.count("\n") == 1
    doc = json.loads(out)
    assert doc["ok"] and doc["command"] == "check"
    assert doc["config"]["lr"] == 0.25 and doc["config"]["steps"] == 2 and doc["config"]["model"] == "mlp"


@pytest.mark.parametrize(("text", "message"), [
    ('model = "mlp"\n\nlrr = 0.1\n', "job.toml:3: unknown key 'lrr' (did you mean 'lr'?)"),
    ("batch-size = 8\n", "job.toml:1: unknown key 'batch-size' (did you mean 'batch_size'? keys are the long "
                         "options' names in snake_case)"),
    ('model = "mlp"\n[optimizer_settings]\nlr = 1\n', "job.toml:2: unknown key 'optimizer_settings'"),
    ('pp = "two"\n', "job.toml:1: pp must be an integer, got the string 'two'"),
    ("pp = 2.0\n", "job.toml:1: pp must be an integer, got the number 2.0"),
    ("lr = true\n", "job.toml:1: lr must be a number, got true"),
    ("timeout = nan\n", "job.toml:1: timeout: expected a finite number, got 'nan'"),
    ("zero = 5\n", "job.toml:1: zero must be one of 0, 1, 2, 3; got 5"),
    ('schedule = "zb"\n', "job.toml:1: schedule must be one of "),
    ('resume = "yes"\n', "job.toml:1: resume must be true or false, got the string 'yes'"),
    ('recompute = "some"\n', "job.toml:1: recompute: expected none, all or a region interval N >= 1; got 'some'"),
    ("strategy = 3\n", "job.toml:1: strategy must be a string (a file) or a table (the program), got the number 3"),
    ("json = true\n", "job.toml:1: 'json' decides what stdout holds"),
    ("pp = 0\n", "job.toml:1: pp must be >= 1, got 0"),  # the command line's bounds (options.MINIMUMS)
    ("timeout = 1e300\n", "job.toml:1: timeout must be <= "),
    ("lr_schedule = \"step\"\n", "--lr-schedule step needs --lr-step-size"),  # and check_args on the whole
    ('[strategy]\ndirectives = []\nfoo = 1\n', "job.toml:1 [strategy]: unknown key 'foo'"),
    ("pp = \n", "job.toml:1: not valid TOML: Invalid value"),
    ('[strategy]\ndirectives = [{op = "splt"}]\n',
     "job.toml:1 [strategy]#0: unknown op 'splt'"),
])
def test_a_bad_toml_file_is_bad_input_naming_line_and_key(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                         text: str, message: str) -> None:
    job = write(tmp_path, "job.toml", text)
    code, out, err = run(capsys, "train", "--config", str(job))
    assert code == 2 and out == ""
    assert "piper train: error: " in err and message in err.replace(str(tmp_path) + "/", "")


@pytest.mark.parametrize(("text", "message"), [
    ("model: mlp\nlrr: 0.1\n", "job.yaml:2: unknown key 'lrr' (did you mean 'lr'?)"),
    ("lr: 1e-3\n", "job.yaml:1: lr must be a number, got the string '1e-3' (YAML 1.1 reads 1e-3 as a string; write "
                   "it with a point: 1.0e-3)"),
    ("pp: [2]\n", "job.yaml:1: pp must be an integer, got a list"),
    ("pp: 2\npp: 3\n", "job.yaml:2: duplicate key 'pp' (first at line 1)"),
    ("- pp\n", "job.yaml: a job file is a table of options (key = value), got a list"),
    ("pp: [\n", "job.yaml:2: not valid YAML"),
    ("model: mlp\nseed: !!python/object/apply:os.system ['touch HACKED']\n",
     "job.yaml:2: the tag 'tag:yaml.org,2002:python/object/apply:os.system' is refused: a job file is data"),
    ("!!python/object:argparse.Namespace {pp: 2}\n", "job.yaml:1: the tag 'tag:yaml.org,2002:python/object:"),
])
def test_a_bad_yaml_file_is_bad_input_naming_line_and_key(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch, text: str,
                                                         message: str) -> None:
    monkeypatch.chdir(tmp_path)
    job = write(tmp_path, "job.yaml", text)
    code, out, err = run(capsys, "train", "--config", job.name)
    assert code == 2 and out == ""
    assert message in err
    assert not (tmp_path / "HACKED").exists()


def test_a_bad_file_with_json_is_one_document(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    job = write(tmp_path, "job.toml", "lrr = 1\n")
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--json", "--config", str(job)])
    assert exit_.value.code == 2
    out = capfd.readouterr().out
    assert out.count("\n") == 1
    doc = json.loads(out)
    assert doc["exit_code"] == 2 and doc["error"].endswith(f"{job}:1: unknown key 'lrr' (did you mean 'lr'?)")


@pytest.mark.parametrize(("name", "message"), [("job.ini", "a job file is .toml, .yaml or .yml"),
                                               ("missing.toml", "cannot read")])
def test_a_file_that_is_not_a_job_file(tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str,
                                       message: str) -> None:
    if name != "missing.toml":
        write(tmp_path, name, "pp = 2\n")
    code, _, err = run(capsys, "train", "--config", str(tmp_path / name))
    assert code == 2 and message in err


def test_one_job_file_serves_train_and_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job = write(tmp_path, "job.toml", 'model = "mlp"\nsteps = 2\neval_every = 5\ncheckpoint_every = 1\n')
    args = parsed("check", "--config", str(job))
    assert (args.model, args.steps) == ("mlp", 2) and not hasattr(args, "eval_every")
    code, out, err = run(capsys, "check", "--config", str(job), "--print-config")
    assert code == 0 and "steps = 2" in out and "eval_every" not in out
    assert f"{job}:3: 'eval_every' is an option of piper train, not of piper check; ignored" in err


def test_a_strategy_embedded_or_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    program = build_schedule("gpipe", 2, 2)
    named = write(tmp_path, "s.json", program.to_json())
    table = json.loads(program.to_json())
    embedded = write(tmp_path, "job.yaml", json.dumps({"model": "mlp", "strategy": table}))  # JSON is YAML
    referenced = write(tmp_path, "job.toml", f'model = "mlp"\nstrategy = "{named}"\n')
    for job in (embedded, referenced):
        args = parsed("train", "--config", str(job))
        request = StrategyRequest.from_args(args)
        assert request.program == Strategy.from_json(program.to_json()) and model_regions(args) == 2
    args = parsed("train", "--config", str(embedded))
    assert str(args.strategy) == f"{embedded}:1 [strategy]"  # how messages name it
    # the printed config embeds it again, and reads back
    code, printed, _ = run(capsys, "train", "--config", str(embedded), "--print-config")
    assert code == 0 and "[[strategy.directives]]" in printed
    again = write(tmp_path, "again.toml", printed)
    assert parsed("train", "--config", str(again)).strategy == args.strategy
    # the command line's --strategy replaces the file's
    assert parsed("train", "--config", str(embedded), "--strategy", str(named)).strategy == named


@pytest.mark.parametrize("command", jobs.COMMANDS)
def test_the_schema_is_the_parsers_options(command: str) -> None:
    """A job file's keys are the command's options, none added, none left out but the
    command line's own; --print-config writes every one that has a value."""
    parser = argparse.ArgumentParser()
    for add in SUBCOMMANDS[command][1]:
        add(parser)
    options = jobs.options_of(parser)
    assert set(jobs.NOT_IN_FILES) <= set(options)
    args = parsed(command, "--runtime", "local")
    unset = {key for key in options if getattr(args, key) is None}
    assert set(jobs.effective(args)) == set(options) - set(jobs.NOT_IN_FILES) - unset
    assert {"model", "pp", "lr_schedule", "timeout", "optimizer_impl"} <= set(options) - unset


def test_a_job_file_gives_trainer_the_objects_the_command_line_does(tmp_path: Path) -> None:
    """``jobs.load`` and ``training.trainer_options``: what a program building its own
    ``Trainer`` takes from a job file, the very objects ``piper train`` hands it."""
    from piper_runtime import OptimizerSpec
    from piper_train.cli.training import trainer_options
    from piper_train.schedule import LRSchedule

    job = write(tmp_path, "job.toml", 'model = "mlp"\noptimizer = "sgd"\nlr = 0.1\nweight_decay = 0.01\n'
                                      'lr_schedule = "cosine"\nsteps = 10\nwarmup_steps = 2\ntimeout = 30\n'
                                      'clip_grad_norm = 1.0\nruntime = "local"\n')
    args = jobs.load(job)
    options = trainer_options(args, args.steps)
    assert options == trainer_options(parsed(
        "train", "--model", "mlp", "--optimizer", "sgd", "--lr", "0.1", "--weight-decay", "0.01", "--lr-schedule",
        "cosine", "--steps", "10", "--warmup-steps", "2", "--timeout", "30", "--clip-grad-norm", "1", "--runtime",
        "local"), 10)
    assert options["optimizer"] == OptimizerSpec("sgd", 0.1, weight_decay=0.01)
    assert options["lr_schedule"] == LRSchedule("cosine", 2, 10, 0.0, None, 0.1)
    assert options["options"].faults.timeout_s == 30 and options["clip_grad_norm"] == 1.0
    assert jobs.load(job, flags=["--lr", "0.2"]).lr == 0.2
    with pytest.raises(jobs.JobError, match=r"job\.toml:1: unknown key 'lrr'"):
        jobs.load(write(tmp_path, "job.toml", "lrr = 1\n"))
    with pytest.raises(jobs.JobError, match="--lr-schedule step needs --lr-step-size"):
        jobs.load(write(tmp_path, "job.toml", 'lr_schedule = "step"\n'))
