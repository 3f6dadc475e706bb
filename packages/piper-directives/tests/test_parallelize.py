"""``parallelize``: data, tensor and expert parallelism composed over every library schedule.

Two checks per combination of schedule x dp x zero x tp/ep that the ``piper`` command
accepts: the strategy is byte-for-byte the one the code composed before ``parallelize``
existed (``golden/parallelize.txt``), and its directives follow the documented layout (stage
r of replica j on ``(r + j * pp) * k + t``), derived here from the pipeline program alone.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from piper_directives import (
    DegreeError,
    Order,
    Place,
    Replicate,
    Shard,
    Split,
    build_schedule,
    check_degrees,
    expert_parallel,
    one_f_one_b,
    parallelize,
)
from piper_ir import MB, DirectiveError, Filter, ShardKind

GOLDEN = Path(__file__).parent / "golden" / "parallelize.txt"

# (schedule, pp, microbatches, stages): one and several regions per rank, for every schedule.
CONFIGS = [
    ("gpipe", 2, 4, None), ("gpipe", 2, 4, 4), ("gpipe", 4, 8, None), ("1f1b", 2, 4, None), ("1f1b", 3, 6, 6),
    ("interleaved_1f1b", 2, 4, None), ("interleaved_1f1b", 2, 4, 8), ("zb1p", 2, 4, None),
    ("dualpipe", 2, 4, None), ("dualpipe", 4, 8, 8), ("dualpipev", 2, 4, None), ("dualpipev", 2, 4, 8),
    ("zb1p", 3, 6, None),
]
SHARDS = [(1, 1), (2, 1), (3, 1), (1, 2), (1, 4)]  # (tp, ep)


def combinations() -> list[tuple]:
    """Every schedule x dp x zero x tp/ep the piper command accepts (ZeRO needs dp or ep >= 2)."""
    return [
        (name, pp, m, stages, dp, zero, tp, ep)
        for name, pp, m, stages in CONFIGS
        for dp in (1, 2, 3)
        for zero in (0, 1, 2, 3)
        for tp, ep in SHARDS
        if not (zero and dp < 2 and ep < 2)
    ]


def _key(name: str, pp: int, m: int, stages: int | None, dp: int, zero: int, tp: int, ep: int) -> str:
    return f"{name} pp={pp} microbatches={m} stages={stages} dp={dp} zero={zero} tp={tp} ep={ep}"


def _fingerprint(combo: tuple) -> str:
    name, pp, m, stages, dp, zero, tp, ep = combo
    text = build_schedule(name, pp, m, stages=stages, dp=dp, zero=zero, tp=tp, ep=ep).to_json()
    return f"{_key(*combo)} {hashlib.sha256(text.encode()).hexdigest()[:16]}"


def test_every_combination_composes_as_before() -> None:
    golden = [line for line in GOLDEN.read_text().splitlines() if not line.startswith("#")]
    assert [_fingerprint(c) for c in combinations()] == golden


@pytest.mark.parametrize("combo", combinations(), ids=lambda c: _key(*c).replace(" ", ","))
def test_layout(combo: tuple) -> None:
    """The directives, derived from the pipeline program: each Place(filter, (r,)) on
    ``(r + j * pp) * k + t``; a Shard of degree k on each group with k > 1; a Replicate per
    region (over the union of its groups) when there are data-parallel replicas, or ZeRO on
    an expert-parallel group; Split and Order unchanged."""
    name, pp, m, stages, dp, zero, tp, ep = combo
    pipeline = build_schedule(name, pp, m, stages=stages)
    got = build_schedule(name, pp, m, stages=stages, dp=dp, zero=zero, tp=tp, ep=ep)
    assert parallelize(pipeline, dp=dp, zero=zero, tp=tp, ep=ep) == got
    k = max(tp, ep)

    def group(place: Place) -> tuple[int, ...]:
        (r,) = place.devices
        return tuple((r + j * pp) * k + t for j in range(dp) for t in range(k))

    places = pipeline.of(Place)
    assert [(p.filter, p.devices, p.stream) for p in got.of(Place)] == [(p.filter, group(p), p.stream) for p in places]
    assert got.of(Split) == pipeline.of(Split) and got.of(Order) == pipeline.of(Order)
    kind = ShardKind.EP if ep > 1 else ShardKind.TP
    assert [(s.filter, s.devices, s.kind, s.degree) for s in got.of(Shard)] == (
        [(p.filter, group(p), kind, k) for p in places] if k > 1 else []
    )
    regions: dict[Filter, list[int]] = {}
    for p in places:
        regions.setdefault(Filter(tuple(i for i in p.filter.items if i[0] != MB)), []).extend(group(p))
    if dp > 1:
        want = [(f, tuple(sorted(set(devices))), zero) for f, devices in regions.items()]
    elif ep > 1 and zero:
        want = [(p.filter, group(p), zero) for p in places]
    else:
        want = []
    assert [(r.filter, r.devices, r.zero) for r in got.of(Replicate)] == want


def test_every_device_holds_a_region() -> None:
    """The layout numbers pp * dp * k devices without gaps (Place refuses gaps)."""
    for name, pp, m, stages, dp, zero, tp, ep in combinations():
        got = build_schedule(name, pp, m, stages=stages, dp=dp, zero=zero, tp=tp, ep=ep)
        assert sorted({d for p in got.of(Place) for d in p.devices}) == list(range(pp * dp * max(tp, ep)))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tp": 2, "ep": 2, "sp": True}, "parallelize: sequence parallelism .sp. with expert parallelism .ep. is not"),
        ({"tp": 0}, "parallelize: tp must be a positive int, got 0"),
        ({"ep": True}, "parallelize: ep must be a positive int, got True"),
        ({"zero": 1}, "parallelize: ZeRO-1 shards over data-parallel replicas; it needs dp >= 2"),
        ({"tp": 2, "zero": 1}, "parallelize: ZeRO-1 shards over data-parallel replicas; it needs dp >= 2"),
        ({"dp": 0}, "parallelize: dp must be a positive int, got 0"),
    ],
)
def test_errors(kwargs: dict, message: str) -> None:
    with pytest.raises(DirectiveError, match=message.replace("(", r"\(")):
        parallelize(one_f_one_b(2, 2), **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "options"),
    [
        ({"tp": 0}, ("tp",)),
        ({"zero": 1}, ("zero", "dp")),
        ({"zero": 1, "tp": 2}, ("zero", "dp")),
        ({"dp": 0}, ("dp",)),
        ({"dp": 2, "zero": 4}, ("zero",)),
    ],
)
def test_degree_errors_name_the_options_at_fault(kwargs: dict, options: tuple[str, ...]) -> None:
    """``options`` is what the piper command turns into its flags (``--zero``/``--dp``)."""
    with pytest.raises(DegreeError) as err:
        check_degrees(**kwargs)
    assert err.value.options == options
    assert not err.value.message.startswith(":")  # no caller, no prefix


def test_zero_without_replicas_is_one_rule_for_every_entry() -> None:
    """parallelize, data_parallel (through build_schedule) and expert_parallel refuse it alike."""
    needs = "ZeRO-2 shards over data-parallel replicas; it needs dp >= 2 (or ep >= 2"
    for call in (lambda: parallelize(one_f_one_b(2, 2), zero=2),
                 lambda: expert_parallel(one_f_one_b(2, 2), 1, zero=2)):
        with pytest.raises(DegreeError, match=needs.replace("(", r"\(")):
            call()
    assert parallelize(one_f_one_b(2, 2), ep=2, zero=2).of(Replicate)  # the expert group is data-parallel


def test_identity_without_parallelism() -> None:
    plain = one_f_one_b(2, 4)
    assert parallelize(plain) is plain


if __name__ == "__main__":  # regenerate the golden file (a deliberate change of the composed strategies)
    header = [line for line in GOLDEN.read_text().splitlines() if line.startswith("#")]
    print("\n".join([*header, *(_fingerprint(c) for c in combinations())]))
