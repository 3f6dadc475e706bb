"""``--dp``, ``--zero``, ``--recompute`` and ``--memory-budget-mb`` of ``piper train`` / ``piper check`` (no Ray:
the budget fails at compile time, before any worker starts)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from piper_directives import Place, Recompute, Replicate, Shard, Strategy, one_f_one_b
from piper_ir import ShardKind
from piper_train.cli import StrategyRequest, main
from piper_train.cli.options import build_parser


def _request(*argv: str) -> StrategyRequest:
    """The request ``piper check ARGV`` makes."""
    return StrategyRequest.from_args(build_parser().parse_args(["check", *argv]))


def _file(tmp_path: Path, strategy: Strategy) -> str:
    path = tmp_path / "strategy.json"
    path.write_text(strategy.to_json())
    return str(path)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["check", "--zero", "2"], "--zero 2 with --dp 1: ZeRO-2 shards over data-parallel replicas"),
        (["train", "--dp", "0"], "--dp must be >= 1"),
        (["check", "--dp", "2", "--zero", "4"], "invalid choice: 4"),
        (["check", "--memory-budget-mb", "0"], "--memory-budget-mb must be > 0"),
    ],
)
def test_bad_flags(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as err:
        main(argv)
    assert err.value.code == 2
    assert message in capsys.readouterr().err


def test_dp_composes_with_a_schedule_and_a_strategy_file(tmp_path: Path) -> None:
    built = _request("--schedule", "1f1b", "--dp", "2", "--zero", "3").resolve(2)
    assert built == one_f_one_b(2, 4, stages=2, dp=2, zero=3)
    assert [d.devices for d in built.directives if isinstance(d, Place)] == [(0, 2), (1, 3)]
    assert [(d.devices, d.zero) for d in built.directives if isinstance(d, Replicate)] == [((0, 2), 3), ((1, 3), 3)]
    from_file = _request("--strategy", _file(tmp_path, one_f_one_b(2, 4)), "--dp", "2", "--zero", "3").for_trainer()
    assert from_file == built  # a JSON program is composed at once, not per model
    schedule = _request("--dp", "2").for_trainer()
    assert callable(schedule) and schedule(4) == one_f_one_b(2, 4, stages=4, dp=2)
    plain = StrategyRequest(program=one_f_one_b(2, 4))
    assert plain.for_trainer() is plain.program


def test_memory_budget_fails_at_compile_time(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "dp.json"
    path.write_text(json.dumps({"directives": [
        {"op": "split", "microbatches": 2},
        {"op": "place", "filter": {"PP": 0}, "devices": [0]},
    ]}))
    code = main(["check", "--model", "mlp", "--strategy", str(path), "--pp", "1", "--dp", "2", "--zero", "3",
                 "--memory-budget-mb", "0.001"])
    err = capsys.readouterr().err
    assert code == 2
    assert "exceeds the per-rank budget of 1048 B" in err
    assert "rank 0:" in err and "rank 1:" in err and "gathered parameters" in err


def test_tp_composes_with_a_schedule_and_a_strategy_file(tmp_path: Path) -> None:
    built = _request("--tp", "2").resolve(2)
    assert [d.devices for d in built.directives if isinstance(d, Place)] == [(0, 1), (2, 3)]
    assert [d.devices for d in built.directives if isinstance(d, Shard)] == [(0, 1), (2, 3)]
    from_file = _request("--strategy", _file(tmp_path, one_f_one_b(2, 4)), "--tp", "2").for_trainer()
    assert from_file == built


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["check", "--tp", "0"], "--tp must be >= 1"),
        (["train", "--tp", "2", "--zero", "1"], "--zero 1 with --dp 1: ZeRO-1 shards over data-parallel replicas"),
    ],
)
def test_bad_tp_flags(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as err:
        main(argv)
    assert err.value.code == 2
    assert message in capsys.readouterr().err


def test_ep_composes_with_a_schedule_and_a_strategy_file(tmp_path: Path) -> None:
    built = _request("--ep", "2").resolve(2)
    assert [d.devices for d in built.directives if isinstance(d, Place)] == [(0, 1), (2, 3)]
    assert [(d.devices, d.kind) for d in built.directives if isinstance(d, Shard)] == [
        ((0, 1), ShardKind.EP), ((2, 3), ShardKind.EP)
    ]
    from_file = _request("--strategy", _file(tmp_path, one_f_one_b(2, 4)), "--ep", "2").for_trainer()
    assert from_file == built


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["check", "--ep", "0"], "--ep must be >= 1"),
        (["train", "--ep", "2", "--tp", "2", "--sp"], "--sp with --ep (sequence parallelism with expert parallelism) "
                                                      "is not supported yet"),
        (["check", "--recompute", "all", "--tp", "2"], "--recompute with --tp or --ep: recomputing a tensor- or "
                                                       "expert-parallel region"),
        (["train", "--recompute", "0"], "expected none, all or a region interval N >= 1; got '0'"),
        (["train", "--recompute", "some"], "expected none, all or a region interval N >= 1; got 'some'"),
    ],
)
def test_bad_ep_flags(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as err:
        main(argv)
    assert err.value.code == 2
    assert message in capsys.readouterr().err


def test_tp_and_ep_compose_with_dp_and_zero() -> None:
    """--dp first (replica j of stage r on r + j * pp), then --tp/--ep widen every device d to
    d * k .. d * k + k - 1: the shard groups are adjacent, replicas of them further apart."""
    def built(**flags: int) -> Strategy:
        return _request(*(f"--{k}={v}" for k, v in flags.items())).resolve(2)

    tp = built(dp=2, zero=1, tp=2)
    assert [d.devices for d in tp.directives if isinstance(d, Place)] == [(0, 1, 4, 5), (2, 3, 6, 7)]
    assert [(d.devices, d.zero) for d in tp.directives if isinstance(d, Replicate)] == [
        ((0, 1, 4, 5), 1), ((2, 3, 6, 7), 1)
    ]
    assert {(d.kind, d.degree) for d in tp.directives if isinstance(d, Shard)} == {("tp", 2)}
    ep = built(dp=2, zero=2, ep=2)
    assert [(d.devices, d.kind, d.degree) for d in ep.directives if isinstance(d, Shard)] == [
        ((0, 1, 4, 5), "ep", 2), ((2, 3, 6, 7), "ep", 2)
    ]
    assert {d.zero for d in ep.directives if isinstance(d, Replicate)} == {2}
    alone = built(zero=1, ep=2)  # ZeRO over the expert-parallel group, which is data-parallel
    assert [(d.devices, d.zero) for d in alone.directives if isinstance(d, Replicate)] == [((0, 1), 1), ((2, 3), 1)]
    # --tp with --ep: ep tensor-parallel groups side by side (data-parallel replicas of each other,
    # replica j of stage r on r + j * pp), the experts over their tp * ep ranks.
    both = built(zero=1, tp=2, ep=2)
    assert [(d.devices, d.kind, d.degree, d.expert_degree) for d in both.directives if isinstance(d, Shard)] == [
        ((0, 1, 4, 5), "tp", 2, 4), ((2, 3, 6, 7), "tp", 2, 4)
    ]
    assert [(d.devices, d.zero) for d in both.directives if isinstance(d, Replicate)] == [
        ((0, 1, 4, 5), 1), ((2, 3, 6, 7), 1)
    ]



def test_recompute_all_adds_one_recompute_of_every_region_after_the_parallelisms(tmp_path: Path) -> None:
    plain = _request("--dp", "2").resolve(2)
    recomputed = _request("--dp", "2", "--recompute", "all").resolve(2)
    assert recomputed.directives[:-1] == plain.directives
    assert recomputed.of(Recompute) == [Recompute({})] and not plain.of(Recompute)
    from_file = _request("--strategy", _file(tmp_path, one_f_one_b(2, 4, stages=4)), "--recompute", "all")
    assert from_file.resolve(None).of(Recompute) == [Recompute({})]
    # Every N-th region (torchtitan's selective mode with an int): regions 0, N, 2N, ...
    assert _request("--recompute", "2").resolve(6).of(Recompute) == [Recompute({"PP": k}) for k in (0, 2, 4)]
    assert _request("--strategy", _file(tmp_path, one_f_one_b(2, 4, stages=4)), "--recompute", "3").resolve(
        None).of(Recompute) == [Recompute({"PP": 0}), Recompute({"PP": 3})]  # the program's 4 regions
    assert _request("--recompute", "none").resolve(2).of(Recompute) == []


def test_strategy_request_reads_the_file_once_and_says_what_needs_the_model(tmp_path: Path) -> None:
    """A JSON program is read and parsed when the request is made and does not depend on the
    model; a schedule and a torch CSV take the model's region count."""
    json_file = _file(tmp_path, one_f_one_b(2, 4, stages=4))
    request = _request("--strategy", json_file)
    assert request.name == json_file and not request.needs_regions
    Path(json_file).unlink()
    assert request.resolve(None) == request.resolve(8) == one_f_one_b(2, 4, stages=4)
    csv_file = tmp_path / "s.csv"
    csv_file.write_text("0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n")
    csv = _request("--strategy", str(csv_file), "--dp", "2")
    assert csv.needs_regions and csv.name == str(csv_file)
    assert [d.devices for d in csv.resolve(4).directives if isinstance(d, Place)] == [(0, 2), (0, 2), (1, 3), (1, 3)]
    assert _request("--schedule", "gpipe").name == "gpipe"
    with pytest.raises(ValueError, match="cannot read --strategy"):
        _request("--strategy", str(tmp_path / "missing.json"))
