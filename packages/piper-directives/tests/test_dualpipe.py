"""DualPipe: per-rank orders against DeepSeek's ``dualpipe.py``, direction placement, errors.

DeepSeek's reference exists only as control flow (``DualPipe.step``); ``_deepseek_order``
below replays that control flow phase by phase, recording the chunks it computes instead of
computing them, so the library's builder (which reuses DualPipeV's phases) is checked against
an independent reading of the published algorithm. Torch ships no DualPipe generator (only
``ScheduleDualPipeV``).
"""

from __future__ import annotations

from collections import Counter, deque

import pytest

from piper_directives import (
    Order,
    Place,
    Replicate,
    Shard,
    Split,
    Strategy,
    build_schedule,
    dualpipe,
    rank_actions,
)
from piper_directives.synthetic import synthetic_graph
from piper_ir import DirectiveError, NodeKind, Phase


def _deepseek_order(rank: int, pp: int, microbatches: int) -> list[str]:
    """DeepSeek's ``DualPipe.step`` for one rank, as torch action strings.

    ``module[0]`` of rank r is stage r of the forward direction (microbatches ``0 .. M/2-1``,
    fed at rank 0), ``module[1]`` stage ``pp-1-r`` of the reverse one (``M/2 .. M-1``, fed at
    rank pp-1); ranks in the second half swap the meaning of phase 0 and 1 (``phase ^=
    is_in_second_half``). A backward "with zero bubble" is I now and W later, FIFO.
    """
    half_ranks, half = pp // 2, microbatches // 2
    half_rank = min(rank, pp - 1 - rank)
    second_half = rank >= half_ranks
    middle = half_rank == half_ranks - 1
    f_next, b_next = [0, 0], [0, 0]
    weights: deque[str] = deque()
    out: list[str] = []

    def chunk(phase: int, kind: str) -> str:
        module = phase ^ second_half
        stage = rank if module == 0 else pp - 1 - rank
        counter = f_next if kind == "F" else b_next
        mb = counter[module] + module * half
        counter[module] += 1
        if kind == "I":
            weights.append(f"{stage}W{mb}")
        return f"{stage}{kind}{mb}"

    def forward(phase: int) -> None:
        out.append(chunk(phase, "F"))

    def backward(phase: int, zb: bool = False) -> None:
        out.append(chunk(phase, "I" if zb else "B"))

    def forward_backward(phase0: int, phase1: int) -> None:
        out.append(f"({chunk(phase0, 'F')};{chunk(phase1, 'B')})")

    def weight() -> None:
        out.append(weights.popleft())

    for _ in range((half_ranks - half_rank - 1) * 2):  # step 1: nF0
        forward(0)
    for _ in range(half_rank + 1):  # step 2: nF0F1
        forward(0)
        forward(1)
    for _ in range(half_ranks - half_rank - 1):  # step 3: nB1W1F1 (zero bubble)
        backward(1, zb=True)
        weight()
        forward(1)
    for i in range(half - pp + half_rank + 1):  # step 4 (main): nF0B1F1B0
        if i == 0 and middle:  # not overlapped, to shrink the bubble
            forward(0)
            backward(1)
        else:
            forward_backward(0, 1)
        forward_backward(1, 0)
    for _ in range(half_ranks - half_rank - 1):  # step 5: nB1F1B0
        backward(1)
        forward_backward(1, 0)
    zb = False
    step_6 = half_rank + 1
    for i in range(step_6):  # step 6: nB1B0, the second half with zero bubble
        if i == step_6 // 2 and half_rank % 2 == 1:
            zb = True
        backward(1, zb)
        if i == step_6 // 2 and half_rank % 2 == 0:
            zb = True
        backward(0, zb)
    for _ in range(half_ranks - half_rank - 1):  # step 7: nWB0 (zero bubble)
        weight()
        backward(0, zb=True)
    for _ in range(half_rank + 1):  # step 8: nW
        weight()
    assert not weights
    return out


def _table(strategy: Strategy) -> list[list[str]]:
    return [rank_actions(o) for o in strategy.directives if isinstance(o, Order)]


# pp=4, 8 microbatches (4 per direction): rank r holds stages r and 3-r; the middle ranks 1
# and 2 do not overlap their first F/B pair. Ranks r and 3-r are mirror images.
DUALPIPE_4_8 = [
    ["0F0", "0F1", "0F2", "3F4", "3I4", "3W4", "3F5", "(0F3;3B5)", "(3F6;0B0)", "3B6", "(3F7;0B1)", "3B7",
     "0I2", "0W2", "0I3", "0W3"],
    ["1F0", "2F4", "1F1", "2F5", "1F2", "2B4", "(2F6;1B0)", "(1F3;2B5)", "(2F7;1B1)", "2B6", "1B2", "2I7",
     "1I3", "2W7", "1W3"],
    ["1F4", "2F0", "1F5", "2F1", "1F6", "2B0", "(2F2;1B4)", "(1F7;2B1)", "(2F3;1B5)", "2B2", "1B6", "2I3",
     "1I7", "2W3", "1W7"],
    ["0F4", "0F5", "0F6", "3F0", "3I0", "3W0", "3F1", "(0F7;3B1)", "(3F2;0B4)", "3B2", "(3F3;0B5)", "3B3",
     "0I6", "0W6", "0I7", "0W7"],
]


def test_order_pp4_m8_as_written_out():
    assert _table(dualpipe(4, 8)) == DUALPIPE_4_8
    assert [_deepseek_order(r, 4, 8) for r in range(4)] == DUALPIPE_4_8


@pytest.mark.parametrize("pp", [2, 4, 6, 8])
def test_orders_match_deepseek(pp):
    for m in range(2 * pp, 4 * pp + 1, 2):
        assert _table(dualpipe(pp, m)) == [_deepseek_order(r, pp, m) for r in range(pp)], m


@pytest.mark.parametrize(("pp", "m"), [(2, 4), (4, 8), (4, 10), (6, 14), (8, 20)])
def test_every_chunk_once_on_its_direction_rank(pp, m):
    """Stage s of microbatch i runs on rank s (first half) or pp-1-s (second half): F once,
    then B or I before W, once."""
    done: Counter = Counter()
    for rank, actions in enumerate(_table(dualpipe(pp, m))):
        seen: set = set()
        for cell in actions:
            for a in cell.strip("()").split(";"):
                stage, letter, mb = int(a[0]), a[1], int(a[2:])
                assert rank == (stage if mb < m // 2 else pp - 1 - stage), a
                assert (stage, "F", mb) in seen or letter == "F", a
                assert letter != "W" or (stage, "I", mb) in seen, a
                seen.add((stage, letter, mb))
                done[(stage, letter, mb)] += 1
    for s in range(pp):
        for i in range(m):
            assert done[(s, "F", i)] == 1 and done[(s, "B", i)] + done[(s, "I", i)] == 1
            assert done[(s, "W", i)] == done[(s, "I", i)]


def test_direction_placement():
    strategy = dualpipe(4, 8, stages=8)
    places = [d for d in strategy.directives if isinstance(d, Place)]
    got = {(d.filter.as_dict()["PP"], d.filter.as_dict()["MB"]): d.devices for d in places}
    first, second = (0, 1, 2, 3), (4, 5, 6, 7)
    # two regions per stage: stage k holds regions 2k and 2k+1
    assert got == {(j, mbs): ((j // 2 if mbs == first else 3 - j // 2),) for j in range(8) for mbs in (first, second)}
    assert Strategy.from_json(strategy.to_json()) == strategy  # MB sets survive JSON


def test_graph_nodes_run_by_direction():
    pp, m = 4, 8
    g = build_schedule("dualpipe", pp, m).apply(synthetic_graph(pp, m, 1, hidden=4))
    for n in g.nodes:
        if n.kind is NodeKind.COMPUTE and n.segment != "loss":
            s = int(n.segment[1:])
            assert n.devices == ((s if n.microbatch < m // 2 else pp - 1 - s),), n.id
        if n.kind is NodeKind.COMPUTE and n.segment == "loss":
            assert n.devices == ((pp - 1 if n.microbatch < m // 2 else 0),), n.id
        if n.kind is NodeKind.OPTIMIZER:
            s = int(n.segment[1:])
            assert n.devices == tuple(sorted({s, pp - 1 - s})), n.id
    # The mirror pair sums gradients; no value is sharded (each replica runs whole microbatches).
    assert {(r.segment, r.devices, r.zero) for r in g.replication if r.segment != "loss"} == {
        (f"s{s}", tuple(sorted({s, pp - 1 - s})), 0) for s in range(pp)
    }
    plain = synthetic_graph(pp, m, 1, hidden=4)
    assert {v.name: v.meta.shape for v in g.values} == {
        v.name: v.meta.split(m).shape for v in plain.values
    }
    assert any(n.phase is Phase.BI for n in g.nodes) and any(n.phase is Phase.B for n in g.nodes)


def test_data_parallel_replicates_over_mirror_times_dp():
    strategy = dualpipe(2, 4, dp=2, zero=1)
    g = strategy.apply(synthetic_graph(2, 4, batch=2, hidden=4))
    assert {(r.segment, r.devices, r.zero) for r in g.replication if r.segment != "loss"} == {
        ("s0", (0, 1, 2, 3), 1), ("s1", (0, 1, 2, 3), 1)
    }
    assert {n.devices for n in g.nodes if n.kind is NodeKind.COMPUTE} == {(0, 2), (1, 3)}
    assert all(b.shards == 4 for b in g.buckets)


@pytest.mark.parametrize("zero", [2, 3])
def test_zero_2_3_shard_each_direction_over_its_own_replicas(zero):
    """ZeRO-2/3 on mirrored replicas: one set of buckets per direction, sharded over that
    direction's data-parallel ranks, each naming the other direction's as its mirror."""
    g = dualpipe(2, 4, dp=2, zero=zero).apply(synthetic_graph(2, 4, batch=2, hidden=4))
    assert {(r.segment, r.devices, r.zero) for r in g.replication if r.segment != "loss"} == {
        ("s0", (0, 1, 2, 3), zero), ("s1", (0, 1, 2, 3), zero)
    }
    assert {(b.id, b.devices, b.shards, b.mirrors) for b in g.buckets} == {
        ("bucket:s0:d0:0", (0, 2), 2, ("bucket:s0:d1:0",)),
        ("bucket:s0:d1:0", (1, 3), 2, ("bucket:s0:d0:0",)),
        ("bucket:s1:d0:0", (1, 3), 2, ("bucket:s1:d1:0",)),
        ("bucket:s1:d1:0", (0, 2), 2, ("bucket:s1:d0:0",)),
    }
    assert len({(b.params, b.numel) for b in g.buckets if b.segment == "s0"}) == 1  # one layout


def test_zero_2_on_mirrored_single_device_groups_is_refused():
    """Without data parallelism each direction is one device: nothing to shard over."""
    strategy = Strategy([*dualpipe(2, 4).directives, Replicate({"PP": 0}, (0, 1), zero=2)])
    with pytest.raises(DirectiveError, match=r"mirrored replicas .* on \[\[0\], \[1\]\]: ZeRO-2 shards over each group"):
        strategy.apply(synthetic_graph(2, 4, batch=2, hidden=4))


def test_zero_3_on_a_mirrored_tensor_parallel_segment_is_refused():
    strategy = Strategy([
        Split(2),
        Place({"PP": 0, "MB": 0}, (0, 1)),
        Place({"PP": 0, "MB": 1}, (2, 3)),
        Shard({"PP": 0}, (0, 1, 2, 3), degree=2),
        Replicate({"PP": 0}, (0, 1, 2, 3), zero=3),
    ])
    with pytest.raises(DirectiveError, match="is tp-sharded: ZeRO-3 on such a segment is not supported"):
        strategy.apply(synthetic_graph(1, 2, batch=4, hidden=4))


def test_torch_csv_shows_each_rank_row_but_does_not_load_back():
    """Written for inspection (one row per rank, as DualPipe's figure reads); torch's format
    keeps a stage on one rank, so a mirrored stage cannot be read back."""
    from piper_directives.torch_format import strategy_from_torch_csv, strategy_to_torch_csv

    text = strategy_to_torch_csv(dualpipe(4, 8))
    rows = [row.split(",") for row in text.strip().splitlines()]
    assert [[c.removesuffix("OVERLAP_F_B") for c in row] for row in rows] == DUALPIPE_4_8
    with pytest.raises(DirectiveError, match="stage 1 is computed on ranks 1 and 2"):
        strategy_from_torch_csv(text, 4, 8)
