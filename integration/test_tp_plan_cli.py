"""``--tp-plan`` (issue 37, item 2): a tensor-parallel plan by module path on the command line,
in a JSON file and in a job file (a table), checked against one device by ``piper check``;
its mistakes are usage errors (exit 2) naming the flag and the pair, or the pattern with the
module paths that exist."""

from __future__ import annotations

import json
from pathlib import Path

import tomli_w

from piper_directives import Shard, Strategy, tensor_parallel
from piper_train.cli.jobs import load
from piper_train.cli.tp_plan import tp_plan

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = f"{ROOT / 'examples' / 'llama' / 'model.py'}:tiny"
ATTENTION = {"layers.*.attention.wq": "colwise", "layers.*.attention.wk": "colwise",
             "layers.*.attention.wv": "colwise", "layers.*.attention.wo": "rowwise"}
VOCAB = {"tok_embeddings": "embedding_vocab", "output": "colwise_vocab"}
CHECK = ("check", "--model", EXAMPLE, "--pp", "1", "--stages", "4", "--tp", "2", "--microbatches", "2",
         "--steps", "2", "--precision", "fp64", "--runtime", "local", "--json")


def inline(plan: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in plan.items())


def test_the_three_spellings_read_the_same_plan(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(ATTENTION), encoding="utf-8")
    want = tuple(ATTENTION.items())
    assert tp_plan(inline(ATTENTION)) == tp_plan(str(path)) == tp_plan(json.dumps(ATTENTION)) == want


def test_a_strategy_file_round_trips_the_plan() -> None:
    from piper_directives import build_schedule

    strategy = tensor_parallel(build_schedule("1f1b", 2, 2, stages=4), 2, plan={**ATTENTION, **VOCAB})
    again = Strategy.from_json(strategy.to_json())
    assert [s.plan for s in again.of(Shard)] == [s.plan for s in strategy.of(Shard)]
    assert dict(again.of(Shard)[0].plan) == {**ATTENTION, **VOCAB}


def test_a_job_file_table_and_print_config(tmp_path: Path) -> None:
    job = tmp_path / "job.toml"
    job.write_text(tomli_w.dumps({"model": EXAMPLE, "tp": 2, "pp": 1, "tp_plan": {**ATTENTION, **VOCAB}}),
                   encoding="utf-8")
    args = load(job, "check")
    assert args.tp_plan == tuple({**ATTENTION, **VOCAB}.items())
    from piper_train.cli.jobs import effective

    assert effective(args)["tp_plan"] == {**ATTENTION, **VOCAB}  # --print-config writes the table back


def test_check_with_a_plan_on_the_command_line(piper) -> None:
    done = piper(*CHECK, "--tp-plan", inline({**ATTENTION, **VOCAB}))
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["ok"] is True


def test_usage_errors_name_the_flag_and_the_pair(piper, tmp_path: Path) -> None:
    done = piper(*CHECK, "--tp-plan", "layers.*.attention.wq=colwis")
    assert done.returncode == 2 and "--tp-plan" in done.stdout + done.stderr and "'colwis'" in done.stdout + done.stderr
    done = piper(*CHECK[:8], "1", *CHECK[9:], "--tp-plan", inline(ATTENTION))  # --tp 1
    assert done.returncode == 2 and "--tp 2 or more" in done.stdout + done.stderr
    done = piper(*CHECK, "--tp-plan", str(tmp_path / "missing.json"))
    assert done.returncode == 2 and "missing.json" in done.stdout + done.stderr


def test_a_pattern_that_names_no_module_lists_the_ones_there(piper) -> None:
    done = piper(*CHECK, "--tp-plan", "layers.*.attn.wq=colwise")
    assert done.returncode == 2
    error = json.loads(done.stdout)["error"]
    assert "'layers.*.attn.wq'" in error and "layers.*.attention.wq" in error and "--tp-plan" in error
