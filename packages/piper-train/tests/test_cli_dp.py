"""``--dp``, ``--zero`` and ``--memory-budget-mb`` of ``piper train`` / ``piper check`` (no Ray:
the budget fails at compile time, before any worker starts)."""

from __future__ import annotations

import argparse
import json

import pytest

from piper_directives import Place, Replicate, Strategy, one_f_one_b
from piper_train.cli import _replicated, main


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["check", "--zero", "2"], "--zero shards over data-parallel replicas"),
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


def test_dp_composes_with_a_schedule_and_a_strategy_file() -> None:
    args = argparse.Namespace(dp=2, zero=3)
    built = _replicated(args, lambda stages: one_f_one_b(2, 4, stages=stages))(2)
    assert [d.devices for d in built.directives if isinstance(d, Place)] == [(0, 2), (1, 3)]
    assert [(d.devices, d.zero) for d in built.directives if isinstance(d, Replicate)] == [((0, 2), 3), ((1, 3), 3)]
    from_file = _replicated(args, Strategy.from_json(one_f_one_b(2, 4).to_json()))
    assert isinstance(from_file, Strategy) and sum(isinstance(d, Replicate) for d in from_file.directives) == 2
    plain = one_f_one_b(2, 4)
    assert _replicated(argparse.Namespace(dp=1, zero=0), plain) is plain


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


def test_tp_composes_with_a_schedule_and_a_strategy_file() -> None:
    from piper_directives import Shard

    args = argparse.Namespace(dp=1, zero=0, tp=2)
    built = _replicated(args, lambda stages: one_f_one_b(2, 4, stages=stages))(2)
    assert [d.devices for d in built.directives if isinstance(d, Place)] == [(0, 1), (2, 3)]
    assert [d.devices for d in built.directives if isinstance(d, Shard)] == [(0, 1), (2, 3)]
    from_file = _replicated(args, Strategy.from_json(one_f_one_b(2, 4).to_json()))
    assert isinstance(from_file, Strategy) and sum(isinstance(d, Shard) for d in from_file.directives) == 2


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["check", "--tp", "0"], "--tp must be >= 1"),
        (["train", "--tp", "2", "--zero", "1"], "--zero shards over data-parallel replicas"),
    ],
)
def test_bad_tp_flags(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as err:
        main(argv)
    assert err.value.code == 2
    assert message in capsys.readouterr().err


def test_ep_composes_with_a_schedule_and_a_strategy_file() -> None:
    from piper_directives import Shard

    args = argparse.Namespace(dp=1, zero=0, tp=1, ep=2)
    built = _replicated(args, lambda stages: one_f_one_b(2, 4, stages=stages))(2)
    assert [d.devices for d in built.directives if isinstance(d, Place)] == [(0, 1), (2, 3)]
    assert [(d.devices, d.kind) for d in built.directives if isinstance(d, Shard)] == [((0, 1), "ep"), ((2, 3), "ep")]
    from_file = _replicated(args, Strategy.from_json(one_f_one_b(2, 4).to_json()))
    assert isinstance(from_file, Strategy) and sum(isinstance(d, Shard) for d in from_file.directives) == 2


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["check", "--ep", "0"], "--ep must be >= 1"),
        (["train", "--ep", "2", "--tp", "2"], "--ep with --tp (tensor and expert parallelism in one strategy) "
                                              "is not supported yet"),
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
    from piper_directives import Shard

    def built(**flags: int) -> Strategy:
        args = argparse.Namespace(**{"dp": 1, "zero": 0, "tp": 1, "ep": 1, **flags})
        return _replicated(args, lambda stages: one_f_one_b(2, 4, stages=stages))(2)

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


def test_old_cli_composition_equals_parallelize() -> None:
    """Transitional: the CLI's own composition (``_replicated``) against ``parallelize`` for
    every combination the CLI accepts, before the CLI switches to ``parallelize``."""
    from piper_directives import build_schedule, parallelize

    combos = [
        (name, pp, m, stages, dp, zero, tp, ep)
        for name, pp, m, stages in [("gpipe", 2, 4, None), ("1f1b", 3, 6, 6), ("interleaved_1f1b", 2, 4, 8),
                                    ("zb1p", 2, 4, None), ("dualpipe", 4, 8, 8), ("dualpipev", 2, 4, None)]
        for dp in (1, 2, 3)
        for zero in (0, 1, 2, 3)
        for tp, ep in [(1, 1), (2, 1), (3, 1), (1, 2), (1, 4)]
        if not (zero and dp < 2 and ep < 2)
    ]
    for name, pp, m, stages, dp, zero, tp, ep in combos:
        old = _replicated(argparse.Namespace(dp=dp, zero=zero, tp=tp, ep=ep),
                          lambda st, name=name, pp=pp, m=m: build_schedule(name, pp, m, stages=st))(stages)
        new = parallelize(build_schedule(name, pp, m, stages=stages), dp=dp, zero=zero, tp=tp, ep=ep)
        assert old == new and old.to_json() == new.to_json()
        assert build_schedule(name, pp, m, stages=stages, dp=dp, zero=zero, tp=tp, ep=ep) == new
