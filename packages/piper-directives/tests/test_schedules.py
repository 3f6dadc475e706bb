"""The schedule library: per-rank orders against the published tables, placements, errors.

The tables are torch.distributed.pipelining's (``ScheduleInterleaved1F1B``,
``ScheduleInterleavedZeroBubble`` with one stage per rank, ``ScheduleDualPipeV``, itself a port
of DeepSeek's ``dualpipev.py``) in torch's action notation: ``2F0`` is stage 2's forward of
microbatch 0, ``I``/``W`` the halves of a split backward, ``(a;b)`` an overlapped slot.
"""

import re
from collections import Counter

import pytest
import torch
from torch import nn

from piper_directives import (
    SCHEDULES,
    Order,
    Place,
    annotate,
    build_schedule,
    capture,
    dualpipe,
    dualpipev,
    interleaved_1f1b,
    rank_actions,
    zb1p,
)
from piper_ir import DirectiveError, NodeKind, Phase


def _orders(strategy):
    return [d for d in strategy.directives if isinstance(d, Order)]


def _table(strategy, regions_per_stage=1):
    return [rank_actions(o, regions_per_stage=regions_per_stage) for o in _orders(strategy)]


def _placement(strategy):
    return {d.filter.as_dict()["PP"]: d.devices[0] for d in strategy.directives if isinstance(d, Place)}


INTERLEAVED_2_4 = [
    ["0F0", "0F1", "2F0", "2F1", "0F2", "2B0", "0F3", "2B1", "2F2", "0B0", "2F3", "0B1", "2B2", "2B3", "0B2", "0B3"],
    ["1F0", "1F1", "3F0", "3B0", "3F1", "3B1", "1F2", "1B0", "1F3", "1B1", "3F2", "3B2", "3F3", "3B3", "1B2", "1B3"],
]
INTERLEAVED_2_2_V3 = [
    ["0F0", "0F1", "2F0", "2F1", "4F0", "4F1", "4B0", "4B1", "2B0", "2B1", "0B0", "0B1"],
    ["1F0", "1F1", "3F0", "3F1", "5F0", "5B0", "5F1", "5B1", "3B0", "3B1", "1B0", "1B1"],
]
ZB1P_2_4 = [
    ["0F0", "0F1", "0I0", "0W0", "0F2", "0I1", "0W1", "0F3", "0I2", "0W2", "0I3", "0W3"],
    ["1F0", "1I0", "1F1", "1I1", "1W0", "1F2", "1I2", "1W1", "1F3", "1I3", "1W2", "1W3"],
]
ZB1P_3_3 = [
    ["0F0", "0F1", "0F2", "0I0", "0W0", "0I1", "0W1", "0I2", "0W2"],
    ["1F0", "1F1", "1I0", "1F2", "1I1", "1W0", "1I2", "1W1", "1W2"],
    ["2F0", "2I0", "2F1", "2I1", "2F2", "2I2", "2W0", "2W1", "2W2"],
]
DUALPIPEV_2_4 = [
    ["0F0", "0F1", "0F2", "3F0", "3I0", "3W0", "3F1", "(0F3;3B1)", "(3F2;0B0)", "3B2", "(3F3;0B1)", "3B3",
     "0I2", "0W2", "0I3", "0W3"],
    ["1F0", "2F0", "1F1", "2F1", "1F2", "2B0", "(2F2;1B0)", "(1F3;2B1)", "(2F3;1B1)", "2B2", "1B2", "2I3",
     "1I3", "2W3", "1W3"],
]


@pytest.mark.parametrize(
    ("strategy", "table"),
    [
        (interleaved_1f1b(2, 4), INTERLEAVED_2_4),
        (interleaved_1f1b(2, 2, stages=6), INTERLEAVED_2_2_V3),
        (zb1p(2, 4), ZB1P_2_4),
        (zb1p(3, 3), ZB1P_3_3),
        (dualpipev(2, 4), DUALPIPEV_2_4),
    ],
    ids=["interleaved-pp2-m4", "interleaved-pp2-m2-v3", "zb1p-pp2-m4", "zb1p-pp3-m3", "dualpipev-pp2-m4"],
)
def test_orders_match_published_tables(strategy, table):
    assert _table(strategy) == table


def test_placements():
    assert _placement(interleaved_1f1b(2, 4, stages=6)) == {0: 0, 1: 1, 2: 0, 3: 1, 4: 0, 5: 1}
    assert _placement(zb1p(2, 4, stages=4)) == {0: 0, 1: 0, 2: 1, 3: 1}
    assert _placement(dualpipev(3, 6)) == {0: 0, 1: 1, 2: 2, 3: 2, 4: 1, 5: 0}
    # several regions per V stage: stage k holds regions 2k and 2k+1
    assert _placement(dualpipev(2, 4, stages=8)) == {0: 0, 1: 0, 2: 1, 3: 1, 4: 1, 5: 1, 6: 0, 7: 0}
    assert _table(dualpipev(2, 4, stages=8), regions_per_stage=2) == DUALPIPEV_2_4


def test_loss_runs_in_the_last_stage_slots():
    order = _orders(dualpipev(2, 4))[0]  # rank 0 holds the last stage (3) and the loss
    loss_f = [k for k, slot in enumerate(order.slots) for f in slot if f.as_dict().get("SEG") == "loss"
              and f.as_dict()["PASS"] == "F"]
    stage_f = [k for k, slot in enumerate(order.slots) for f in slot if f.as_dict().get("PP") == 3
               and f.as_dict()["PASS"] == "F"]
    assert loss_f == stage_f
    assert not any(f.as_dict().get("SEG") == "loss" for o in _orders(dualpipev(2, 4))[1:] for s in o.slots for f in s)


def _complete(table, stage_rank, microbatches):
    """Each (stage, microbatch) runs F once and B (or I then W) once, on its own rank."""
    done: Counter = Counter()
    for rank, actions in enumerate(table):
        seen = []
        for action in actions:
            for a in action.strip("()").split(";"):
                stage_text, letter, mb_text = re.fullmatch(r"(\d+)([FBIW])(\d+)", a).groups()
                stage, mb = int(stage_text), int(mb_text)
                assert stage_rank[stage] == rank, a
                if letter == "W":
                    assert (stage, "I", mb) in seen, f"{a} before its I"
                if letter in "BI":
                    assert (stage, "F", mb) in seen, f"{a} before its F"
                seen.append((stage, letter, mb))
                done[(stage, "B" if letter in "IW" else letter, mb)] += 1 if letter != "W" else 0
    stages = len(stage_rank)
    assert done == Counter({(s, p, i): 1 for s in range(stages) for p in "FB" for i in range(microbatches)})


@pytest.mark.parametrize("pp", [1, 2, 3, 4])
@pytest.mark.parametrize("microbatches", [1, 2, 4, 5, 8, 12])
def test_every_chunk_once_on_its_rank(pp, microbatches):
    for v in (1, 2, 3):
        if microbatches % max(1, microbatches // pp) == 0:
            _complete(_table(interleaved_1f1b(pp, microbatches, stages=v * pp)), [k % pp for k in range(v * pp)], microbatches)
    if microbatches >= pp:
        _complete(_table(zb1p(pp, microbatches)), list(range(pp)), microbatches)
    if microbatches >= 2 * pp:
        _complete(_table(dualpipev(pp, microbatches)), [min(k, 2 * pp - 1 - k) for k in range(2 * pp)], microbatches)


def _torch_table(cls, pp, microbatches, rank, v=None):
    sched = cls.__new__(cls)  # only the pure ordering method is used: no stages, no process group
    sched.pp_group_size, sched._n_microbatches = pp, microbatches
    if v is not None:
        sched.n_local_stages = v
        sched.number_of_rounds = max(1, microbatches // pp)
        sched.microbatches_per_round = microbatches // sched.number_of_rounds
    out = []
    for a in sched._calculate_single_rank_operations(rank):
        if a is not None:
            out.append("(" + ";".join(map(str, a.sub_actions)) + ")" if a.sub_actions else str(a))
    return out


@pytest.mark.parametrize("pp", [2, 3, 4])
def test_against_torch_pipelining(pp):
    """Cross-check with torch's own schedule generators (private API: skipped if it moved)."""
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    try:
        _torch_table(schedules.ScheduleDualPipeV, 2, 4, 0)
    except Exception as err:  # any change in torch's internals
        pytest.skip(f"torch's schedule internals changed: {err!r}")
    for m in range(pp, 3 * pp + 1):
        for v in (1, 2):
            if m % max(1, m // pp) == 0:
                want = [_torch_table(schedules.ScheduleInterleaved1F1B, pp, m, r, v) for r in range(pp)]
                assert _table(interleaved_1f1b(pp, m, stages=v * pp)) == want
        want = [_torch_table(schedules.ScheduleInterleavedZeroBubble, pp, m, r, 1) for r in range(pp)]
        assert _table(zb1p(pp, m)) == want
        if m >= 2 * pp:
            want = [_torch_table(schedules.ScheduleDualPipeV, pp, m, r) for r in range(pp)]
            assert _table(dualpipev(pp, m)) == want


class Regions(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            with annotate("PP"):
                x = torch.tanh(layer(x))
        return x


def _graph(regions, batch=8):
    torch.manual_seed(0)
    return capture(Regions(regions), (torch.randn(batch, 4),), (torch.randn(batch, 4),), nn.functional.mse_loss).graph


@pytest.mark.parametrize(
    ("name", "pp", "m", "regions"),
    [("interleaved_1f1b", 2, 4, 4), ("interleaved_1f1b", 4, 8, 8), ("interleaved_1f1b", 4, 2, 8),
     ("zb1p", 2, 4, 2), ("zb1p", 4, 8, 4), ("zb1p", 2, 4, 4),
     ("dualpipev", 2, 4, 4), ("dualpipev", 4, 8, 8), ("dualpipev", 2, 8, 8)],
)
def test_schedules_apply_to_a_captured_model(name, pp, m, regions):
    """The orders are acyclic with the data flow; zb1p/dualpipev split exactly the chunks they name."""
    strategy = build_schedule(name, pp, m, stages=regions)
    g = strategy.apply(_graph(regions))
    assert g.world_size == pp and g.microbatches == m
    compute = [n for n in g.nodes if n.kind is NodeKind.COMPUTE and n.segment != "loss"]
    phases = Counter(n.phase for n in compute)
    assert phases[Phase.F] == regions * m
    assert phases[Phase.B] + phases[Phase.BI] == regions * m and phases[Phase.BI] == phases[Phase.BW]
    named = sum(a.count("I") for t in _table(strategy, regions_per_stage=1) for a in t)
    assert phases[Phase.BI] == named
    if name == "zb1p":
        assert phases[Phase.B] == 0


def test_dualpipev_mixes_fused_and_split_backward():
    g = dualpipev(2, 4).apply(_graph(4))
    ids = set(g.node_by_id)
    assert {"BI.s3.mb0", "BW.s3.mb0", "B.s3.mb1", "B.s0.mb0", "BI.s0.mb3"} <= ids
    assert "B.s3.mb0" not in ids


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: interleaved_1f1b(2, 4, stages=3), "3 annotated regions cannot be dealt round-robin over 2 ranks"),
        (lambda: interleaved_1f1b(4, 9), r"9 microbatches cannot be run in 2 equal rounds"),
        (lambda: interleaved_1f1b(0, 4), "pp must be a positive int"),
        (lambda: zb1p(4, 3), "at least as many microbatches as ranks"),
        (lambda: zb1p(2, 4, stages=3), "3 stages cannot be spread evenly over 2"),
        (lambda: dualpipev(2, 3), r"at least 2 \* pp = 4 microbatches, got 3"),
        (lambda: dualpipev(2, 4, stages=6), "6 annotated regions cannot form the 4 stages of a V"),
        (lambda: dualpipev(2, 4, stages=2), "2 annotated regions cannot form the 4 stages"),
        (lambda: dualpipe(3, 6), "even number of ranks"),
        (lambda: dualpipe(2, 5), "even number of microbatches"),
        (lambda: dualpipe(4, 6), "at least 2 \\* pp = 8"),
        (lambda: dualpipe(2, 4, stages=3), "3 annotated regions cannot form 2 stages"),
        (lambda: dualpipe(2, 4, dp=2, zero=4), "zero must be one of 0, 1, 2, 3, got 4"),
        (lambda: dualpipe(2, 4, zero=1), "it needs dp >= 2"),
        (lambda: build_schedule("zb2p", 2, 4), "unknown schedule 'zb2p'"),
    ],
)
def test_bad_schedule_input(call, message):
    with pytest.raises(DirectiveError, match=message):
        call()


def test_registry_names():
    assert {"gpipe", "1f1b", "interleaved_1f1b", "zb1p", "dualpipe", "dualpipev"} <= set(SCHEDULES)
